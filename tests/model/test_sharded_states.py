"""optimizer_states "bfloat16" and "int8" on FSDP2-sharded models (`fully_shard`).

Two real processes (gloo on loopback, file rendezvous) run the scenarios of
tests/_fsdp_states_worker.py once for the module (about 15 s); the tests compare what the
ranks saved:

- O5, O2 (float16, dynamic scale), O3 and master_weights "stochastic"/"kahan" train with their
  state kept: each rank keeps bfloat16 values or int8 codes (a scale per block of its local
  shard) of its local shard only, `report()` counts those bytes, `optimizer.state_dict()`
  gives FP32 DTensors placed like each param, and after `deinitialize` the optimizer holds
  plain FP32 DTensor state, equal to what the state dict gave, and plain FSDP2 trains on;
- HSDP replicas seeded apart round their bfloat16 state alike and stay bit-identical;
- an inf in one rank's shard skips the step on every rank, the kept state bit for bit;
- checkpoints (per-rank state dicts; torch.distributed.checkpoint's full state dicts, and
  its save/load) resume bit for bit, loaded after `initialize` and before it (into the plain
  optimizer), but for the bfloat16 state's rounding count in a dcp.load whose template a
  plain optimizer made (the state itself loads exactly);
- optimizers that cannot keep their state shard by shard (Adafactor, LBFGS) are refused, a
  malformed checkpoint on one rank is refused on every rank, and the state precision
  forced from outside applies.
"""
from __future__ import annotations

import _fsdp_states_worker as worker
import pytest
from _ranks import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT_S = 180  # the run takes ~15 s on 2 busy cores; a hung collective must not hang the suite


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fsdp_states")
    return run_ranks(worker.__file__, tmp, WORLD, TIMEOUT_S, ["", str(tmp)])


def scenario(ranks: list[dict], name: str) -> list[dict]:
    out = []
    for rank, r in enumerate(ranks):
        res = r[name]
        if isinstance(res, dict) and isinstance(res.get("error"), str) and "Traceback" in res["error"]:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{res['error']}")
        out.append(res)
    return out


same = worker.same


def expected_bytes(precision: str, local: list[tuple[int, int]]) -> int:
    """This rank's state bytes with AdamW: two moments per element (kept, or FP32 where int8
    keeps nothing: tensors under 4096 elements), plus an FP32 step count per param."""
    total = 4 * len(local)
    for whole, mine in local:
        if precision == "bfloat16":
            total += 2 * 2 * mine
        elif whole >= 4096:
            total += 2 * (mine + 4 * -(-mine // 256))
        else:
            total += 2 * 4 * mine
    return total


@pytest.mark.parametrize("run", list(worker.RUNS))
def test_each_rank_keeps_its_shard_of_the_state_and_trains(ranks, run):
    r0, r1 = scenario(ranks, f"trains/{run}")
    precision = run.split("/")[1]
    assert r0["losses"] == r1["losses"] and same(r0["full"], r1["full"])  # the ranks hold one model
    before, after = r0["eval"]
    assert after < 0.9 * before  # the held-out loss went down
    for r in (r0, r1):
        kinds = r["kinds"]
        if precision == "bfloat16":  # every per-element tensor, as bfloat16 of the local shard's shape
            assert len(kinds) == 12 and all(k == ("torch.bfloat16", True, None) for k in kinds.values())
            assert r["own"] == ["step"]
        else:  # fc2.weight (9216 elements): codes of its local shard, a scale per block of 256 of them
            assert kinds == {"2/exp_avg": ("torch.int8", True, True), "2/exp_avg_sq": ("torch.uint8", True, True)}
            assert r["own"] == ["exp_avg", "exp_avg_sq", "step"]  # the small tensors, as the optimizer made them
        assert [mine for _, mine in r["local"]] == [768, 48, 4608, 48, 192, 2]  # half of each param
        assert r["state_bytes"] == expected_bytes(precision, r["local"])
        # the state dict: FP32 state sharded like each param, under the optimizer's own names
        assert len(r["entries"]) == 12 and all(e == ("DTensor", "torch.float32", True, True)
                                               for e in r["entries"].values())
        assert "ampatch_states_rounding" in r["groups"]
        # after deinitialize: plain FP32 state, sharded like the params, what the state dict gave
        assert r["after_deinit"].keys() == r["entries"].keys()
        assert all(e == ("DTensor", "torch.float32", True, True, True) for e in r["after_deinit"].values())
        assert r["after_deinit_loss"] < before


def test_hsdp_replicas_seeded_apart_stay_bit_identical(ranks):
    r0, r1 = scenario(ranks, "replicas")
    assert r0["kept"] and same(r0["kept"], r1["kept"]) and same(r0["local"], r1["local"])


@pytest.mark.parametrize("run", ["O5/bfloat16", "O2/int8", "stochastic/int8"])
def test_an_overflow_on_one_rank_leaves_the_kept_state_on_every_rank(ranks, run):
    for r in scenario(ranks, f"overflow/{run}"):
        assert r["skipped"] == [1] and r["kept"] and r["untouched"] and r["moved_on"]


@pytest.mark.parametrize("order", ["after", "before"])
@pytest.mark.parametrize("how", worker.HOWS)
@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_a_checkpoint_resumes_bit_for_bit(ranks, precision, how, order):
    for r in scenario(ranks, f"resume/O5/{precision}"):
        res = r[f"{how}/{order}"]
        assert res["loaded"]  # the kept state after the load is the kept state at the save, bit for bit
        if precision == "bfloat16" and how == "dcp" and order == "before":
            # a plain optimizer's template has no place for the rounding's seed and count: the state is
            # exact, the rounding draws afresh (docs/fsdp.md)
            assert res["close"] < 0.01
        else:
            assert res["same"], (how, order)


@pytest.mark.parametrize("how", worker.HOWS)
def test_a_checkpoint_of_stochastic_weights_and_int8_state_resumes_bit_for_bit(ranks, how):
    for r in scenario(ranks, "resume/stochastic/int8"):
        assert r[f"{how}/after"]["loaded"] and r[f"{how}/after"]["same"]


def test_what_cannot_keep_its_state_shard_by_shard_or_is_malformed_is_refused(ranks):
    for r in scenario(ranks, "refused"):
        assert "Adafactor is not one of torch.optim's elementwise optimizers" in r["adafactor"]
        assert "optimizer_states='float32'" in r["adafactor"] and r["adafactor/untouched"]
        assert "LBFGS" in r["lbfgs"] and "optimizer_states='float32'" in r["lbfgs"] and r["lbfgs/untouched"]
        assert "'ampatch_states_rounding'" in r["malformed"] and "(in rank 1's part)" in r["malformed"]
        assert "nothing was loaded" in r["malformed"] and r["malformed/untouched"]
        assert r["forced"] == "int8"  # AMPATCH_OPTIMIZER_STATES applies on FSDP2 (it used to be dropped)
