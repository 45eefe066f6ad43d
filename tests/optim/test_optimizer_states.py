"""optimizer_states="bfloat16" / "int8": the optimizer's state kept compact between steps.

- what is kept (per-element state, not the step count; int8 from 4096 elements), what the
  report counts, at every level and master mode;
- the step is the optimizer's own: any chunk size gives the same result, bit for bit;
- a skipped (overflowed) step leaves the kept state and the optimizer's state untouched;
- checkpoints: `optimizer.state_dict()` round-trips exactly whichever load order (into the
  plain optimizer before `initialize`, or after it), through torch.save/load(weights_only);
  a model checkpoint loads strictly into a plain model; a malformed entry is refused; a
  checkpoint kept at one precision loads into a session of another;
- after `deinitialize` the optimizer holds plain FP32 state and trains on with plain torch;
- refusals: LBFGS, step(closure), a bad value; Adagrad's state (made at construction) kept at
  initialize; add_param_group after initialize.
"""
from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.optim.states import STATES_KEY
from ampatch.session.session import current

F32, BF16 = torch.float32, torch.bfloat16
PRECISIONS = ["bfloat16", "int8"]


@pytest.fixture(autouse=True)
def _end_session():
    yield
    amp.deinitialize()


def model_of(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.ReLU(), nn.Linear(96, 48))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(16, 64, generator=g), torch.randn(16, 48, generator=g)


