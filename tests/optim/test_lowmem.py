"""bfloat16 training without FP32 masters: master_weights="stochastic" / "kahan".

- a fine-tuning run whose updates are below half a bfloat16 ulp: O3's weights stall, both
  modes learn (kahan as close to O0 as O5 is; stochastic within a few percent of O0's progress);
- bad input at initialize: an unknown mode, a mode at O0/O1/O4, float16, LBFGS (FSDP2: test_sharded_lowmem.py);
- a skipped overflow step leaves weights, compensation, optimizer state and RNG untouched;
- checkpoints resume bit for bit (kahan compensation and stochastic RNG in the optimizer's
  state_dict), through torch.save/torch.load(weights_only=True);
- clipping on amp.master_params, add_param_group after initialize, deinitialize, zeroing;
- the step runs in chunks: the optimizer never sees FP32 copies of all params at once, and
  chunked equals unchunked; step hooks run once per step; torch.optim's optimizers work;
- report(): the mode and bytes per parameter.
"""
from __future__ import annotations

import copy
import io
import logging
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.session.session import current

F32, BF16 = torch.float32, torch.bfloat16
MODES = ["stochastic", "kahan"]


def masters_of(optimizer_index: int = 0):
    """The live session's masters object of one optimizer (LowMemMasters under these modes)."""
    return current().optimizers[optimizer_index].masters


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def batch(i: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def train(model, opt, steps: int, start: int = 0, clip: float | None = None) -> float:
    loss = torch.zeros(())
    for i in range(start, start + steps):
        x, y = batch(i)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
    return float(loss.detach())


@pytest.fixture(autouse=True)
def _end_session():
    yield
    amp.deinitialize()


# ---------------------------------------------------------------------------------------- learning
D, OUT, N, FT_STEPS, EPS = 32, 16, 512, 200, 0.03


class FineTuned(NamedTuple):
    start: float       # the loss (FP32) of the starting weights
    final: float       # the loss (FP32, after deinitialize) of the final weights
    unchanged: float   # the share of weight elements the run left unchanged
    curve: float       # the mean training loss of the last 40 steps: the curve's end, as tune judges
    rounded: float     # the loss of the final weights rounded to the nearest bfloat16


def _fine_tuning(level: str, master_weights, optimizer: str, seed: int = 0) -> FineTuned:
    """A pretrained-like start (weights of magnitude 0.5-1: one bfloat16 ulp is 2**-8) fine-tuned
    by updates of ~0.1 ulp each (AdamW lr 4e-4; SGD lr 0.3 with momentum): below half an ulp,
    so rounding to nearest drops every one. `scripts/lowmem_finetune.py` measures it by seed."""
    g = torch.Generator().manual_seed(1)
    sign = torch.randint(0, 2, (OUT, D), generator=g) * 2 - 1
    teacher = sign * (0.5 + 0.5 * torch.rand(OUT, D, generator=g))
    x = torch.randn(N, D, generator=g) / D ** 0.5
    y = x @ teacher.T + 0.01 * torch.randn(N, OUT, generator=g)
    start = teacher + EPS * torch.randn(OUT, D, generator=g)
    torch.manual_seed(seed)  # the stochastic rounding's seed
    model = nn.Linear(D, OUT, bias=False)
    with torch.no_grad():
        model.weight.copy_(start)
    opt = (torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.0) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9))
    kw = {} if master_weights is None else {"master_weights": master_weights}
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    first = model.weight.detach().clone()
    curve = []
    for i in range(FT_STEPS):
        j = (i * 64) % N
        opt.zero_grad()
        loss = ((model(x[j:j + 64]) - y[j:j + 64]) ** 2).mean()
        curve.append(float(loss.detach()))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    unchanged = (model.weight.detach() == first).float().mean().item()
    amp.deinitialize()
    with torch.no_grad():
        w = model.weight.detach()
        return FineTuned(float(((x @ start.T - y) ** 2).mean()), float(((x @ w.T - y) ** 2).mean()), unchanged,
                         sum(curve[-40:]) / 40, float(((x @ w.to(BF16).float().T - y) ** 2).mean()))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_o3_stalls_where_both_modes_learn(optimizer):
    """Distances are |loss - O0's loss| over O0's progress (start loss - O0's final loss), for
    the final loss (FP32, after deinitialize) and for the end of the training curve (the mean
    of the last 40 steps). Measured by `scripts/lowmem_finetune.py` (8 seeds, AdamW / SGD):
    final: O3 1.00 (every weight unchanged), O5 0.0009 / 0.0008, kahan = O5 to 1e-4,
    stochastic 0.0013-0.0034 / 0.0010-0.0020 (its weights end on bfloat16 values: O0's own
    final weights rounded to the nearest bfloat16 are 0.0007 / 0.0013 away); curve: O5
    0.0074 / 0.0050, stochastic 0.0052-0.0081 / 0.0033-0.0061 (mean 0.0061 / 0.0045).
    Independent draws per step instead of the rotation (`rounding.rotation`) measured
    0.010-0.021 final."""
    o0 = _fine_tuning("O0", None, optimizer)
    progress = o0.start - o0.final
    assert progress > 0.5 * o0.start  # O0 learns
    o3 = _fine_tuning("O3", None, optimizer)
    assert o3.unchanged > 0.95 and abs(o3.final - o0.final) > 0.9 * progress  # O3 stalls
    o5 = _fine_tuning("O5", None, optimizer)
    o5_gap, o5_curve_gap = abs(o5.final - o0.final), abs(o5.curve - o0.curve)
    assert o5_gap < 0.01 * progress
    kahan = _fine_tuning("O5", "kahan", optimizer)
    assert kahan.unchanged < 0.5
    assert abs(kahan.final - o0.final) <= 1.25 * o5_gap + 1e-4 * progress
    assert abs(kahan.curve - o0.curve) <= 1.25 * o5_curve_gap + 1e-4 * progress
    for seed in (0, 1):
        sr = _fine_tuning("O5", "stochastic", optimizer, seed=seed)
        assert sr.unchanged < 0.5
        assert abs(sr.curve - o0.curve) <= 1.25 * o5_curve_gap  # the curve ends as near O0's as O5's does
        assert abs(sr.final - o0.final) <= 0.005 * progress  # 200x closer than O3
    # and O3 with the mode learns as O5 with it does (O3 is the same half model)
    assert _fine_tuning("O3", "kahan", optimizer).final == kahan.final


