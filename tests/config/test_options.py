"""The checked inputs of a session: `initialize`'s keywords (`options.Options`), the
environment (`env.Overrides`), the O4/O5 half-dtype rule, and the one-rule helpers the
session is built from (the master/own param split, the wrappers' container walk, the
observers)."""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import types

import pytest
import torch
from _config import props
from torch import nn

import ampatch as amp
from ampatch.base import tree
from ampatch.config import env, levels
from ampatch.config.options import NO_CAST, Options
from ampatch.optim.masters import Masters
from ampatch.session import observers
from ampatch.session.session import current

F16, BF16 = torch.float16, torch.bfloat16


def test_initialize_signature_is_the_options_object():
    """`Options` has the signature's names, order and defaults (models and optimizers are not
    options; nor is `policy`, applied to the keywords before they become options), so that
    the explicit construction in `initialize` cannot drift from the signature."""
    params = list(inspect.signature(amp.initialize).parameters.values())[2:]
    fields = dataclasses.fields(Options)
    assert params[-1].name == "policy"
    assert [p.name for p in params[:-1]] == [f.name for f in fields]
    assert [p.default for p in params[:-1]] == [f.default for f in fields]
    amp.initialize(torch.nn.Linear(2, 2), None, opt_level="O2", loss_scale=4.0, half_dtype="bfloat16",
                   keep_fp32=[], num_losses=2)   # every keyword reaches Options, by name
    assert current().options == Options(opt_level="O2", loss_scale=4.0, half_dtype=torch.bfloat16, keep_fp32=[],
                                        num_losses=2)


def test_options_are_frozen_and_normalised():
    o = Options(patch_torch_functions_type="bfloat16", min_loss_scale=1, max_loss_scale=2 ** 10, opt_level=" o2",
                cast_model_type=False, keep_batchnorm_fp32="False", loss_scale="128")
    assert o.half_dtype == torch.bfloat16 and isinstance(o.min_loss_scale, float) and o.max_loss_scale == 1024.0
    assert o.opt_level == "O2" and o.keep_batchnorm_fp32 is False and o.loss_scale == 128.0
    assert o.cast_model_type == NO_CAST and o.replace(opt_level="O3") == Options(**{**vars(o), "opt_level": "O3"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.opt_level = "O2"


@pytest.mark.parametrize("bad,error", [({"num_losses": 0}, ValueError), ({"verbosity": "1"}, TypeError),
                                       ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, ValueError),
                                       ({"allow_banned": 1}, TypeError), ({"process_group": "world"}, TypeError),
                                       ({"half_dtype": F16, "patch_torch_functions_type": BF16}, ValueError),
                                       ({"policy": "no-such-policy.json"}, ValueError),
                                       ({"policy": {"opt_level": "O2", "colour": "red"}}, ValueError)])
def test_a_rejected_call_changes_nothing(bad, error):
    """Checked before anything changes: the previous session stays live, its model cast, the
    logger's level as it was (no set_verbosity before the checks)."""
    model = nn.Sequential(nn.Linear(4, 4))
    amp.initialize(model, opt_level="O3", verbosity=1)
    live = current()
    log = logging.getLogger("ampatch")
    level = log.level
    with pytest.raises(error):
        amp.initialize(nn.Linear(2, 2), verbosity=0, **bad)
    assert current() is live and model[0].weight.dtype == BF16 and log.level == level


def test_a_policy_sets_the_keywords_the_call_does_not_give():
    """policy= is applied before the options are built: its level reaches the session."""
    model = amp.initialize(nn.Linear(2, 2), policy={"opt_level": "O5"}, verbosity=0)
    assert current().properties.opt_level == "O5" and model.weight.dtype == BF16
    amp.deinitialize()


# ------------------------------------------------------------------ environment
def test_overrides_unset_and_parsed():
    assert env.read({}) == env.Overrides()
    o = env.read({env.OPT_LEVEL: " o2 ", env.HALF_DTYPE: "torch.float16", env.KEEP_FP32: "a, b,,",
                  env.LOSS_SCALE: "128", env.MAX_STEPS: "3", env.REPORT: "r.json", env.PROGRESS: "p.txt",
                  env.TIME_WRAPPERS: "1", env.DIAGNOSE: "d.json", "OTHER": "x"})
    assert (o.opt_level, o.half_dtype, o.keep_fp32, o.loss_scale, o.max_steps) == ("O2", F16, ("a", "b"), 128.0, 3)
    assert (o.report, o.progress, o.time_wrappers, o.diagnose) == ("r.json", "p.txt", True, "d.json")
    assert o.quote("opt_level") == "AMPATCH_OPT_LEVEL= o2 "
    assert env.read({env.PROGRESS: "p.txt", env.TIME_WRAPPERS: "0"}) == env.Overrides()  # progress: only with a report
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.opt_level = "O1"


@pytest.mark.parametrize("name,value", [(env.OPT_LEVEL, "O9"), (env.HALF_DTYPE, "float64"),
                                        (env.HALF_DTYPE, "float32"), (env.LOSS_SCALE, "huge"),
                                        (env.LOSS_SCALE, "0"), (env.MAX_STEPS, "0"), (env.MAX_STEPS, "ten")])
def test_a_bad_variable_is_named(name, value):
    with pytest.raises(ValueError, match=name):
        env.read({name: value})


def test_a_bad_variable_fails_initialize_before_anything_changes(monkeypatch):
    amp.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=0)
    live = current()
    monkeypatch.setenv(env.MAX_STEPS, "-1")
    with pytest.raises(ValueError, match=env.MAX_STEPS):
        amp.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=0)
    assert current() is live


