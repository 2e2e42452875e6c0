"""The real-PyTorch tests that make sense on a GPU: those of ``python/tests/real_torch`` that ask
nothing of the fake CUDA (no fake counters, no out-of-memory at the fake's small memory size, no
injected faults, no fake device count), run by ``scripts/gpu-check`` against the GPU with ``FERROCACHE_REAL_GPU=1``.

A test renamed or removed here is a failure of ``python/tests/test_gpu_check.py``, not a
silently shorter list.
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

DIRECTORY = "python/tests/real_torch"

#: (test file, test function): each runs on any GPU.
ON_ANY_GPU = (
    ("test_install_real.py", "test_install_makes_ferrocache_pytorchs_allocator_once"),
    ("test_install_real.py", "test_the_settings_given_reach_the_library"),
    ("test_install_real.py", "test_the_log_level_given_is_used_and_a_bad_one_refused"),
    ("test_real_torch.py", "test_install_after_cuda_is_initialised_is_a_clear_error"),
    ("test_real_torch.py", "test_bytes_come_back_unchanged_after_thousands_of_allocations"),
    ("test_real_torch.py", "test_a_training_shaped_loop_keeps_reserved_memory_stable"),
    ("test_drop_in.py", "test_memory_stats_have_pytorchs_keys_and_figures"),
    ("test_drop_in.py", "test_each_function_answers_by_torchs_names_for_every_device_form"),
    ("test_drop_in.py", "test_peak_resets_by_torchs_names"),
    ("test_drop_in.py", "test_reset_accumulated_memory_stats_by_torchs_name"),
    ("test_drop_in.py", "test_memory_summary_is_pytorchs_table_line_for_line"),
    ("test_drop_in.py", "test_nothing_changes_without_install"),
    ("test_drop_in.py", "test_caching_allocator_alloc_and_delete_keep_working"),
    ("test_drop_in.py", "test_snapshots_carry_python_frames"),
    ("test_drop_in.py", "test_context_state_keeps_stacks_for_live_blocks_only"),
    ("test_drop_in.py", "test_with_recording_off_allocations_do_not_call_into_python"),
    ("test_drop_in.py", "test_pytorchs_memory_viz_reads_the_dumped_snapshot"),
    ("test_cuda_graphs.py", "test_allocations_inside_a_capture_come_from_the_graphs_pool"),
    ("test_cuda_graphs.py", "test_a_block_freed_during_capture_is_not_handed_out_until_the_graph_is_reset"),
    ("test_cuda_graphs.py", "test_graphs_sharing_a_pool_reuse_each_others_blocks_and_nobody_else_gets_them"),
    ("test_cuda_graphs.py", "test_mem_pool_is_refused_by_pytorch_and_offered_by_ferrocache"),
    ("test_settings_real.py", "test_every_key_is_accepted_or_refused_as_by_pytorch"),
    ("test_settings_real.py", "test_snapshot_allocator_settings_are_pytorchs"),
)
#: Those that expect exactly one GPU (the log line says "for 1 device(s)").
ON_ONE_GPU = (("test_real_torch.py", "test_info_log_lines_from_a_real_pytorch_process"),)
#: Those that need a second GPU.
ON_TWO_GPUS = (("test_real_torch.py", "test_tensors_on_the_second_device_use_its_allocator"),)


def chosen(device_count: int) -> list[tuple[str, str]]:
    """The tests for a machine with ``device_count`` GPUs."""
    return list(ON_ANY_GPU) + list(ON_ONE_GPU if device_count == 1 else ON_TWO_GPUS)


def node_ids(tests: list[tuple[str, str]]) -> list[str]:
    """pytest's node ids, relative to the repository root."""
    return [f"{DIRECTORY}/{file}::{function}" for file, function in tests]


def results(junit_xml: Path) -> list[dict[str, Any]]:
    """Each test case of pytest's JUnit XML: its name, outcome (passed, failed, skipped) and,
    where it did not pass, the first line of why."""
    cases = []
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        outcome, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, why = "failed", child.get("message") or (child.text or "")
            elif child.tag == "skipped":
                outcome, why = "skipped", child.get("message") or ""
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        cases.append({"name": f"{module}::{case.get('name')}", "outcome": outcome,
                      "why": (why.strip().splitlines() or [""])[0][:200],
                      "seconds": float(case.get("time") or 0.0)})  # fmt: skip
    return cases