def test_rotation_keeps_each_weights_rounding_error_near_one_ulp():
    """The same draws every step, shifted by `rotation(step)`: a weight moved by 0.13 ulp per
    step for 100 steps ends within 2 ulps of 13 ulps up, every one of 4096 (independent draws
    would scatter them by 3.4 ulps, one standard deviation), and the mean is still unbiased."""
    from ampatch.optim.rounding import rotation, stochastic_round_, stream
    ulp = 2.0 ** -7
    w = torch.full((4096,), 1.0)
    for step in range(100):
        x = w + 0.13 * ulp
        stochastic_round_(x, stream(7, 0), rotation(step))
        w = x
    jumps = (w - 1.0) / ulp
    assert (jumps - 13).abs().max() <= 2, jumps.unique()
    assert abs(jumps.mean().item() - 13) < 0.2

    independent = torch.full((4096,), 1.0)
    for step in range(100):
        x = independent + 0.13 * ulp
        stochastic_round_(x, stream(7, step))  # another stream, no shift: a new draw every step
        independent = x
    assert ((independent - 1.0) / ulp - 13).abs().max() > 6  # what the rotation avoids


# ---------------------------------------------------------------------------------------- bad input
def test_unknown_mode_is_refused_naming_the_values():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'stochastic' or 'kahan'"):
        amp.initialize(model, opt, opt_level="O5", master_weights="stochastik", verbosity=0)
    assert model[0].weight.dtype == F32


