"""CUDA tensors shared between processes through ferrocache's own allocator object
(python/ferrocache/frontend.cpp, src/ffi/ipc.rs), in PyTorch's own handle format: from a
ferrocache process to one on PyTorch's allocator, the other way, and between two ferrocache
processes; plain segments (``cuIpcGetMemHandle``), expandable segments and ferrocache's
sleep-able (VMM) segments (POSIX file descriptors taken with ``pidfd_getfd``).

On the fake CUDA (tests/fake-cuda, "CUDA IPC") the device memory is memfd pages that both
processes map, so the bytes each side reads show the memory is shared: the receiver reads the
sender's pattern and writes into the middle, and the sender reads that back.

The sender's block must not be reused while the receiver holds it. PyTorch's reference counting
(torch/csrc/CudaIPCTypes.h) keeps the sender's storage alive until the receiver's count falls to
zero; the test frees the sender's tensor while the receiver still holds it, allocates again, and
checks that the address is reused only after the receiver let go and ``torch.cuda.ipc_collect()``
ran; and the fake counts a free of memory still open elsewhere (``ipc_freed_while_open``).

Each program asserts that ferrocache's front end is installed where it should be, so a silent
fallback to ``CUDAPluggableAllocator`` (which refuses IPC) fails here.
"""

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

#: What both child programs start with: the fake's counters, and the allocator a process uses
#: (``use`` answers PyTorch's name of its backend).
CHILD_HELPERS = textwrap.dedent(
    """
    import ctypes, gc, json, sys
    import torch
    import torch.multiprocessing as mp

    def fake_stat(name):
        fake = ctypes.CDLL("libcuda.so.1")
        fake.fake_cuda_stat.restype = ctypes.c_int64
        fake.fake_cuda_stat.argtypes = [ctypes.c_char_p]
        return fake.fake_cuda_stat(name.encode())

    def use(allocator):
        if allocator == "ferrocache":
            import ferrocache
            ferrocache.install()
            from ferrocache import frontend
            assert frontend.is_installed(), "install() fell back to CUDAPluggableAllocator"
        torch.empty(1, device="cuda")
        return torch._C._cuda_getAllocatorBackend()
    """
)

PROGRAM = CHILD_HELPERS + textwrap.dedent(
    """
    OUT, SENDER, RECEIVER, SIZE = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    MIDDLE = slice(SIZE // 2, SIZE // 2 + 4096)


    def pattern(seed):
        return (torch.arange(SIZE, dtype=torch.int64) * 31 + seed).remainder(251).to(torch.uint8)

    def child(allocator, connection):
        backend = use(allocator)
        received = connection.recv()
        seen = bool(torch.equal(received.cpu(), pattern(1)))
        received[MIDDLE].copy_(torch.full((4096,), 7, dtype=torch.uint8))
        torch.cuda.synchronize()
        connection.send({
            "receiver": backend,
            "receiver_saw_the_sender_bytes": seen,
            "receiver_opened": fake_stat("cuIpcOpenMemHandle_v2"),
            "receiver_imported": fake_stat("cuMemImportFromShareableHandle"),
        })
        assert connection.recv() == "let go"
        del received
        gc.collect()
        connection.send({"receiver_still_open": fake_stat("ipc_opened")})
        assert connection.recv() == "done"

    if __name__ == "__main__":
        answer = {"sender": use(SENDER)}
        connection, child_end = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(
            target=child, args=(RECEIVER, child_end), daemon=True)
        process.start()
        child_end.close()
        tensor = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        tensor.copy_(pattern(1))
        address = tensor.data_ptr()
        connection.send(tensor)
        answer.update(connection.recv())
        back = tensor.cpu()
        expected = pattern(1)
        expected[MIDDLE] = 7
        answer["sender_sees_the_receiver_bytes"] = bool(torch.equal(back, expected))

        # The sender lets go first: the block waits for the receiver (PyTorch's limbo).
        del tensor
        torch.cuda.ipc_collect()
        held = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        answer["reused_while_the_receiver_holds_it"] = held.data_ptr() == address
        connection.send("let go")
        answer.update(connection.recv())
        torch.cuda.ipc_collect()
        again = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        answer["reused_once_the_receiver_let_go"] = again.data_ptr() == address
        del held, again
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        connection.send("done")
        process.join(timeout=120)
        answer["receiver_exit"] = process.exitcode
        answer["memory_handles"] = fake_stat("cuIpcGetMemHandle")
        answer["fd_exports"] = fake_stat("cuMemExportToShareableHandle")
        answer["freed_while_open"] = fake_stat("ipc_freed_while_open")
        with open(OUT, "w") as out:
            json.dump(answer, out)
    """
)


