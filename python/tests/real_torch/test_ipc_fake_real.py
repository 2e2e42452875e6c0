"""A CUDA tensor sent to another process with ``torch.multiprocessing`` (spawn), under PyTorch's
own allocator on the fake CUDA: the child reads the bytes the parent wrote and writes some back,
which the parent reads. PyTorch shares ``cudaMalloc`` memory with ``cudaIpcGetMemHandle`` /
``cudaIpcOpenMemHandle`` and orders the two sides with an interprocess event; with
``expandable_segments:True`` it exports the segment's pages as file descriptors
(``cuMemExportToShareableHandle``), which the child takes with ``pidfd_getfd`` and imports
(tests/fake-cuda/README.md, "CUDA IPC").

No kernel runs on the fake, so bytes move with copies only. The round trip fails if the child's
memory is a private copy of the parent's: ``FAKE_LIBCUDA_IPC_PRIVATE_COPY=1`` makes the fake do
just that, and the last test shows the round trip then fails.

ferrocache's own allocator object shares and opens them in PyTorch's handle format:
``test_ipc_frontend_real.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch_env import MIB, require_real_torch, torch_env

require_real_torch()

#: The parent writes a pattern with a host-to-device copy and sends the tensor; the child reads
#: it, writes its own bytes into the middle, and says what it saw; the parent reads them.
PROGRAM = textwrap.dedent(
    """
    import ctypes, json, sys
    import torch
    import torch.multiprocessing as mp

    SIZE = int(sys.argv[2])
    MIDDLE = slice(SIZE // 2, SIZE // 2 + 4096)

    def fake_stat(name):
        fake = ctypes.CDLL("libcuda.so.1")
        fake.fake_cuda_stat.restype = ctypes.c_int64
        fake.fake_cuda_stat.argtypes = [ctypes.c_char_p]
        return fake.fake_cuda_stat(name.encode())

    def pattern(seed):
        return (torch.arange(SIZE, dtype=torch.int64) * 31 + seed).remainder(251).to(torch.uint8)

    def child(tensors, answers, done):
        shared = tensors.get()
        seen = bool(torch.equal(shared.cpu(), pattern(1)))
        shared[MIDDLE].copy_(torch.full((4096,), 7, dtype=torch.uint8))
        torch.cuda.synchronize()
        answers.put({
            "child_saw_the_parent_bytes": seen,
            "child_opened": fake_stat("cuIpcOpenMemHandle_v2"),
            "child_imported": fake_stat("cuMemImportFromShareableHandle"),
            "child_waited_on_events": fake_stat("cuIpcOpenEventHandle"),
        })
        done.wait()
        del shared

    if __name__ == "__main__":
        context = mp.get_context("spawn")
        tensors, answers, done = context.Queue(), context.Queue(), context.Event()
        tensor = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        tensor.copy_(pattern(1))
        worker = context.Process(target=child, args=(tensors, answers, done))
        worker.start()
        tensors.put(tensor)
        answer = answers.get(timeout=120)
        back = tensor.cpu()
        expected = pattern(1)
        expected[MIDDLE] = 7
        answer["parent_sees_the_child_bytes"] = bool(torch.equal(back[MIDDLE], expected[MIDDLE]))
        start, end = MIDDLE.start, MIDDLE.stop
        answer["rest_unchanged"] = bool(
            torch.equal(back[:start], expected[:start]) and torch.equal(back[end:], expected[end:])
        )
        done.set()
        worker.join(timeout=120)
        answer["child_exit"] = worker.exitcode
        answer["memory_handles"] = fake_stat("cuIpcGetMemHandle")
        answer["fd_exports"] = fake_stat("cuMemExportToShareableHandle")
        answer["event_handles"] = fake_stat("cuIpcGetEventHandle")
        answer["expandable"] = fake_stat("cuMemCreate") > 0
        with open(sys.argv[1], "w") as out:
            json.dump(answer, out)
    """
)


def round_trip(tmp_path: Path, size: int, **env: str) -> dict:
    """Runs the program under PyTorch's allocator; what the two processes saw."""
    script = tmp_path / "ipc_round_trip.py"
    script.write_text(PROGRAM)
    out = tmp_path / "out.json"
    full_env = dict(os.environ)
    full_env.pop("FERROCACHE_LIBRARY", None)
    full_env.update(torch_env(**env))
    process = subprocess.run(
        [sys.executable, str(script), str(out), str(size)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert process.returncode == 0 and out.exists(), (
        f"exit {process.returncode}\n--- stdout\n{process.stdout}\n--- stderr\n{process.stderr}"
    )
    return json.loads(out.read_text())


#: A tensor of a small segment's size, and one of its own large segment.
SIZES = [64 << 10, 24 * MIB]


@pytest.mark.parametrize("size", SIZES, ids=["small", "large"])
def test_a_tensor_sent_to_a_spawned_process_is_the_same_memory_both_ways(tmp_path, size):
    answer = round_trip(tmp_path, size)
    assert answer == {
        "child_saw_the_parent_bytes": True,
        "parent_sees_the_child_bytes": True,
        "rest_unchanged": True,
        "child_exit": 0,
        "child_opened": 1,
        "child_imported": 0,
        "child_waited_on_events": 1,
        "memory_handles": 1,
        "fd_exports": 0,
        "event_handles": 1,
        "expandable": False,
    }


def test_an_expandable_segment_sent_to_a_spawned_process_is_the_same_memory_both_ways(tmp_path):
    answer = round_trip(tmp_path, 24 * MIB, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert answer["expandable"], answer
    assert answer["fd_exports"] >= 1 and answer["child_imported"] >= 1, answer
    assert answer["memory_handles"] == 0 and answer["child_opened"] == 0, answer
    assert answer["child_saw_the_parent_bytes"], answer
    assert answer["parent_sees_the_child_bytes"] and answer["rest_unchanged"], answer
    assert answer["child_exit"] == 0, answer


@pytest.mark.parametrize(
    "conf", ["", "expandable_segments:True"], ids=["cudaMalloc", "expandable"]
)
def test_the_round_trip_fails_when_the_child_gets_a_private_copy(tmp_path, conf):
    answer = round_trip(
        tmp_path, 24 * MIB, PYTORCH_CUDA_ALLOC_CONF=conf, FAKE_LIBCUDA_IPC_PRIVATE_COPY="1"
    )
    # The copy holds the parent's bytes as they were, but the child's writes stay in it.
    assert answer["child_saw_the_parent_bytes"], answer
    assert not answer["parent_sees_the_child_bytes"], answer
