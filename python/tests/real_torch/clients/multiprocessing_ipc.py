"""CUDA tensors between processes: ``torch.multiprocessing`` (spawn) sends a CUDA tensor to a
child, which reads its bytes, writes new ones into it and sends a CUDA tensor of its own back;
then a DataLoader whose worker (spawn) returns CUDA tensors. The bytes travel by copies from the
host (kernels compute nothing on the fake), so what each side reads shows that the memory is
shared: the sender reads what the child wrote into its tensor after opening it.
"""

import torch
import torch.multiprocessing as mp

import _figures


def child(connection):
    received = connection.recv()
    seen = received.cpu().tolist()
    received.copy_(torch.tensor([4, 5, 6], dtype=torch.int64))  # into the sender's memory
    torch.cuda.synchronize()
    del received
    answer = torch.tensor([7, 8, 9], dtype=torch.int64).cuda()
    connection.send((seen, answer))
    assert connection.recv() == "done"  # keeps `answer` alive until the parent has read it


class CudaItems(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor([index] * 4, dtype=torch.int64).cuda()


if __name__ == "__main__":
    context = mp.get_context("spawn")
    sent = torch.tensor([1, 2, 3], dtype=torch.int64).cuda()
    # A pipe, not a queue: it pickles in this thread, so a tensor that cannot be shared
    # raises here instead of in a queue's feeder thread while this one waits forever.
    connection, child_end = context.Pipe()
    # daemon: a parent that fails does not wait at exit for a child that waits for it.
    process = context.Process(target=child, args=(child_end,), daemon=True)
    process.start()
    child_end.close()
    connection.send(sent)
    seen, answer = connection.recv()
    _figures.note("child_read", seen)
    _figures.note("child_wrote", sent.cpu().tolist())
    _figures.note("parent_read", answer.cpu().tolist())
    del answer
    connection.send("done")
    process.join()
    _figures.note("child_exit", process.exitcode)
    _figures.step("multiprocessing")

    loader = torch.utils.data.DataLoader(
        CudaItems(), batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    _figures.note("loader_read", [item.cpu().tolist() for item in loader])
    _figures.step("dataloader")
    _figures.write()
