"""CUDA tensors between processes: ``torch.multiprocessing`` (spawn) sends a CUDA tensor to a
child, which reads its bytes and sends a CUDA tensor of its own back; then a DataLoader whose
worker (spawn) returns CUDA tensors. The bytes travel by copies from the host (kernels compute
nothing on the fake), so what each side reads shows that the memory is shared.
"""

import torch
import torch.multiprocessing as mp

import _figures


def child(inbox, outbox):
    received = inbox.get()
    seen = received.cpu().tolist()
    del received
    answer = torch.tensor([7, 8, 9], dtype=torch.int64).cuda()
    outbox.put((seen, answer))
    assert inbox.get() == "done"  # keeps `answer` alive until the parent has read it


class CudaItems(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor([index] * 4, dtype=torch.int64).cuda()


if __name__ == "__main__":
    context = mp.get_context("spawn")
    sent = torch.tensor([1, 2, 3], dtype=torch.int64).cuda()
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=child, args=(inbox, outbox))
    process.start()
    inbox.put(sent)
    seen, answer = outbox.get()
    _figures.note("child_read", seen)
    _figures.note("parent_read", answer.cpu().tolist())
    del answer
    inbox.put("done")
    process.join()
    _figures.note("child_exit", process.exitcode)
    _figures.step("multiprocessing")

    loader = torch.utils.data.DataLoader(
        CudaItems(), batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    _figures.note("loader_read", [item.cpu().tolist() for item in loader])
    _figures.step("dataloader")
    _figures.write()
