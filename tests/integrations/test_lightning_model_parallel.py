"""AmpatchPrecision under Lightning's ModelParallelStrategy: the LightningModule shards itself
with `fully_shard` in `configure_model`, and the plugin's `connect` then initializes on the
sharded model, at FP32 masters and at the low-memory master modes; every rank ends with the
same full model. Tensor parallelism (DTensors outside `fully_shard`) is refused at initialize."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "_lightning_model_parallel_worker.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _ranks(tmp_path: Path, level: str, mode: str) -> list[dict]:
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path), level, mode], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.distributed
@pytest.mark.parametrize("level,mode,dtype", [("O5", "default", "torch.float32"),
                                              ("O5", "stochastic", "torch.bfloat16"),
                                              ("O5", "kahan", "torch.bfloat16")])
def test_fsdp2_in_configure_model_trains_and_keeps_the_ranks_together(tmp_path: Path, level: str, mode: str,
                                                                       dtype: str) -> None:
    ranks = _ranks(tmp_path, level, mode)
    assert ranks[0]["world"] == ranks[1]["world"] == 2
    assert ranks[0]["dtypes"] == [dtype]          # sharded O5: FP32 shards are the masters; low-memory: bf16 only
    assert ranks[0]["mode"] == ("fp32" if mode == "default" else mode)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank saw its own batches
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["full"], ranks[1]["full"]))


@pytest.mark.distributed
def test_tensor_parallel_dtensors_are_refused_before_anything_changes(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        import ampatch as amp
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=0, world_size=1)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        parallelize_module(m, init_device_mesh("cpu", (1,)), {{"0": ColwiseParallel()}})
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        try:
            amp.initialize(m, o, opt_level="O2")
            print("accepted")
        except ValueError as e:
            print("refused", m[0].weight.dtype, "step" in vars(o), e)
        dist.destroy_process_group()
        os._exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("refused torch.float32 False"), done.stdout
    assert "'0.weight' is a DTensor outside every fully_shard unit" in done.stdout
    assert "tensor_parallel_size=1" in done.stdout
