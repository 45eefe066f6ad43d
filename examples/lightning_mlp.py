"""Lightning: ampatch's opt levels through a precision plugin.

`Trainer(plugins=[AmpatchPrecision("O2")])` trains a LightningModule with half weights,
FP32 master weights and a dynamic loss scale (O2/O5), or any other level; the module
itself is plain Lightning (its step may call `self(x)` or a submodule, `self.net(x)`: at
O2/O3/O5 the batch is cast and tensors made in the step are half, as with "bf16-true").

    pip install 'ampatch[integrations]'
    python examples/lightning_mlp.py --opt-level O2 --steps 50
    ampatch compare --levels O0,O2,O5 -- python examples/lightning_mlp.py --steps 50
"""
from __future__ import annotations

import argparse
import logging

import lightning.pytorch as L
import torch
from torch import nn
from torch.nn import functional as F

import ampatch as amp
from ampatch.lightning import AmpatchPrecision


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
        self.last_loss = float("nan")
        self.level = "?"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.last_loss = loss.item()
        return loss

    def on_train_end(self) -> None:
        self.level = amp.report().opt_level  # the level that ran (`ampatch run/compare` may force one)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = (x[:, :4].sum(1) > 0).long()  # a toy task the model can learn
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    model = Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, gradient_clip_val=1.0,
                        plugins=[AmpatchPrecision(args.opt_level)], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    print(f"final loss {model.last_loss:.4f}  ({model.level}, {trainer.global_step} steps)")
    return model.last_loss


if __name__ == "__main__":
    main()
