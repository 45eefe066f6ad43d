"""FSDP2 (`fully_shard`) under every opt level.

Two real processes (gloo on loopback, file rendezvous) run every scenario of
tests/_fsdp_worker.py once for the whole module; the tests compare what the ranks saved:

- each level O0-O5 trains in the documented order (shard, optimizer, initialize): the loss
  goes down, the ranks agree, and the level did what it means under FSDP2 (O2/O5: FP32
  sharded masters and half compute; O3: half sharded params), undone by deinitialize;
- O1 and O2 match FSDP2's own MixedPrecisionPolicy(bfloat16, reduce float32) run;
- float16 with a dynamic scale: an inf on one rank's shard skips the step on both;
- micro-batches with gradient sync off accumulate like the whole batch;
- a checkpoint (per-rank state dicts, or torch.distributed.checkpoint full state dicts)
  resumes bit for bit at O2 and O5;
- the wrong orders raise a RuntimeError that shows the right one; what FSDP2 cannot honour
  (keep_batchnorm_fp32 inside a unit, a parameter in no unit at O2, sharded and unsharded
  models together at O2) raises a ValueError, FSDP2 internals ampatch does not know a
  RuntimeError;
- examples/fsdp.py runs at every level, and AMPATCH_OPT_LEVEL forces its level.
Plus, in this process: the parameter guard without FSDP, and (slow) `ampatch compare`
over examples/fsdp.py under torchrun.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _fsdp_worker as worker
import pytest
import torch
from _ranks import run_ranks
from torch import nn

import ampatch as amp
from ampatch.config.levels import LEVELS

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT_S = 150  # the run takes ~10 s; a hung collective must not hang the suite
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run the worker pair once; the results of rank 0 and rank 1."""
    tmp = tmp_path_factory.mktemp("fsdp")
    return run_ranks(worker.__file__, tmp, WORLD, TIMEOUT_S)


def scenario(ranks: list[dict], name: str) -> list[dict]:
    out = []
    for rank, r in enumerate(ranks):
        res = r[name]
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{res['error']}")
        out.append(res)
    return out


def same(a, b) -> bool:
    """Bit-identical nested dicts/lists of tensors and plain values."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


F32, BF16 = "torch.float32", "torch.bfloat16"
# what each level does to the sharded model: dtype of fc2's all-gathered weight in forward,
# of its input, of the sharded params (what the optimizer steps) and of the optimizer state
EXPECTED = {
    "O0": dict(weight=F32, input=F32, sharded=F32),
    "O1": dict(weight=F32, input=BF16, sharded=F32),
    "O2": dict(weight=BF16, input=BF16, sharded=F32),
    "O3": dict(weight=BF16, input=BF16, sharded=BF16),
    "O4": dict(weight=F32, input=BF16, sharded=F32),
    "O5": dict(weight=BF16, input=BF16, sharded=F32),
}


@pytest.mark.parametrize("level", worker.LEVELS)
def test_each_level_trains_and_ranks_agree(ranks, level):
    r0, r1 = scenario(ranks, f"level/{level}")
    assert r0["losses"] == r1["losses"] and r0["eval"] == r1["eval"]
    before, after = r0["eval"]
    assert after < 0.8 * before, r0["eval"]  # the held-out loss went down
    assert same(r0["full"], r1["full"])      # the gathered weights are the same on both ranks
    for r in (r0, r1):
        exp = EXPECTED[level]
        assert r["seen"]["fc2.weight"] == exp["weight"] and r["seen"]["fc2.input"] == exp["input"]
        assert r["sharded_dtypes"] == [exp["sharded"]]
        assert r["master_types"] == [f"DTensor:{exp['sharded']}"]  # amp.master_params: the sharded params
        assert r["state_dtypes"] == [exp["sharded"]]
        if LEVELS[level].cast_model_type not in (None, torch.float32):
            assert r["output_dtype"] == F32          # outputs leave the half model in FP32
            assert r["state_dict_dtypes"] == [F32]   # model.state_dict() is FP32
        rep = r["report"]
        assert rep["opt_level"] == level and rep["steps"] == worker.STEPS and rep["skipped_steps"] == []
        # deinitialize: FP32 again, and plain FSDP2 trains on
        assert r["restored_dtypes"] == [F32] and r["after_deinit_dtype"] == F32
        assert all(torch.isfinite(torch.tensor(r["after_deinit_losses"])))


def test_o1_and_o2_match_fsdp2_mixed_precision(ranks):
    """FSDP2's own MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) is the reference."""
    native = torch.tensor(scenario(ranks, "native")[0]["losses"])
    o2 = torch.tensor(scenario(ranks, "level/O2")[0]["losses"])
    o1 = torch.tensor(scenario(ranks, "level/O1")[0]["losses"])
    o0 = torch.tensor(scenario(ranks, "level/O0")[0]["losses"])
    torch.testing.assert_close(o2, native, rtol=1e-5, atol=0)   # the same computation
    torch.testing.assert_close(o1, native, rtol=2e-2, atol=0)   # per-op casts: bf16 noise
    assert not torch.equal(o0, native)  # the comparison can tell FP32 from bf16


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_on_one_rank_skips_on_both(ranks, level):
    r0, r1 = scenario(ranks, f"overflow/{level}")
    inject, start = worker.INJECT_STEP, worker.START_SCALE
    assert r0["skipped"] == r1["skipped"] == [inject]
    assert r0["scales"] == r1["scales"] == [start] * inject + [start / 2] * (4 - inject)
    assert same(r0["fulls"], r1["fulls"])
    fulls = r0["fulls"]
    assert same(fulls[inject], fulls[inject - 1])          # the skipped step changed nothing
    assert not same(fulls[inject + 1], fulls[inject])       # the next one trained


