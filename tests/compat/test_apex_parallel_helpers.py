"""`apex.parallel.distributed`'s helpers and DDP keywords on two gloo ranks:
`flat_dist_call` (all-reduce averages, broadcast copies rank N's), `split_by_type`, `Reducer`,
and the keywords that change how Apex's DDP reduced: `allreduce_always_fp32`,
`gradient_predivide_factor`, `gradient_average=False`."""
from __future__ import annotations

import _apex_flat_worker as worker
import pytest
import torch
from _ranks import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(worker.__file__, tmp_path_factory.mktemp("apex_flat"), WORLD, TIMEOUT_S)


def test_flat_dist_call_averages_and_broadcasts_every_type(ranks) -> None:
    for r in ranks:
        flat = r["flat"]
        assert flat["order"] == ["torch.FloatTensor", "torch.HalfTensor", "torch.DoubleTensor"]
        a32, a16, a64, a32b = flat["averaged"]
        assert (a32 == 1.5).all() and (a16 == 15).all() and a16.dtype == torch.float16 and (a64 == 1.5).all()
        assert (a32b == 150).all()
        b32, b16, _, _ = flat["broadcast"]
        assert torch.equal(b32, a32) and torch.equal(b16, a16)  # everyone had the same after the mean
        assert flat["halves"] == [[torch.float16], [torch.float32, torch.float32], [torch.float64]]


def test_reducer_broadcasts_then_averages_on_request(ranks) -> None:
    assert torch.equal(ranks[0]["reducer"]["weight"], ranks[1]["reducer"]["weight"])
    for r in ranks:  # d(sum(W x + b))/dW = x per row; x = rank + 1 -> mean 1.5
        assert (r["reducer"]["weight_grad"] == 1.5).all()
        assert (r["reducer"]["list_grad"] == 0.5).all()


def test_ddp_keywords_reduce_as_apex_did(ranks) -> None:
    """float16 gradients at the bottom of float16's range show where each reduction rounds."""
    tiny = worker.TINY
    for r in ranks:
        assert r["ddp_tiny"] == 0.0            # torch's default: each halved in float16 first (underflow)
        assert r["ddp_tiny_fp32"] == tiny       # allreduce_always_fp32: summed and averaged in FP32
        assert r["ddp_predivide"] == 2 * tiny   # torch's default, exact here
        assert r["ddp_predivide4"] == 0.0       # Apex's predivide by 4 before the sum underflows, as in Apex
        assert r["ddp_mean"] == 3.0 and r["ddp_sum"] == 6.0  # gradient_average=False sums