def train(model, opt, steps: int, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        x, y = batch(i)
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def store(i: int = 0):
    return current().optimizers[i].states


def kept_tensors(i: int = 0) -> list[torch.Tensor]:
    out = []
    for kept in store(i).kept.values():
        for p in kept.values():
            out += [p.values] + ([] if p.absmax is None else [p.absmax])
    return out


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ what is kept, at every level
LEVELS = [("O0", None), ("O1", None), ("O2", None), ("O3", None), ("O4", None), ("O5", None),
          ("O5", "stochastic"), ("O5", "kahan"), ("O2", "stochastic")]


@pytest.mark.parametrize("level,mode", LEVELS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_level_and_master_mode_keeps_the_state_and_trains(level, mode, precision):
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw = {} if mode is None else {"master_weights": mode}
    model, opt = amp.initialize(model, opt, opt_level=level, optimizer_states=precision, verbosity=0, **kw)
    losses = train(model, opt, 30)
    assert losses[-1] < losses[0]
    for key, entries in opt.state.items():
        names = set(store().kept.get(id(key), {}))
        big = key.numel() >= 4096
        if precision == "bfloat16" or big:
            assert names == {"exp_avg", "exp_avg_sq"} and set(entries) == {"step"}
        else:  # int8 keeps tensors of 4096 elements and more; the rest stay as the optimizer made them
            assert not names and set(entries) == {"step", "exp_avg", "exp_avg_sq"}
    rep = amp.report()
    assert rep.optimizer_states == precision
    per = {"bfloat16": 4.0, "int8": 2 * (1 + 4 / 256)}[precision]
    n_big = sum(p.numel() for p in model.parameters() if p.numel() >= 4096)
    n_small = sum(p.numel() for p in model.parameters() if p.numel() < 4096)
    expected = per * n_big + (per if precision == "bfloat16" else 8.0) * n_small
    assert rep.optimizer_state_bytes == pytest.approx(expected, rel=0.01)
    assert "optimizer state: " + precision in str(rep)


def test_kept_state_stays_near_the_fp32_state():
    """The same steps with FP32 state and with kept state: the states agree to their precision."""
    finals = {}
    for precision in ("float32", *PRECISIONS):
        model = model_of()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, opt = amp.initialize(model, opt, opt_level="O0", optimizer_states=precision, verbosity=0)
        train(model, opt, 5)
        amp.deinitialize()
        finals[precision] = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    for precision, tol in (("bfloat16", 1 / 64), ("int8", 1 / 8)):
        for name in ("exp_avg", "exp_avg_sq"):
            ref, got = finals["float32"][name], finals[precision][name]
            assert float((got - ref).abs().max()) <= tol * float(ref.abs().max())


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", [None, "stochastic"])
def test_any_chunk_size_steps_alike_bit_for_bit(precision, mode):
    results = []
    for chunk in (None, 512, 300):
        model = model_of()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        kw = {} if mode is None else {"master_weights": mode}
        model, opt = amp.initialize(model, opt, opt_level="O5", optimizer_states=precision, verbosity=0, **kw)
        h = current().optimizers[0]
        h.states.chunk_numel = chunk
        if mode is not None:
            h.masters.chunk_numel = chunk
        train(model, opt, 6)
        results.append(weights(model) + kept_tensors())
        amp.deinitialize()
    assert same(results[0], results[1]) and same(results[0], results[2])


# ------------------------------------------------------------------ skipped steps
@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_overflowed_step_leaves_the_kept_state_untouched(precision):
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic",
                                optimizer_states=precision, verbosity=0)
    train(model, opt, 3)
    before = [t.clone() for t in kept_tensors()]
    own = {id(k): {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    w = weights(model)
    x, y = batch(99)
    opt.zero_grad()
    loss = ((model(x).float() - y) ** 2).mean() * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.report().skipped_steps
    assert same(before, kept_tensors()) and same(w, weights(model))
    for k, s in opt.state.items():
        assert all(torch.equal(v, own[id(k)][n]) for n, v in s.items())


# ------------------------------------------------------------------ checkpoints
def saved(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("level,mode", [("O5", None), ("O0", None), ("O5", "stochastic"), ("O5", "kahan")])
def test_a_checkpoint_resumes_bit_for_bit_in_both_load_orders(precision, level, mode):
    kw = dict(opt_level=level, optimizer_states=precision, verbosity=0,
              **({} if mode is None else {"master_weights": mode}))
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, **kw)
    train(model, opt, 4)
    msd, osd = saved(model.state_dict()), saved(opt.state_dict())
    assert all(STATES_KEY in osd["state"][i] for i in (0, 4))  # the two large weights
    expected = train(model, opt, 4, start=4)
    final = weights(model)
    amp.deinitialize()

    # after initialize
    model = model_of(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, **kw)
    model.load_state_dict(msd)
    opt.load_state_dict(saved(osd))  # a copy: a load aliases the checkpoint's tensors, as torch's own does
    loaded = [t.clone() for t in kept_tensors()]
    assert train(model, opt, 4, start=4) == expected and same(weights(model), final)
    amp.deinitialize()

    # before initialize, into the plain model and optimizer (strict: the model's keys are its own)
    model = model_of(seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict(msd, strict=True)
    opt.load_state_dict(saved(osd))
    assert STATES_KEY in opt.state[model[0].weight]  # a plain optimizer keeps the entry
    model, opt = amp.initialize(model, opt, **kw)
    assert all(STATES_KEY not in s for s in opt.state.values()) and same(kept_tensors(), loaded)
    if mode == "stochastic":  # the weights' rounding count is in the optimizer's top-level entry, which a
        return                # plain optimizer drops (docs/lowmem.md): the kept state alone is exact here
    assert train(model, opt, 4, start=4) == expected and same(weights(model), final)


def test_a_checkpoint_of_one_precision_loads_into_another():
    model = model_of()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O0", optimizer_states="int8", verbosity=0)
    train(model, opt, 3)
    osd = saved(opt.state_dict())
    amp.deinitialize()
    reference = {n: v.clone() for n, v in opt.state[model[0].weight].items()}
    for precision in ("float32", "bfloat16"):
        model2 = model_of()
        opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
        model2, opt2 = amp.initialize(model2, opt2, opt_level="O0", optimizer_states=precision, verbosity=0)
        opt2.load_state_dict(osd)
        amp.deinitialize()
        got = opt2.state[model2[0].weight]
        assert set(got) == {"step", "exp_avg", "exp_avg_sq"}
        for name in ("exp_avg", "exp_avg_sq"):
            tol = 0 if precision == "float32" else 1 / 128
            assert float((got[name] - reference[name]).abs().max()) <= tol * float(reference[name].abs().max())


@pytest.mark.parametrize("damage,match", [
    (lambda e: e["tensors"]["exp_avg"].update(codes=torch.zeros(3, dtype=torch.int8)), "codes of"),
    (lambda e: e["tensors"]["exp_avg"]["absmax"].fill_(float("nan")), "NaN"),
    (lambda e: e.update(rounds=-1), "'rounds'"),
    (lambda e: e["tensors"]["exp_avg"].update(signed="yes"), "signed"),
])
def test_a_malformed_kept_state_is_refused_before_anything_loads(damage, match):
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O5", optimizer_states="int8", verbosity=0)
    train(model, opt, 2)
    osd = saved(opt.state_dict())
    damage(osd["state"][0][STATES_KEY])
    before = kept_tensors()
    before = [t.clone() for t in before]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(osd)
    assert same(before, kept_tensors())


# ------------------------------------------------------------------ leaving ampatch
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("level,mode", [("O5", None), ("O3", None), ("O5", "stochastic")])
def test_after_deinitialize_the_optimizer_holds_plain_fp32_state(precision, level, mode):
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw = {} if mode is None else {"master_weights": mode}
    model, opt = amp.initialize(model, opt, opt_level=level, optimizer_states=precision, verbosity=0, **kw)
    train(model, opt, 3)
    kept = {n: p.to_float(model[0].weight.shape) for n, p in store().kept[id(opt.param_groups[0]["params"][0])].items()}
    amp.deinitialize()
    for p in model.parameters():
        entries = opt.state[p]
        assert set(entries) == {"step", "exp_avg", "exp_avg_sq"} and STATES_KEY not in entries
        assert all(v.dtype == F32 and v.shape == p.shape for n, v in entries.items() if n != "step")
    assert all(torch.equal(opt.state[model[0].weight][n], v) for n, v in kept.items())
    before = weights(model)
    x, y = batch(0)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()  # plain torch from here
    assert not same(before, weights(model))


# ------------------------------------------------------------------ refusals and the rest
def test_lbfgs_is_refused_with_its_name():
    model = model_of()
    with pytest.raises(ValueError, match="LBFGS"):
        amp.initialize(model, torch.optim.LBFGS(model.parameters()), opt_level="O0", optimizer_states="int8")
    assert model[0].weight.dtype == F32


def test_step_with_a_closure_is_refused():
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O0", optimizer_states="bfloat16", verbosity=0)
    x, y = batch(0)
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: ((model(x) - y) ** 2).mean())


def test_a_bad_value_names_the_choices():
    with pytest.raises(ValueError, match="'float32'.*'bfloat16'.*'int8'"):
        amp.initialize(model_of(), torch.optim.SGD(model_of().parameters(), lr=0.1), optimizer_states="fp16")


def test_adagrad_state_made_at_construction_is_kept_at_initialize():
    model = model_of()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", optimizer_states="int8", verbosity=0)
    assert "sum" not in opt.state[model[0].weight] and "sum" in store().kept[id(model[0].weight)]
    assert not store().kept[id(model[0].weight)]["sum"].signed  # a sum of squares: unsigned codes
    train(model, opt, 3)
    amp.deinitialize()
    assert float(opt.state[model[0].weight]["sum"].min()) >= 0.1


def test_add_param_group_after_initialize():
    model = model_of()
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O5", optimizer_states="int8", verbosity=0)
    opt.add_param_group({"params": list(model[3].parameters())})
    train(model, opt, 3)
    keys = [p for g in opt.param_groups for p in g["params"] if p.numel() >= 4096]
    assert len(keys) == 2 and all(id(k) in store().kept for k in keys)


def test_environment_forces_it(monkeypatch, caplog):
    monkeypatch.setenv("AMPATCH_OPTIMIZER_STATES", "int8")
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="ampatch"):
        amp.initialize(model, opt, opt_level="O5", optimizer_states="bfloat16")
    assert amp.report().optimizer_states == "int8"
    assert any("AMPATCH_OPTIMIZER_STATES=int8 overrides the script's optimizer_states=bfloat16" in r.getMessage()
               for r in caplog.records)


def test_a_policy_sets_it_and_a_keyword_beats_the_policy():
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, policy={"opt_level": "O5", "optimizer_states": "int8"}, verbosity=0)
    assert amp.report().optimizer_states == "int8"
    amp.deinitialize()
    with pytest.warns(UserWarning, match="beats the policy"):
        amp.initialize(model, opt, policy={"opt_level": "O5", "optimizer_states": "int8"}, optimizer_states="bfloat16")
    assert amp.report().optimizer_states == "bfloat16"
