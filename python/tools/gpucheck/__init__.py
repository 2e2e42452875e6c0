"""The GPU check behind ``scripts/gpu-check``: ferrocache side by side with PyTorch's native
allocator on a real GPU, written up as ``gpu-results.md`` and ``report.json``.

- :mod:`gpucheck.cli` parses the arguments and runs the steps (install, then each workload in
  fresh processes, each step within its cap), keeps the output to what the GPU machine gives
  back, and afterwards, off the GPU, replays and tunes the returned snapshot (``--analyse``);
- :mod:`gpucheck.processes` starts the children, each in a process group of its own, and ends them;
- :mod:`gpucheck.workloads` holds the programs that run on the GPU, one process each;
- :mod:`gpucheck.bench` runs the host-cost measurement, interleaving two worker processes;
- :mod:`gpucheck.checks` turns the workloads' raw results into verdicts;
- :mod:`gpucheck.report` writes the Markdown and JSON.

Everything but the workloads runs (and is tested) without a GPU.
"""
