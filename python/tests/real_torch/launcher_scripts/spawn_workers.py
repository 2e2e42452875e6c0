"""multiprocessing with the spawn start method: the parent never touches CUDA; each spawned
child allocates and reports through a queue whether ferrocache served it."""

import json
import multiprocessing
import sys


def child(queue):
    import torch

    x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    ferrocache = sys.modules.get("ferrocache")
    queue.put({
        "installed": bool(ferrocache and ferrocache.is_installed()),
        "allocated_current": torch.cuda.memory_stats().get("allocated_bytes.all.current", 0),
    })
    del x


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=child, args=(queue,)) for _ in range(2)]
    for w in workers:
        w.start()
    answers = [queue.get(timeout=240) for _ in workers]
    for w in workers:
        w.join()
    with open(sys.argv[1], "w") as f:
        json.dump({"children": answers, "exit_codes": [w.exitcode for w in workers]}, f)