def test_no_sync_micro_batches_match_the_whole_batch(ranks):
    for r in scenario(ranks, "no_sync/O2"):
        acc, whole = r["accumulated"], r["whole"]
        assert acc["skipped"] == whole["skipped"] == [] and acc["scale"] == whole["scale"] == 2 * worker.START_SCALE
        for step, (ga, gw) in enumerate(zip(acc["grads"], whole["grads"])):
            ref = max(g.abs().max().item() for g in gw)
            err = max((a - w).abs().max().item() for a, w in zip(ga, gw))
            assert err <= 3e-3 * ref, f"step {step}: accumulated vs whole-batch grads differ by {err / ref:.1e}"
        assert "set_requires_gradient_sync(True)" in r["step_with_sync_off"]


@pytest.mark.parametrize("name", ["resume/O2-fp16-state_dict", "resume/O5-dcp"])
def test_checkpoint_resume_is_bit_for_bit(ranks, name):
    for r in scenario(ranks, name):
        assert same(r["resumed"], r["straight"]), name
        assert r["checkpoint_dtypes"] == [F32]


def test_wrong_orders_raise_and_show_the_right_one(ranks):
    for r in scenario(ranks, "wrong_orders"):
        for level in ("O0", "O1", "O2"):
            msg = r[f"initialize_then_shard/{level}"]
            assert msg is not None, f"{level}: the step after fully_shard did not raise"
            assert "replaced after amp.initialize" in msg and "'fc1.weight'" in msg
            assert "then build the optimizer" in msg and "then call `model, optimizer = amp.initialize" in msg
        msg = r["optimizer_before_shard"]
        assert msg is not None and "built before fully_shard" in msg and "then build the optimizer" in msg


def test_batchnorm_under_fsdp2(ranks):
    for r in scenario(ranks, "batchnorm"):
        assert r["inside_unit"] is not None and "keep_batchnorm_fp32" in r["inside_unit"]
        assert "fully_shard on each batch norm" in r["inside_unit"]
        own = r["own_unit"]
        assert own["seen"] == {"weight": F32, "input": BF16, "running_mean": F32}
        o3 = r["o3_inside_unit"]
        assert o3["dtypes"] == [BF16] and o3["state_dict"] == [F32] and r["o3_restored"] == [F32]


def test_what_initialize_refuses_on_sharded_models(ranks):
    for r in scenario(ranks, "bad_input"):
        assert r["no_root"].startswith("ValueError") and "belong to no fully_shard unit" in r["no_root"]
        assert "fully_shard(model) on the root" in r["no_root"]
        assert r["mixed"].startswith("ValueError") and "all of them sharded" in r["mixed"]
        assert r["other_torch"].startswith("RuntimeError") and "renamed_by_a_later_torch" in r["other_torch"]
        assert "FSDP2 internals of this torch" in r["other_torch"]
        assert r["unchanged"]  # refused before the model changed


def test_initialize_again_on_the_same_sharded_model(ranks):
    for r in scenario(ranks, "reinitialize"):
        for key, res in r.items():
            level = key.split(":")[1]
            sharded = BF16 if level == "O3" else F32
            assert res["sharded"] == res["state"] == [sharded], key
            assert res["param_dtype"] == (BF16 if level in ("O2", "O3") else "None"), key
            assert all(torch.isfinite(torch.tensor(res["losses"]))), key