@pytest.mark.parametrize("level", ["O0", "O1", "O4"])
@pytest.mark.parametrize("mode", MODES)
def test_mode_where_the_model_stays_fp32_is_refused(level, mode):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="O5") as err:
        amp.initialize(model, opt, opt_level=level, master_weights=mode, verbosity=0)
    assert level in str(err.value)
    assert model[0].weight.dtype == F32 and opt.param_groups[0]["params"][0] is model[0].weight


@pytest.mark.parametrize("mode", MODES)
def test_float16_model_is_refused(mode):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="bfloat16") as err:
        amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, master_weights=mode, verbosity=0)
    assert "master_weights=True" in str(err.value)
    assert model[0].weight.dtype == F32


@pytest.mark.parametrize("mode", MODES)
def test_lbfgs_is_refused(mode):
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS.*master_weights=True"):
        amp.initialize(model, opt, opt_level="O5", master_weights=mode, verbosity=0)
    assert model[0].weight.dtype == F32 and opt.param_groups[0]["params"][0] is model[0].weight


# ---------------------------------------------------------------------------------------- skipping
def _snapshot(model, opt) -> dict:
    m = masters_of()
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "comp": [c.clone() for c in m.comp.values()],
            "state": copy.deepcopy(opt.state_dict()["state"]),
            "rounding": (m.seed, m.rounds)}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("loss_scale", [None, "dynamic"], ids=["static1", "dynamic"])
@pytest.mark.parametrize("mode", MODES)
def test_overflow_skips_step_leaving_everything_untouched(mode, loss_scale):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, loss_scale=loss_scale,
                                verbosity=0)
    train(model, opt, 3)
    before = _snapshot(model, opt)
    x, y = batch(50)
    opt.zero_grad()
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
        model[0].weight.grad[0, 0] = float("inf")
    opt.step()
    assert _same(_snapshot(model, opt), before)
    assert amp.report().skipped_steps == [3]
    assert all(p.grad is None for p in amp.master_params(opt) if p.dtype == BF16)
    train(model, opt, 1, start=51)  # and training goes on
    assert not _same(_snapshot(model, opt)["weights"], before["weights"])


# ---------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_for_bit(mode):
    def fresh():
        model = mlp(seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        return amp.initialize(model, opt, opt_level="O5", master_weights=mode, loss_scale="dynamic",
                              verbosity=0)

    model, opt = fresh()
    train(model, opt, 4)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, buf)
    train(model, opt, 4, start=4)
    straight = [p.detach().clone() for p in model.parameters()]
    straight_comp = [c.clone() for c in masters_of().comp.values()]
    amp.deinitialize()

    torch.manual_seed(1234)  # the resumed process draws other numbers before it loads
    torch.rand(7)
    model, opt = fresh()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    entry = ckpt["optimizer"]["ampatch_lowmem"]
    assert entry["mode"] == mode
    if mode == "kahan":  # each compensation in its param's state entry
        comps = [s["ampatch_compensation"] for s in ckpt["optimizer"]["state"].values() if "ampatch_compensation" in s]
        assert comps and all(c.dtype == BF16 for c in comps) and "compensation" not in entry
        assert any(c.abs().sum() > 0 for c in comps)
    else:
        assert entry["rounds"] == 4 and isinstance(entry["seed"], int) and "compensation" not in entry
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    assert all(v.dtype == F32 for st in opt.state.values() for k, v in st.items() if k != "step")
    train(model, opt, 4, start=4)
    assert _same([p.detach() for p in model.parameters()], straight)
    assert _same(list(masters_of().comp.values()), straight_comp)


def test_stochastic_rounding_is_seeded_from_the_script_seed_and_leaves_the_global_rng():
    def run(seed: int) -> list[torch.Tensor]:
        model = mlp(seed=0)
        torch.manual_seed(seed)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="stochastic", verbosity=0)
        state = torch.get_rng_state()
        train(model, opt, 3)
        assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not drawn from
        out = [p.detach().clone() for p in model.parameters()]
        amp.deinitialize()
        return out

    assert _same(run(5), run(5))
    assert not _same(run(5), run(6))