def share(tmp_path: Path, sender: str, receiver: str, size: int, **env: str) -> dict:
    """Sends a tensor of ``size`` bytes from a process on ``sender`` to one on ``receiver``
    ("ferrocache" or "native"); what the two saw."""
    script = tmp_path / "share.py"
    script.write_text(PROGRAM)
    out = tmp_path / "out.json"
    full_env = dict(os.environ)
    full_env.pop("FERROCACHE_LIBRARY", None)
    full_env.update(torch_env(FAKE_CUDA_ORDER_FATAL="1", **env))
    process = subprocess.run(
        [sys.executable, str(script), str(out), sender, receiver, str(size)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert process.returncode == 0 and out.exists(), (
        f"exit {process.returncode}\n--- stdout\n{process.stdout[-4000:]}\n"
        f"--- stderr\n{process.stderr[-8000:]}"
    )
    return json.loads(out.read_text())


def backend(allocator: str) -> str:
    return "ferrocache" if allocator == "ferrocache" else "native"


#: Sender and receiver: ferrocache to PyTorch's allocator, the other way, ferrocache to itself.
DIRECTIONS = [("ferrocache", "native"), ("native", "ferrocache"), ("ferrocache", "ferrocache")]
DIRECTION_IDS = ["ferrocache-to-native", "native-to-ferrocache", "ferrocache-to-ferrocache"]


def assert_shared_and_released(answer: dict, sender: str, receiver: str) -> None:
    assert answer["sender"] == backend(sender) and answer["receiver"] == backend(receiver), answer
    assert answer["receiver_saw_the_sender_bytes"], answer
    assert answer["sender_sees_the_receiver_bytes"], answer
    assert not answer["reused_while_the_receiver_holds_it"], answer
    assert answer["reused_once_the_receiver_let_go"], answer
    assert answer["receiver_still_open"] == 0, answer
    assert answer["freed_while_open"] == 0, answer
    assert answer["receiver_exit"] == 0, answer


@pytest.mark.parametrize("sender,receiver", DIRECTIONS, ids=DIRECTION_IDS)
@pytest.mark.parametrize("size", [64 << 10, 24 * MIB], ids=["small", "large"])
def test_a_tensor_in_a_plain_segment_is_the_same_memory_in_both_processes(
    tmp_path, sender, receiver, size
):
    answer = share(tmp_path, sender, receiver, size)
    assert_shared_and_released(answer, sender, receiver)
    # A memory handle of the segment's base, opened once; no file descriptors.
    assert answer["memory_handles"] >= 1 and answer["receiver_opened"] == 1, answer
    assert answer["fd_exports"] == 0 and answer["receiver_imported"] == 0, answer


@pytest.mark.parametrize("sender,receiver", DIRECTIONS, ids=DIRECTION_IDS)
def test_a_tensor_in_an_expandable_segment_is_the_same_memory_in_both_processes(
    tmp_path, sender, receiver
):
    answer = share(
        tmp_path, sender, receiver, 24 * MIB, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
    )
    assert_shared_and_released(answer, sender, receiver)
    # Each page under the tensor as a file descriptor, taken by the receiver and imported.
    assert answer["fd_exports"] >= 1 and answer["receiver_imported"] >= 1, answer
    assert answer["memory_handles"] == 0 and answer["receiver_opened"] == 0, answer


@pytest.mark.parametrize("receiver", ["native", "ferrocache"])
def test_a_tensor_in_a_sleepable_segment_is_shared_as_its_physical_memory(tmp_path, receiver):
    answer = share(tmp_path, "ferrocache", receiver, 24 * MIB, FERROCACHE_SLEEP="1")
    assert_shared_and_released(answer, "ferrocache", receiver)
    assert answer["fd_exports"] == 1 and answer["receiver_imported"] == 1, answer
    assert answer["memory_handles"] == 0, answer


LOADER = textwrap.dedent(
    """
    import json, sys
    import torch

    def use():
        import ferrocache
        ferrocache.install()
        from ferrocache import frontend
        assert frontend.is_installed(), "install() fell back to CUDAPluggableAllocator"

    def worker_init(_):
        use()

    class CudaItems(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, index):
            item = torch.full((3 << 20,), index, dtype=torch.int32).cuda()
            return {"backend": torch._C._cuda_getAllocatorBackend(), "item": item}

    if __name__ == "__main__":
        # Kernels compute nothing on the fake: the items are read with whole copies.
        use()
        loader = torch.utils.data.DataLoader(
            CudaItems(), batch_size=None, num_workers=2, multiprocessing_context="spawn",
            worker_init_fn=worker_init)
        read = [(got["backend"], got["item"].cpu()[::1 << 20].tolist()) for got in loader]
        with open(sys.argv[1], "w") as out:
            json.dump(read, out)
    """
)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"], ids=["plain", "expandable"])
def test_dataloader_workers_on_ferrocache_return_cuda_tensors(tmp_path, conf):
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    out = tmp_path / "out.json"
    env = dict(os.environ)
    env.pop("FERROCACHE_LIBRARY", None)
    env.update(torch_env(FAKE_CUDA_ORDER_FATAL="1", PYTORCH_CUDA_ALLOC_CONF=conf))
    process = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-8000:]
    assert json.loads(out.read_text()) == [["ferrocache", [i] * 3] for i in range(6)]


TWO_IN_ONE_SEGMENT = CHILD_HELPERS + textwrap.dedent(
    """
    OUT, SENDER, RECEIVER = sys.argv[1], sys.argv[2], sys.argv[3]


    def child(allocator, connection):
        use(allocator)
        first, second = connection.recv()
        answer = {
            "read": [first.cpu().tolist(), second.cpu().tolist()],
            "opened": fake_stat("cuIpcOpenMemHandle_v2"),
            "open_while_held": fake_stat("ipc_opened"),
        }
        del first
        gc.collect()
        answer["open_while_one_is_held"] = fake_stat("ipc_opened")
        del second
        gc.collect()
        answer["open_after_both"] = fake_stat("ipc_opened")
        connection.send(answer)

    if __name__ == "__main__":
        use(SENDER)
        connection, child_end = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(
            target=child, args=(RECEIVER, child_end), daemon=True)
        process.start()
        child_end.close()
        first = torch.tensor([1, 2, 3], dtype=torch.int64).cuda()
        second = torch.tensor([4, 5, 6], dtype=torch.int64).cuda()
        connection.send((first, second))
        answer = connection.recv()
        process.join(timeout=120)
        answer["exit"] = process.exitcode
        with open(OUT, "w") as out:
            json.dump(answer, out)
    """
)


@pytest.mark.parametrize("receiver", ["native", "ferrocache"])
def test_two_tensors_of_one_segment_are_opened_once_until_both_are_let_go(tmp_path, receiver):
    """The receiver keeps one mapping per handle, as PyTorch's ``ipcMemHandle_to_devptr``: two
    tensors of one small segment share its memory handle, so it is opened once and closed when
    the last of them goes."""
    script = tmp_path / "two.py"
    script.write_text(TWO_IN_ONE_SEGMENT)
    out = tmp_path / "out.json"
    env = dict(os.environ)
    env.pop("FERROCACHE_LIBRARY", None)
    env.update(torch_env(FAKE_CUDA_ORDER_FATAL="1"))
    process = subprocess.run(
        [sys.executable, str(script), str(out), "ferrocache", receiver], env=env,
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-8000:]
    assert json.loads(out.read_text()) == {
        "read": [[1, 2, 3], [4, 5, 6]],
        "opened": 1,
        "open_while_held": 1,
        "open_while_one_is_held": 1,
        "open_after_both": 0,
        "exit": 0,
    }
