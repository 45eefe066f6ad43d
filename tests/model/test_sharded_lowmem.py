"""master_weights "stochastic" and "kahan" on FSDP2-sharded models (`fully_shard`).

Two real processes (gloo on loopback, file rendezvous) run the scenarios of
tests/_fsdp_lowmem_worker.py once for the module; the tests compare what the ranks saved:

- both modes train in the documented order (shard, optimizer, initialize) with AdamW and SGD:
  the sharded bfloat16 params (DTensors) are the only copy, the optimizer's state is sharded
  and FP32, the compensation is sharded like its param, the ranks agree, `report()` counts
  this rank's bytes per parameter, deinitialize gives back the FP32 values (weight +
  compensation) and plain FSDP2 trains on;
- replicas (HSDP) round each element alike and stay bit-identical; a shard's thresholds are
  those of its elements in the whole parameter, and differ from the other shard's;
- skip-on-overflow (an inf in one rank's shard: every rank skips), clip_grad_norm_ over the
  sharded params, add_param_group, a malformed checkpoint entry on one rank (refused on
  every rank, nothing loaded), optimizers that are not elementwise and LBFGS (refused, with
  the reason), the optimizer built before fully_shard (the order's error);
- checkpoints resume bit for bit on the same world size (per-rank state dicts,
  torch.distributed.checkpoint full state dicts, dcp.save/dcp.load), and within tune's
  tolerance on another one (2 ranks -> 1, 1 -> 2, through dcp.save/dcp.load);
- the fine-tuning case where sharded O3 stalls: both modes end within O5's distance of O0,
  or within 10% of O0's progress, and the ranks hold the same full model.
"""
from __future__ import annotations

import _fsdp_lowmem_worker as worker
import pytest
import torch
from _ranks import run_ranks