def test_o5_checkpoint_into_kahan_keeps_the_fp32_masters():
    model = mlp(seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)
    train(model, opt, 3)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    fp32 = [m.detach().clone() for m in amp.master_params(opt)]
    amp.deinitialize()
    model = mlp(seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    held = [m.float() + masters_of().comp[id(m)].float() if id(m) in masters_of().comp else m.detach()
            for m in amp.master_params(opt)]
    for a, b in zip(held, fp32):  # weight + compensation: ~16 bits of the FP32 master
        torch.testing.assert_close(a, b, rtol=2 ** -15, atol=0)


def test_fp32_model_checkpoint_sets_the_compensation():
    src = mlp(seed=4)
    model = mlp(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
    model.load_state_dict(src.state_dict())
    amp.deinitialize()  # the FP32 model back from weight + compensation
    for a, b in zip(model.parameters(), src.parameters()):
        torch.testing.assert_close(a, b, rtol=2 ** -15, atol=0)


# ---------------------------------------------------------------------------------------- the API around
@pytest.mark.parametrize("mode", MODES)
def test_master_params_yield_bf16_masters_with_grads_to_clip(mode):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, verbosity=0)
    x, y = batch(0)
    with amp.scale_loss(((model(x) - y) ** 2).mean() * 1e3, opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    assert [m.dtype for m in masters] == [p.dtype for p in model.parameters()]
    assert all(m.grad is not None and m.grad.dtype == m.dtype for m in masters)
    assert all(p.grad is None for p in model.parameters() if p.dtype == BF16)  # moved, not copied
    before = [p.detach().float().clone() for p in model.parameters()]
    total = torch.nn.utils.clip_grad_norm_(masters, 1e-2)
    assert total > 1e-2
    opt.step()
    moved = torch.cat([(p.detach().float() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert moved.norm() < 2e-2  # lr 1.0 times grads clipped to norm 0.01 (plus rounding)


@pytest.mark.parametrize("mode", MODES)
def test_add_param_group_after_initialize(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, verbosity=0)
    opt.add_param_group({"params": model[2].parameters(), "lr": 1e-2})
    head = model[2].weight.detach().clone()
    assert all(m is not model[2].weight for m in amp.master_params(opt))  # its master stands in for it
    train(model, opt, 3)
    assert not torch.equal(model[2].weight, head)
    assert model[2].weight.dtype == BF16
    assert all(v.dtype == F32 for st in opt.state.values() for k, v in st.items() if k != "step")
    if mode == "kahan":
        assert len(masters_of().comp) == 4


def test_deinitialize_restores_weight_plus_compensation():
    model = mlp()
    original = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
    m = masters_of()
    held = [p.detach().float() + m.comp[id(m.master_of[id(p)])].float() for p in model.parameters()]
    for a, b in zip(held, original):  # the compensation keeps what bfloat16 dropped of the FP32 start
        torch.testing.assert_close(a, b, rtol=2 ** -15, atol=0)
    train(model, opt, 2)
    held = [p.detach().float() + m.comp[id(m.master_of[id(p)])].float() for p in model.parameters()]
    amp.deinitialize()
    assert all(p.dtype == F32 for p in model.parameters())
    assert _same([p.detach() for p in model.parameters()], held)
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
    assert all(v.dtype == F32 for st in opt.state.values() for k, v in st.items() if k != "step")


def test_deinitialize_stochastic_gives_the_bf16_weights_in_fp32():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O3", master_weights="stochastic", verbosity=0)
    train(model, opt, 2)
    held = [p.detach().float() for p in model.parameters()]
    amp.deinitialize()
    assert _same([p.detach() for p in model.parameters()], held)


@pytest.mark.parametrize("how", ["optimizer", "model", "grad_none", "nothing"])
def test_grads_never_leak_across_steps(how):
    """Step on batch 0, zero grads the given way (or not at all), step on batch 1: the same
    weights as zeroing through the optimizer, so nothing of batch 0 leaked into step two."""
    def run(way: str) -> list[torch.Tensor]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
        for i in range(2):
            if i == 1:
                if way == "optimizer":
                    opt.zero_grad()
                elif way == "model":
                    model.zero_grad()
                elif way == "grad_none":
                    for p in [*model.parameters(), *amp.master_params(opt)]:
                        p.grad = None
            x, y = batch(i)
            with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        out = [p.detach().clone() for p in model.parameters()]
        amp.deinitialize()
        return out

    assert _same(run(how), run("optimizer"))


@pytest.mark.parametrize("mode", ["none", "fp32", "stochastic", "kahan"])
def test_report_names_the_mode_and_bytes_per_param(mode):
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # every param bfloat16
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    kw = {"none": {"opt_level": "O3"}, "fp32": {"opt_level": "O5"}}.get(
        mode, {"opt_level": "O5", "master_weights": mode})
    model, opt = amp.initialize(model, opt, verbosity=0, **kw)
    rep = amp.report()
    assert rep.master_weights == mode
    assert rep.trained_params == sum(p.numel() for p in model.parameters())
    assert rep.bytes_per_param == {"none": 2.0, "fp32": 6.0, "stochastic": 2.0, "kahan": 4.0}[mode]
    assert f"master weights: {mode}" in str(rep)
    assert type(rep).from_dict(rep.to_dict()) == rep


# ---------------------------------------------------------------------------------------- chunks
class RecordingSGD(torch.optim.SGD):
    """SGD that records, at each call of step(), the FP32 elements of its param_groups."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls: list[int] = []

    def step(self, closure=None):
        self.calls.append(sum(p.numel() for g in self.param_groups for p in g["params"] if p.dtype == F32))
        return super().step(closure)


def _chunky(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)))  # 6 x 1056 params


@pytest.mark.parametrize("mode", MODES)
def test_step_never_lifts_all_params_to_fp32(mode):
    model = _chunky()
    total = sum(p.numel() for p in model.parameters())
    opt = RecordingSGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, verbosity=0)
    masters_of().chunk_numel = 2500
    x = torch.randn(4, 32)
    with amp.scale_loss(model(x).square().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert len(opt.calls) == 3 and max(opt.calls) <= 2500 and sum(opt.calls) == total  # 3 x (2 layers = 2112)
    values, grads = masters_of().workspace.buffers[torch.device("cpu")]
    assert values.numel() == grads.numel() == 2112  # the FP32 workspace: one chunk's size
    assert all(p.dtype == BF16 for p in amp.master_params(opt))  # back to aliases


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_chunked_step_equals_one_chunk_for_every_optimizer(name):
    def run(chunk: int) -> tuple[list[torch.Tensor], list[torch.Tensor], float, float]:
        model = _chunky()
        opt = OPTIMIZERS[name](model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
        masters_of().chunk_numel = chunk
        x, y = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), torch.randn(8, 32)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            losses.append(float(loss.detach()))
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        assert all(v.dtype == F32 for st in opt.state.values() for k, v in st.items() if k != "step")
        out = [p.detach().clone() for p in model.parameters()], [c.clone() for c in masters_of().comp.values()]
        amp.deinitialize()
        return *out, losses[0], losses[-1]

    w1, c1, first, last = run(1 << 30)
    w2, c2, _, _ = run(1500)
    assert last < first  # it trains
    assert _same(w1, w2) and _same(c1, c2)


def test_step_hooks_run_once_per_step():
    model = _chunky()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", len(o.param_groups[0]["params"]))))
    opt.register_step_post_hook(lambda o, a, k: seen.append(("post", len(o.param_groups[0]["params"]))))
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="stochastic", verbosity=0)
    masters_of().chunk_numel = 1500
    for _ in range(2):
        with amp.scale_loss(model(torch.randn(4, 32)).square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert seen == [("pre", 12), ("post", 12)] * 2  # the whole groups, not a chunk


def test_user_optimizer_with_fp32_params_in_the_first_chunk():
    """Batch norm stays FP32 at O5 (its own master): it steps with the first chunk."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = RecordingSGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="stochastic", verbosity=0)
    masters_of().chunk_numel = 100
    bn = model[1].weight.detach().clone()
    train(model, opt, 1)
    assert model[1].weight.dtype == F32 and not torch.equal(model[1].weight, bn)
    assert opt.calls[0] >= 32 and len(opt.calls) > 1


def test_information_logged_for_a_checkpoint_of_another_mode(caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
    train(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    amp.deinitialize()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)
    with caplog.at_level(logging.INFO, logger="ampatch"):
        opt.load_state_dict(sd)
    assert "master_weights='kahan'" in caplog.text and "not loaded" in caplog.text


def test_bad_lowmem_checkpoint_entry_loads_nothing():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
    train(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][99] = {"ampatch_compensation": torch.zeros(3, dtype=BF16)}  # a param this optimizer lacks
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="compensation for state entry 99"):
        opt.load_state_dict(sd)
    assert _same(opt.state_dict(), before)


def _corrupt(tensor: torch.Tensor, how: str):
    if how == "nan":
        bad = tensor.clone()
        bad.view(-1)[3] = float("nan")
        return bad
    if how == "inf":
        bad = tensor.clone()
        bad.view(-1)[0] = float("-inf")
        return bad
    return {"float64": lambda: tensor.double(), "int": lambda: tensor.to(torch.int16), "list": lambda: tensor.tolist(),
            "shape": lambda: tensor.view(-1)}[how]()


@pytest.mark.parametrize("how, says", [("nan", "holds NaN or inf"), ("inf", "holds NaN or inf"),
                                       ("float64", "is dtype torch.float64"), ("int", "is dtype torch.int16"),
                                       ("list", "is list"), ("shape", r"is shape \(64,\)")])
def test_malformed_compensation_is_refused_naming_it_and_nothing_loads(how, says):
    """A kahan checkpoint whose compensation is corrupted (NaN: the next step would make every
    weight of that tensor NaN) or malformed is refused before anything loads: the error names
    the compensation (its index and its param's shape), and the weights, compensations,
    optimizer state and the masters' FP32-ness are as they were."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    train(model, opt, 1, start=2)  # the live state moves on: a load would be seen
    sd["state"][4]["ampatch_compensation"] = _corrupt(sd["state"][4]["ampatch_compensation"], how)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=rf"compensation of param 4 \(shape \(4, 16\)\) {says}"):
        opt.load_state_dict(sd)
    assert _same(_snapshot(model, opt), before)
    assert all(v.dtype == F32 for st in opt.state.values() for k, v in st.items() if k != "step")
    train(model, opt, 1, start=3)  # and the session trains on
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("key, value", [("rounds", -1), ("rounds", 2.5), ("seed", "7"), ("rounds", True)])
def test_bad_stochastic_checkpoint_entry_loads_nothing(key, value):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="stochastic", verbosity=0)
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["ampatch_lowmem"][key] = value
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=f"'{key}' must be an int >= 0"):
        opt.load_state_dict(sd)
    assert _same(opt.state_dict(), before) and before["ampatch_lowmem"]["rounds"] == 2


def test_stochastic_checkpoint_without_a_step_count_says_so(caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="stochastic", verbosity=0)
    train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    del sd["ampatch_lowmem"]["rounds"]
    with caplog.at_level(logging.INFO, logger="ampatch"):
        opt.load_state_dict(sd)
    assert masters_of().rounds == 0 and "no stochastic rounding step count" in caplog.text


# ---------------------------------------------------------------------------------------- rounding
def test_stochastic_rounding_is_unbiased_and_bfloat16_exact():
    from ampatch.optim.rounding import stochastic_round_, stream
    ulp = 2.0 ** -7  # of bfloat16 in [1, 2)
    for k, (value, shift) in enumerate(((1.0 + 0.3 * ulp, 0), (-(1.0 + 0.7 * ulp), 12345),
                                        (1.0 + 0.01 * ulp, 65535), (3e-3 * ulp, 40503))):
        x = torch.full((400_000,), value)
        stochastic_round_(x, stream(0, k), shift, first=1000 * k)
        assert torch.equal(x.to(BF16).float(), x)  # every result is a bfloat16 value
        assert len(x.unique()) == 2  # the neighbours below and above
        lo, hi = x.unique()
        p_up = (x == (hi if value > 0 else lo)).float().mean().item()
        frac = (abs(value) - min(abs(lo), abs(hi))) / float(hi - lo)
        assert abs(x.double().mean().item() - value) < 4e-3 * float(hi - lo)
        assert abs(p_up - frac) < 4e-3, (value, p_up, frac)  # up with the probability of the dropped part
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf")])
    out = exact.clone()
    stochastic_round_(out, stream(0, 9))
    assert torch.equal(out, exact)  # bfloat16 values (and infinities) stay as they are
    nan = torch.tensor([float("nan")] * 8)
    stochastic_round_(nan, stream(0, 10))
    assert nan.isnan().all()


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_micro_batches_match_the_whole_batch(mode):
    """Two scale_loss blocks (half the batch each, loss halved) before one step: the grads add
    up on the masters (in bfloat16) to the whole batch's."""
    def grads(micro: bool) -> list[torch.Tensor]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, loss_scale="dynamic",
                                    verbosity=0)
        x, y = batch(0)
        parts = [(x[:8], y[:8]), (x[8:], y[8:])] if micro else [(x, y)]
        for xb, yb in parts:
            with amp.scale_loss(((model(xb) - yb) ** 2).mean() / len(parts), opt) as scaled:
                scaled.backward()
        out = [p.grad.float().clone() for p in amp.master_params(opt)]
        amp.deinitialize()
        return out

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=1e-3)


def test_initialize_again_with_the_same_optimizer():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
    train(model, opt, 2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="stochastic", verbosity=0)
    train(model, opt, 2, start=2)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)  # FP32 masters
    train(model, opt, 2, start=4)
    assert all(m.dtype == F32 for m in amp.master_params(opt))
    assert all(v.dtype == F32 for st in opt.state.values() for k, v in st.items() if k != "step")
    assert len(opt.state) == len(list(model.parameters()))


# ---------------------------------------------------------------------------------------- frameworks
@pytest.mark.parametrize("mode", MODES)
def test_lightning_plugin_passes_the_mode_through(mode):
    """AmpatchPrecision(..., master_weights=mode) trains as the hand-written loop does, with
    Lightning's clipping on the masters."""
    L = pytest.importorskip("lightning.pytorch")
    from ampatch.lightning import AmpatchPrecision

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, b, i):
            return ((self.net(b[0]) - b[1]) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    # the plugin casts every float of the batch to bfloat16, targets included: make them bfloat16 values
    data = [(x, y.to(BF16).float()) for x, y in (batch(i) for i in range(4))]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    torch.manual_seed(0)
    module = Module()
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5,
              plugins=[AmpatchPrecision("O5", master_weights=mode, verbosity=0)]).fit(module, loader)
    torch.manual_seed(0)
    model = Module().net
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, verbosity=0)
    for x, y in data:
        with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
        opt.step()
        opt.zero_grad()
    amp.deinitialize()
    assert _same([p.detach() for p in module.net.parameters()], [p.detach() for p in model.parameters()])


def _hf_trainer_cases():
    """tests/integrations/test_hf_trainer.py as a module (its dataset, Trainer and hand loop)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "integrations" / "test_hf_trainer.py"
    spec = importlib.util.spec_from_file_location("hf_trainer_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", MODES)
def test_ampatch_trainer_passes_the_mode_through(mode, tmp_path):
    """AmpatchTrainer(initialize_kwargs={"master_weights": mode}) on GPT-2 (tied weights)
    trains loss for loss and weight for weight as the hand-written loop (tests/integrations/test_hf_trainer.py's)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    tt = _hf_trainer_cases()
    data = tt.dataset("gpt2", tt.STEPS * tt.BATCH)
    trainer = tt.trained("gpt2", "O5", tmp_path, data=data, initialize_kwargs={"master_weights": mode})
    losses, _, model = tt.hand_loop("gpt2", "O5", trainer, data, master_weights=mode)
    assert trainer.losses == losses
    assert _same([p.detach() for p in trainer.model.parameters()], [p.detach() for p in model.parameters()])
