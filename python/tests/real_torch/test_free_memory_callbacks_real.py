"""PyTorch's free-memory callbacks on a cache miss, under ferrocache's own allocator object
(python/ferrocache/frontend.cpp, src/ffi/free_memory.rs) as under PyTorch's allocator.

PyTorch's ``malloc`` runs every ``c10::FreeCudaMemoryCallbacksRegistry`` entry when its search
of the cached blocks misses, and searches again if one freed memory. libtorch_python registers
"cuda_ipc_collect": it frees the blocks waiting in the CUDA IPC limbo (a sender's storage that
it deleted while a receiver still held it) once every receiver let go. So a sender whose next
allocation misses the cache reuses such a block instead of asking the device for a new segment.

Here a sender shares a CUDA tensor with a child process (on PyTorch's allocator), deletes its own
tensor while the child holds it (the block goes to the limbo), the child lets go, and the sender
allocates the same size, which no cached block serves. Run under PyTorch's allocator and under
ferrocache, with plain and with expandable segments, the figures are the same: the limbo's block
is reused at the same address, and no segment, page or reserved byte is added.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_ipc_frontend_real import CHILD_HELPERS
from torch_env import MIB, require_real_torch, torch_env

require_real_torch()

PROGRAM = CHILD_HELPERS + textwrap.dedent(
    """
    OUT, SENDER, SIZE = sys.argv[1], sys.argv[2], int(sys.argv[3])


    def child(connection):
        use("native")
        received = connection.recv()
        connection.send("holding")
        assert connection.recv() == "let go"
        del received
        gc.collect()
        connection.send("let go")
        assert connection.recv() == "done"

    def figures():
        stats = torch.cuda.memory_stats()
        return {
            "reserved": stats["reserved_bytes.all.current"],
            "segments": stats["segment.all.current"],
            "device_allocations": stats["num_device_alloc"],
            "device_bytes": fake_stat("bytes_in_use"),
            "mapped_pages": fake_stat("cuMemMap"),
        }

    if __name__ == "__main__":
        answer = {"sender": use(SENDER)}
        connection, child_end = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(target=child, args=(child_end,), daemon=True)
        process.start()
        child_end.close()
        tensor = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        address = tensor.data_ptr()
        connection.send(tensor)
        assert connection.recv() == "holding"
        # The sender lets go first: its block waits in PyTorch's limbo for the receiver.
        del tensor
        connection.send("let go")
        assert connection.recv() == "let go"
        before = figures()
        # No cached block serves it: the miss runs the callbacks, which free the limbo's block.
        again = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        after = figures()
        answer["reused_the_limbo_block"] = again.data_ptr() == address
        answer["added"] = {name: after[name] - before[name] for name in before}
        answer["reserved"] = after["reserved"]
        del again
        connection.send("done")
        process.join(timeout=120)
        answer["receiver_exit"] = process.exitcode
        answer["freed_while_open"] = fake_stat("ipc_freed_while_open")
        with open(OUT, "w") as out:
            json.dump(answer, out)
    """
)


def run(tmp_path: Path, sender: str, conf: str) -> dict:
    """What the sender saw, on ``sender`` ("ferrocache" or "native")."""
    script = tmp_path / f"collect_{sender}.py"
    script.write_text(PROGRAM)
    out = tmp_path / f"out_{sender}.json"
    env = dict(os.environ)
    env.pop("FERROCACHE_LIBRARY", None)
    env.update(torch_env(FAKE_CUDA_ORDER_FATAL="1", PYTORCH_CUDA_ALLOC_CONF=conf))
    process = subprocess.run(
        [sys.executable, str(script), str(out), sender, str(24 * MIB)], env=env,
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert process.returncode == 0 and out.exists(), (
        f"exit {process.returncode}\n--- stdout\n{process.stdout[-4000:]}\n"
        f"--- stderr\n{process.stderr[-8000:]}"
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"], ids=["plain", "expandable"])
def test_a_miss_reuses_the_ipc_limbo_block_as_pytorchs_allocator_does(tmp_path, conf):
    native = run(tmp_path, "native", conf)
    ferrocache = run(tmp_path, "ferrocache", conf)
    assert (native["sender"], ferrocache["sender"]) == ("native", "ferrocache")
    # PyTorch's own allocator: the limbo's block, at its address; nothing new from the device.
    assert native["reused_the_limbo_block"], native
    assert set(native["added"].values()) == {0}, native
    for answer in (native, ferrocache):
        assert answer["receiver_exit"] == 0 and answer["freed_while_open"] == 0, answer
    # ferrocache: the same figures.
    assert {key: ferrocache[key] for key in ("reused_the_limbo_block", "added", "reserved")} == {
        key: native[key] for key in ("reused_the_limbo_block", "added", "reserved")
    }, (native, ferrocache)
