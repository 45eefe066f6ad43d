"""`fp8=` on several ranks: FSDP2 and DDP.

Two real processes (gloo on loopback) run every scenario of tests/_fp8_worker.py once:
- FSDP2, tensorwise: the layers converted in place after `fully_shard` (the optimizer's
  parameters, the state_dict keys kept), the weights all-gathered in FP8 (torchao's FP8
  all-gather), their scales precomputed after each step; training learns and the ranks
  agree; `deinitialize` gives back the plain layers with plain shards, which train on;
- FSDP2, rowwise: FP8 compute with the weights all-gathered as they are;
- DDP (wrapped after initialize) with rowwise and kahan masters: the ranks agree.
"""
from __future__ import annotations

import _fp8_worker as worker
import pytest
import torch
from _ranks import run_ranks

pytest.importorskip("torchao")
pytestmark = pytest.mark.distributed
WORLD, TIMEOUT_S = 2, 240


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(worker.__file__, tmp_path_factory.mktemp("fp8"), WORLD, TIMEOUT_S)


def scenario(ranks: list[dict], name: str) -> list[dict]:
    out = []
    for rank, r in enumerate(ranks):
        if "error" in r[name]:
            pytest.fail(f"{name} failed on rank {rank}:\n{r[name]['error']}")
        out.append(r[name])
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp2_converts_in_place_and_trains(ranks, recipe):
    a, b = scenario(ranks, f"fsdp/{recipe}")
    for r in (a, b):
        assert r["classes"] == ["Float8FSDPLinear", "FSDPLinear"]  # fc1 converted on its own unit; the head kept
        assert r["same_params"] and r["same_keys"]
        assert r["report"] == f"fp8 {recipe} (fp8 emulated: numerics only, not speed)"
        assert r["restored"] == ["FSDPLinear", "Tensor"] and r["same_after"] and r["plain_step"]
    assert a["losses"] == b["losses"]  # the mean over ranks, the same on both
    assert a["losses"][-1] < 0.95 * a["losses"][0]
    gathers_fp8 = recipe == "tensorwise"
    assert a["fp8_gathered"] is gathers_fp8 and a["scale_precomputed"] is gathers_fp8
    assert a["gathered_dtypes"] == (["torch.float8_e4m3fn"] if gathers_fp8 else [])


def test_ddp_ranks_agree(ranks):
    a, b = scenario(ranks, "ddp")
    assert a["classes"] == "Linear"  # put back
    assert a["losses"] == b["losses"] and a["losses"][-1] < 0.95 * a["losses"][0]
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