def test_unscale_of_sharded_grads_is_local(ranks):
    for r in scenario(ranks, "unscale_local"):
        assert r["collectives"] == 0 and r["found"] == 0.0 and r["halved"]


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
def test_keep_fp32_under_fsdp2(ranks, level):
    half = level in ("O2", "O3", "O5")
    r0, r1 = scenario(ranks, f"keep_fp32/{level}")
    assert r0["losses"] == r1["losses"] and same(r0["full"], r1["full"])
    assert r0["losses"][-1] < r0["losses"][0]
    for r in (r0, r1):
        assert r["report"] == ["fc3"]
        assert r["seen"] == {"fc2.weight": BF16 if half else F32, "fc3.weight": F32,
                             "fc3.output": BF16 if half else F32}
        assert r["fc3_sharded"] == F32 and r["fc2_sharded"] == (BF16 if level == "O3" else F32)
        assert r["state_dict_dtypes"] == [F32]
        assert r["restored"] == (True, [F32])
        if level == "O3":
            assert "keep_fp32 cannot be honoured under FSDP2: 'fc1'" in r["shared_unit"]
            assert "Call fully_shard on the kept module" in r["shared_unit"]
            assert r["whole_unit"] == ["fc1", "norm"]


def test_policy_given_to_fully_shard_is_replaced_then_restored(ranks):
    for r in scenario(ranks, "custom_policy"):
        assert r["during"] == BF16 and r["after"] is True


def test_example_runs_at_every_level(ranks):
    r0, r1 = scenario(ranks, "example")
    for level in worker.LEVELS:
        assert r0[level]["report_level"] == level
        assert 0 < r0[level]["loss"] < 1.0
    assert r0["forced"] == r1["forced"] == "O3"


# ----------------------------------------------------------------------------- one process

def test_parameters_replaced_after_initialize_raise_at_step():
    """The same guard without FSDP: `load_state_dict(assign=True)` after initialize swaps the
    parameters; the step must raise instead of training tensors the model no longer uses,
    while a parametrization (the parameter moves, the optimizer's tensor stays in use) is fine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)

    def step() -> None:
        opt.zero_grad()
        with amp.scale_loss(model(x).sum(), opt) as scaled:
            scaled.backward()
        opt.step()

    step()
    torch.nn.utils.parametrize.register_parametrization(model[1], "weight", nn.Identity())
    step()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    for _ in range(2):  # and it keeps raising
        with pytest.raises(RuntimeError, match=r"'0.weight' was replaced after amp.initialize"):
            step()


def test_parameter_guard_checks_the_optimizer_that_steps():
    """Each optimizer's step watches its own parameters (no optimizer re-checks the others' at
    every step): a parameter replaced under the second optimizer fails that one's step, and
    only that one's, with the parameter's name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opts = [torch.optim.SGD(model[i].parameters(), lr=0.1) for i in range(2)]
    model, opts = amp.initialize(model, opts, opt_level="O0", verbosity=0)
    model[1].weight = nn.Parameter(model[1].weight.detach().clone())
    try:
        model(torch.randn(3, 4)).sum().backward()
        opts[0].step()
        for _ in range(2):  # and it keeps raising
            with pytest.raises(RuntimeError, match=r"'1.weight' was replaced after amp.initialize"):
                opts[1].step()
    finally:
        amp.deinitialize()


def test_only_rank_0_writes_the_report(tmp_path):
    """Under torchrun every rank gets the same AMPATCH_REPORT path: rank 1 must not write it
    (two writers of one file can leave a torn or the wrong rank's report)."""
    script = "import torch, ampatch as amp\namp.initialize(torch.nn.Linear(2, 2), opt_level='O0', verbosity=0)\n"
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env.update(AMPATCH_REPORT=str(report), RANK="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not report.exists()  # rank 0 writes it (test_compare_over_torchrun)


@pytest.mark.slow
def test_compare_over_torchrun(tmp_path):
    """`ampatch compare -- torchrun ... examples/fsdp.py`: both rows, from rank 0's report."""
    out = tmp_path / "compare.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    cmd = [sys.executable, "-m", "ampatch", "compare", "--levels", "O0,O2", "--json", str(out), "--",
           *torchrun, str(ROOT / "examples" / "fsdp.py"), "--steps", "4", "--batch", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [row["level"] for row in rows] == ["O0", "O2"]
    for row in rows:
        assert row["ok"], row.get("error")
        assert row["report"]["steps"] == 4 and len(row["report"]["losses"]) == 4
