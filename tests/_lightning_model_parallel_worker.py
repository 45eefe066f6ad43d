"""Run by integrations/test_lightning_model_parallel.py: AmpatchPrecision under Lightning's
ModelParallelStrategy (FSDP2 in configure_model) on 2 CPU processes (gloo), started by
Lightning's own launcher. Each rank writes its losses and the
full parameters (DTensor.full_tensor) to OUT/rank{r}.pt. Usage: OUT LEVEL MASTER_WEIGHTS"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import ampatch as amp
from ampatch.lightning import AmpatchPrecision


class Sharded(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Save(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, module) -> None:
        full = [p.full_tensor().detach().float().clone() if hasattr(p, "full_tensor") else p.detach().float().clone()
                for p in module.parameters()]
        torch.save({"world": trainer.world_size, "losses": module.losses, "full": full,
                    "dtypes": sorted({str(p.dtype) for p in module.parameters()}),
                    "mode": amp.report().to_dict().get("master_weights")},
                   self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    out, level, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    keywords = {"master_weights": mode} if mode != "default" else {}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                        tensor_parallel_size=1), max_steps=4,
                        plugins=[AmpatchPrecision(level, verbosity=0, **keywords)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Save(out)])
    trainer.fit(Sharded(), loader)


if __name__ == "__main__":
    main()