from ampatch.runs.deviation import TOLERANCE

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT_S = 240  # the run takes ~40 s on 2 busy cores; a hung collective must not hang the suite
MAIN = [name for name, _, _ in worker.SCENARIOS if not name.startswith("reshard")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fsdp_lowmem")
    return run_ranks(worker.__file__, tmp, WORLD, TIMEOUT_S, [",".join(MAIN), str(tmp)])


def scenario(ranks: list[dict], name: str) -> list[dict]:
    out = []
    for rank, r in enumerate(ranks):
        res = r[name]
        if isinstance(res, dict) and "error" in res and isinstance(res["error"], str) and "Traceback" in res["error"]:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{res['error']}")
        out.append(res)
    return out


same = worker.same
MODES = worker.MODES


@pytest.mark.parametrize("opt", sorted(worker.OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_both_modes_train_on_sharded_bfloat16_params(ranks, mode, opt):
    r0, r1 = scenario(ranks, f"trains/{mode}/{opt}")
    assert r0["losses"] == r1["losses"] and same(r0["live"], r1["live"])  # the ranks hold one model
    before, after = r0["eval"]
    assert after < before  # the held-out loss went down
    for r in (r0, r1):
        assert r["sharded_dtypes"] == ["torch.bfloat16"] and r["param_types"] == ["DTensor"]  # the only copy
        assert r["master_types"] == ["DTensor:torch.bfloat16"]  # amp.master_params: the sharded params themselves
        assert all(s.split(":")[1:] == ["DTensor", "torch.float32"] for s in r["state"])  # sharded, FP32
        assert r["comp_shapes"] == (["True"] if mode == "kahan" else [])  # the compensation: sharded like its param
        rep = r["report"]
        assert rep["master_weights"] == mode and rep["steps"] == worker.STEPS
        assert rep["trained_params"] == r["local_numel"]  # this rank's params
        assert rep["bytes_per_param"] == {"stochastic": 2.0, "kahan": 4.0}[mode]
        state_bytes = {"adamw": 8, "sgd": 4}[opt] * r["local_numel"]  # the moments / momentum, FP32
        assert rep["optimizer_state_bytes"] >= state_bytes
        assert r["restored"] and r["restored_dtypes"] == ["torch.float32"]  # weight + compensation, FP32
        assert all(torch.isfinite(torch.tensor(r["after_deinit_losses"])))
        # the checkpoint entries: the compensation beside the moments, the rounding state in the groups
        assert ("ampatch_compensation" in r["state_keys"]) == (mode == "kahan")
        assert {"ampatch_seed", "ampatch_rounds"} <= set(r["group_keys"]) or mode == "kahan"


@pytest.mark.parametrize("mode", MODES)
def test_replicas_round_alike_and_stay_identical(ranks, mode):
    r0, r1 = scenario(ranks, f"replicas/{mode}")
    assert r0["placements"] == ["(Replicate(), Shard(dim=0))"]
    assert same(r0["local"], r1["local"])  # each rank holds the whole model: the same bits after 6 steps


def test_each_element_draws_its_own_threshold_on_every_rank(ranks):
    r0, r1 = scenario(ranks, "draws")
    assert r0["seed"] == r1["seed"] and same(r0["whole"], r1["whole"])
    for r in (r0, r1):  # the same element, the same draw, wherever it is stepped
        assert torch.equal(r["mine"], r["whole"][r["offset"]:r["offset"] + r["mine"].numel()])
    assert r0["offset"] == 0 and r1["offset"] == r0["mine"].numel()
    assert not torch.equal(r0["mine"], r1["mine"])  # the shards draw differently
    counts = torch.bincount(r0["whole"].long() >> 12, minlength=16).float()  # 16 bins of 4096 thresholds
    expected = r0["whole"].numel() / 16
    assert ((counts - expected) ** 2 / expected).sum() < 37.7  # chi-square, 15 dof: p = 0.001


@pytest.mark.parametrize("mode", MODES)
def test_overflow_on_one_rank_skips_on_every_rank(ranks, mode):
    for r in scenario(ranks, f"overflow/{mode}"):
        assert r["skipped"] == [1] and r["untouched"] and r["moved_on"]


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm_over_the_sharded_params(ranks, mode):
    r0, r1 = scenario(ranks, f"clipping/{mode}")
    assert r0["norms"] == r1["norms"] and len(r0["norms"]) == worker.STEPS  # one global norm
    assert max(r0["norms"]) > 0.5 and r0["differs"]  # the norm was clipped, and that changed the training
    assert same(r0["clipped"], r1["clipped"])


@pytest.mark.parametrize("mode", MODES)
def test_add_param_group_after_initialize(ranks, mode):
    for r in scenario(ranks, f"param_group/{mode}"):
        assert r["fc3_moved"] and r["fc3_dtype"] == "torch.bfloat16" and r["stepped"] and r["comp"]
        assert r["groups"] == [4, 2]


@pytest.mark.parametrize("how", ["plain", "dcp_full", "dcp"])
@pytest.mark.parametrize("mode", MODES)
def test_resume_on_the_same_world_size_is_bit_for_bit(ranks, mode, how):
    for r in scenario(ranks, f"resume/{mode}/{how}"):
        assert r["same"], (mode, how)
        assert r["state"] == ["DTensor:torch.float32"]  # loaded as saved: torch would have cast it to bfloat16


@pytest.mark.parametrize("how", ["plain", "dcp_full"])
def test_stochastic_checkpoint_loaded_before_initialize_resumes_bit_for_bit(ranks, how):
    # the seed and step count are int64 tensors in the param groups: the plain optimizer keeps them
    # (a full state dict of plain ints raised KeyError there) and initialize takes them over
    for r in scenario(ranks, f"resume_before/stochastic/{how}"):
        assert r["same"], how


@pytest.mark.parametrize("mode", MODES)
def test_malformed_entry_on_one_rank_is_refused_on_every_rank(ranks, mode):
    what = ("the compensation of fc2.weight (shape (48, 48)) holds NaN or inf" if mode == "kahan"
            else "the stochastic rounding's 'rounds' must be an integer >= 0, got -1")
    for r in scenario(ranks, f"malformed/{mode}"):
        assert r["error"] is not None and what in r["error"] and "nothing was loaded" in r["error"]
        assert r["untouched"]
        if mode == "stochastic":  # plain ints (older checkpoints) still load
            assert tuple(r["old_format"]) == (2, True)


def test_what_the_sharded_modes_refuse(ranks):
    for r in scenario(ranks, "refused"):
        assert "Adafactor is not one of torch.optim's elementwise optimizers" in r["adafactor"]
        assert "ampatch_elementwise = True" in r["adafactor"] and "master_weights=True" in r["adafactor"]
        assert "LBFGS needs all of them at once" in r["lbfgs"]
        assert r["adafactor/untouched"] and r["lbfgs/untouched"]
        assert "it was built before fully_shard" in r["optimizer_before_shard"]


@pytest.mark.parametrize("opt", sorted(worker.OPTIMIZERS))
def test_both_modes_learn_where_sharded_o3_stalls(ranks, opt):
    r0, r1 = scenario(ranks, f"finetune/{opt}")
    for run in ("O0", "O3", "O5", "stochastic", "kahan"):
        assert r0[run]["checksum"] == r1[run]["checksum"] and same(r0[run]["weights"], r1[run]["weights"])
    o0 = r0["O0"]
    progress = r0["start"] - o0["final"]
    assert progress > 0.5 * r0["start"]  # O0 learns
    o3 = r0["O3"]
    assert o3["unchanged"] > 0.95 and abs(o3["final"] - o0["final"]) > 0.9 * progress  # sharded O3 stalls
    o5_gap = abs(r0["O5"]["final"] - o0["final"])
    for mode in MODES:
        r = r0[mode]
        gap = abs(r["final"] - o0["final"])
        assert gap <= o5_gap or gap <= 0.1 * progress, (mode, gap, o5_gap, progress)
        assert r["unchanged"] < 0.5


# ---------------------------------------------------------------------------------------- other world sizes
@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict[str, list[dict]]:
    """A run on 2 ranks and one on 1 rank each save a checkpoint half-way; a run on the other
    world size loads it and trains the second half on the same global batches."""
    where = tmp_path_factory.mktemp("reshard")
    saves = ",".join(f"reshard_save/{m}" for m in MODES)
    loads = ",".join(f"reshard_load/{m}" for m in MODES)
    out = {}
    # in this order: each load reads what the run on the other world size saved
    for name, world, which in (("two", WORLD, saves), ("one", 1, f"{saves},{loads}"), ("two_loaded", WORLD, loads)):
        (where / name).mkdir()
        out[name] = run_ranks(worker.__file__, where / name, world, TIMEOUT_S, [which, str(where)])
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_resume_on_another_world_size_is_within_tunes_tolerance(resharded, mode, direction):
    """The straight run's loss curve against the resumed one over the second half: the largest
    gap over the straight run's progress, held to tune's default tolerance."""
    saved, loaded = ("two", "one") if direction == "2->1" else ("one", "two_loaded")
    straight = scenario(resharded[saved], f"reshard_save/{mode}")[0]["losses"]
    resumed = scenario(resharded[loaded], f"reshard_load/{mode}")[0]["losses"]
    half = worker.STEPS // 2
    progress = straight[0] - straight[-1]
    assert progress > 0  # the run learns
    gap = max(abs(a - b) for a, b in zip(resumed, straight[half:]))
    assert gap <= TOLERANCE * progress, (gap, progress)


# ---------------------------------------------------------------------------------------- tune
@pytest.mark.slow
def test_tune_for_memory_offers_the_sharded_modes(tmp_path):
    """`ampatch tune --objective memory -- torchrun ... examples/fsdp.py`: both low-memory modes
    run sharded, and so do the optimizer-state precisions (each rank keeps its shard of the
    state), each rank's bytes per parameter counted, and the fewest that train like FP32 win
    ("stochastic": bfloat16 shard, 2 bytes fewer than sharded O5's FP32 shard; with int8 state
    where that trains like FP32)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "tune.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    cmd = [sys.executable, "-m", "ampatch", "tune", "--objective", "memory", "--levels", "O5", "--steps", "20",
           "--json", str(out), "--", *torchrun, str(root / "examples" / "fsdp.py"), "--batch", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {c.get("master_weights"): c for c in data["candidates"] if c.get("optimizer_states") is None}
    assert set(rows) == {None, "stochastic", "kahan"}
    kept = {(c.get("master_weights"), c["optimizer_states"]): c for c in data["candidates"]
            if c.get("optimizer_states") is not None}  # the optimizer state kept sharded, as each rank's shard
    assert set(kept) == {(None, "bfloat16"), (None, "int8"), ("stochastic", "int8")}
    assert all(c["finite"] and "ran with optimizer_states" not in c["reason"] for c in kept.values())
    for mode in MODES:
        assert rows[mode]["finite"] and rows[mode]["qualifies"], rows[mode]["reason"]
    per_param = {m: r["train_bytes_per_param"] for m, r in rows.items()}
    assert per_param["stochastic"] == pytest.approx(per_param[None] - 2, abs=0.05)  # bfloat16 shard, not FP32
    assert per_param["kahan"] == pytest.approx(per_param[None], abs=0.05)           # plus its compensation
    assert kept[(None, "bfloat16")]["train_bytes_per_param"] == pytest.approx(per_param[None] - 4, abs=0.05)
    assert kept[("stochastic", "int8")]["train_bytes_per_param"] < per_param["stochastic"] - 2
    assert data["chosen"]["master_weights"] == "stochastic"  # with int8 state where that trains like FP32
