"""A trainer library's loop: Lightning's ``Trainer.fit`` for four steps on one GPU with mixed
precision (``precision="16-mixed"``: ``torch.autocast`` and a gradient scaler), without logger,
checkpoints or progress bar. The batches come from a DataLoader of host tensors.
"""

import lightning
import torch

import _figures


class Regression(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, index):
        _figures.step(f"batch {index}")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.ones(32, 32), torch.zeros(32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8)
trainer = lightning.Trainer(
    accelerator="gpu", devices=1, max_steps=4, precision="16-mixed", logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)  # fmt: skip
trainer.fit(Regression(), loader)
_figures.write()
