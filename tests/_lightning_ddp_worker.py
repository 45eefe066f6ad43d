"""Run by integrations/test_lightning_trainer.py: AmpatchPrecision("O2") under Lightning's DDP strategy on 2 CPU
processes (gloo), started by Lightning's own launcher (it runs this script again for rank
1). Each rank writes its losses, FP32 masters and half params before teardown to
OUT/rank{r}.pt."""
from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import nn
from torch.nn import functional as F

import ampatch as amp
from ampatch.lightning import AmpatchPrecision


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Save(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, module: MLP) -> None:
        opt = trainer.optimizers[0]
        torch.save({"world": trainer.world_size, "losses": module.losses,
                    "masters": [p.detach().clone() for p in amp.master_params(opt)],
                    "params": [p.detach().clone() for p in module.parameters()]},
                   self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(trainer_seed := 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3,
                        plugins=[AmpatchPrecision("O2", half_dtype=torch.bfloat16, verbosity=0)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Save(out)])
    torch.manual_seed(trainer_seed + trainer.global_rank)  # different initial weights: DDP must broadcast
    trainer.fit(MLP(), loader)


if __name__ == "__main__":
    main()
