"""The GPU check behind ``scripts/gpu-check``: ferrocache side by side with PyTorch's native
allocator on a real GPU, written up as ``report.md`` and ``report.json``.

- :mod:`gpucheck.cli` parses the arguments and runs the steps (build and install, then each
  workload in fresh processes, then the replay of the native run's snapshot);
- :mod:`gpucheck.workloads` holds the programs that run on the GPU, one process each;
- :mod:`gpucheck.bench` runs the host-cost measurement, interleaving two worker processes;
- :mod:`gpucheck.checks` turns the workloads' raw results into verdicts;
- :mod:`gpucheck.report` writes the Markdown and JSON.

Everything but the workloads runs (and is tested) without a GPU.
"""