# ------------------------------------------------------------------ the bfloat16 levels
@pytest.mark.parametrize("level", list(levels.LEVELS))
def test_the_bfloat16_rule(level):
    fixed = levels.fixed_half_dtype(level)
    assert fixed == (BF16 if level in ("O4", "O5") else None)
    for half in (None, "auto", BF16, "bfloat16"):
        assert levels.half_dtype_conflict(level, half) is None
    conflict = levels.half_dtype_conflict(level, "float16")
    assert (conflict is not None) == (fixed is not None)
    if conflict:
        assert level in conflict and "bfloat16" in conflict
        with pytest.raises(ValueError, match="contradicts"):
            props(level, half_dtype=F16)
        assert levels.half_dtype_for(level, "cuda", F16) == BF16


# ------------------------------------------------------------------ one split, one walk
def test_masters_split_params_in_order():
    half, own = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([half, own], lr=0.1)
    masters = Masters(opt, {id(half)})
    pairs, plain = masters.split()
    assert len(pairs) == 1 and pairs[0][0] is half and pairs[0][1] is opt.param_groups[0]["params"][0]
    assert plain == [own]
    assert Masters(torch.optim.SGD([own], lr=0.1), None).split() == ([], [own])
    assert masters.split([own]) == ([], [own])


def test_holds_dtype_walks_what_map_tensors_walks():
    t16, t32 = torch.ones(1, dtype=F16), torch.ones(1)
    needs = frozenset({torch.float32})
    assert tree.holds_dtype([1, (t16, {"k": t32})], needs)
    assert not tree.holds_dtype([1, (t16, {"k": t16})], needs)
    assert not tree.holds_dtype(t32, needs)  # a tensor itself is the caller's inline test
    assert not tree.holds_dtype({t32}, needs)  # sets are not walked, as in map_tensors
    seen = []
    tree.map_tensors([1, (t16, {"k": t32})], lambda t: seen.append(t.dtype) or t)
    assert torch.float32 in seen


# ------------------------------------------------------------------ observers
def test_observers_come_from_one_list(tmp_path):
    session = types.SimpleNamespace(report=lambda: types.SimpleNamespace(to_dict=lambda: {"steps": 2}), observers=[])
    path = tmp_path / "r.json"
    made = observers.attach(session, [], env.Overrides(report=str(path), max_steps=2))
    assert [type(o) for o in made] == [observers.ReportAtExit, observers.StopAfter]  # the stop last
    stop = made[-1]
    stop.on_step(skipped=True)
    with pytest.raises(SystemExit):
        stop.on_step(skipped=False)
    made[0].close()  # the closing session's report is kept, and written (here: now, not at exit)
    observers.exit_report.write()
    assert json.loads(path.read_text()) == {"steps": 2}
    assert made is session.observers  # each joins the session's list as it is made
    assert observers.attach(types.SimpleNamespace(observers=[]), [], env.Overrides()) == []


def test_a_group_added_inside_a_scale_loss_block_is_unscaled_too():
    """The master/own split is taken again at the end of a scale_loss block: a group added
    inside the block has its grads unscaled with the others."""
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    extra = nn.Parameter(torch.zeros(3))
    loss = model(torch.randn(2, 4)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        opt.add_param_group({"params": [extra]})
        extra.grad = torch.full((3,), 128.0)
    assert torch.equal(extra.grad, torch.ones(3))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                       ("false", False), ("off", False), ("No", False), ("none", False)])
def test_every_environment_flag_reads_alike(value, on):
    """One reading of a flag for every AMPATCH_* variable that is one: `false` turned timing on."""
    assert env.read({"AMPATCH_TIME_WRAPPERS": value}).time_wrappers is on
    assert bool(env.read({"AMPATCH_FP8": value}).fp8) is on


def test_a_flag_that_is_none_of_those_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=r"AMPATCH_TIME_WRAPPERS='maybe': is not a flag"):
        env.read({"AMPATCH_TIME_WRAPPERS": "maybe"})


@pytest.mark.parametrize("variable", ["AMPATCH_REPORT", "AMPATCH_DIAGNOSE"])
def test_a_report_path_that_cannot_be_written_is_refused_at_initialize(variable, tmp_path, monkeypatch):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for path, why in ((tmp_path / "missing" / "r.json", "the folder .* does not exist"), (tmp_path, "it is a folder")):
        monkeypatch.setenv(variable, str(path))
        with pytest.raises(ValueError, match=rf"{variable}=.*cannot be written \({why}\)"):
            amp.initialize(model, opt, opt_level="O1", verbosity=0)
    assert model.weight.dtype == torch.float32 and amp.report is not None
