"""ferrocache.advise() and the out-of-memory advice with real PyTorch on the fake CUDA: the
history comes from PyTorch's own torch.cuda.memory._record_memory_history() (answered by
ferrocache once installed), the out-of-memory reaches Python as torch.cuda.OutOfMemoryError
with PyTorch's message, and the setting the advice names does serve the same program."""

from __future__ import annotations

import re
import shlex

from torch_env import MIB, require_real_torch, run_torch, run_torch_process, torch_env

require_real_torch()

#: A training-like pattern whose split cached block strands memory: on a 200 MiB GPU PyTorch's
#: defaults cannot serve the last 50 MiB although only 120 MiB are live.
STRANDED = """
    ferrocache.install()
    M = 2**20
    def block(mib):
        return torch.empty(mib * M, dtype=torch.uint8, device="cuda")
    first = block(100)
    del first
    b = block(60)
    c = block(60)
"""


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[ERROR]")]


def test_advise_reads_pytorchs_own_history_call() -> None:
    out = run_torch(
        STRANDED.replace(
            "    first = block(100)", "    torch.cuda.memory._record_memory_history()\n    first = block(100)"
        )
        + """
    advice = ferrocache.advise()
    result({"table": str(advice), "conf": advice.recommended_conf,
            "current": advice.current_peak_reserved_bytes,
            "recommended": advice.recommended_peak_reserved_bytes,
            "max_reserved": torch.cuda.max_memory_reserved(), "capacity": advice.capacity_bytes})
""",
        env=torch_env(200 * MIB),
    )
    assert out["current"] == out["max_reserved"] == 160 * MIB, "the replay is what happened"
    assert out["capacity"] == 200 * MIB
    assert out["conf"] and out["recommended"] < out["current"]
    assert "this process (device 0)" in out["table"]
    assert "\n  export PYTORCH_CUDA_ALLOC_CONF=" in out["table"] and out["conf"] in out["table"]


def test_without_history_advise_says_how_to_record() -> None:
    out = run_torch(
        STRANDED
        + """
    try:
        ferrocache.advise()
    except ferrocache.NoHistoryError as err:
        result(str(err))
""",
        env=torch_env(200 * MIB),
    )
    assert "torch.cuda.memory._record_memory_history()" in out


OOM_PROGRAM = (
    STRANDED
    + """
    try:
        d = block(50)
        print("served")
    except torch.cuda.OutOfMemoryError as err:
        print("caught:", str(err).splitlines()[0][:40])
"""
)


def test_the_out_of_memory_names_a_setting_and_that_setting_serves_the_program() -> None:
    recording = OOM_PROGRAM.replace(
        "    first = block(100)", "    torch.cuda.memory._record_memory_history()\n    first = block(100)"
    )
    process = run_torch_process(recording, env=torch_env(200 * MIB))
    assert "caught: CUDA out of memory. Tried to allocate" in process.stdout, process.stderr
    errors = _errors(process.stderr)
    assert len(errors) == 2, process.stderr
    assert errors[0].startswith("[ERROR] Allocator: CUDA out of memory. Tried to allocate 50.00 MiB")
    named = re.match(r"\[ERROR\] Allocator: advice: PYTORCH_CUDA_ALLOC_CONF=(\S+) would have served", errors[1])
    assert named, errors[1]
    assert "within the 200.0 MiB it could use on GPU 0" in errors[1]
    conf = shlex.split(named.group(1))[0]
    # Under that setting the same program runs on the same GPU (PyTorch reads it too).
    again = run_torch_process(OOM_PROGRAM, env=torch_env(200 * MIB, PYTORCH_CUDA_ALLOC_CONF=conf))
    assert "served" in again.stdout, (conf, again.stderr)


def test_without_history_one_line_says_how_to_get_the_advice() -> None:
    process = run_torch_process(
        OOM_PROGRAM + "    try:\n        block(500)\n    except torch.cuda.OutOfMemoryError:\n        pass\n",
        env=torch_env(200 * MIB),
    )
    errors = _errors(process.stderr)
    hints = [line for line in errors if "to learn which PYTORCH_CUDA_ALLOC_CONF" in line]
    assert len(hints) == 1 and errors[1] == hints[0], process.stderr
    assert len(errors) == 3, "two out-of-memory messages, one hint"
