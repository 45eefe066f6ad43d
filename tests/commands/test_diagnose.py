"""ampatch diagnose: planted precision problems are found in the module that has them, a clean
model gets no recommendation, and recording changes nothing in the training it watches.

Each planted model runs in-process with AMPATCH_DIAGNOSE set (the session attaches the
recorder, as in a diagnosed child run); the command line, with its verification runs, is
tested in tests/commands/test_diagnose_cli.py.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.config import env
from ampatch.diagnose.analysis import analyse, diagnosis, error_floor
from ampatch.diagnose.render import render
from ampatch.record.recorder import Recorder
from ampatch.record.stats import relative_error, underflow_fraction


class _Amplify(torch.autograd.Function):
    """Identity forward; a backward that overflows in float16 on the way (x 1e6, then / 1e6)
    and is exact in FP32."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g * 1e6) / 1e6


class Fragile(nn.Module):
    def forward(self, x):
        return _Amplify.apply(x)


class Cancel(nn.Module):
    """(x + 512) - 512: bfloat16 keeps 8 bits, so x is lost; FP32 keeps it."""

    def forward(self, x):
        return (x + 512.0) - 512.0


class Net(nn.Module):
    def __init__(self, mid: nn.Module | None = None, big: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.big = nn.Linear(32, 32)
        self.mid = mid if mid is not None else nn.Identity()
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight.mul_(big)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(self.norm(self.mid(self.big(h))))


def _train(model: nn.Module, level: str, half: torch.dtype | None, steps: int = 6, loss_mult: float = 1.0,
           lr: float = 1e-3, **kwargs) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0, **kwargs)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen) * 4
        y = torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y) * loss_mult
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    amp.deinitialize()
    return losses


def _diagnose(tmp_path, monkeypatch, model: nn.Module, level: str, half: torch.dtype | None, **kw) -> dict:
    path = tmp_path / "diag.json"
    monkeypatch.setenv(env.DIAGNOSE, str(path))
    _train(model, level, half, **kw)
    doc = json.loads(path.read_text())
    return analyse(doc)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_forward_overflow_in_float16_is_the_first_nonfinite_module(tmp_path, monkeypatch, level):
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(big=20000.0), level, torch.float16)
    first = result["first_nonfinite"]
    assert first == {"step": 0, "phase": "forward", "module": "big", "kind": "overflow"}
    assert result["recommendation"]["keep_fp32"] == ["big"]
    big = next(m for m in result["modules"] if m["name"] == "big")
    assert big["out_nonfinite"] > 0 and big["rel_error_inf"] and big["headroom"] < 1.5
    # its parents and the modules after it saw non-finite inputs: not blamed
    assert next(m for m in result["modules"] if m["name"] == "norm")["rel_error"] is not None


def test_a_backward_overflow_is_found_in_the_module_whose_backward_overflows(tmp_path, monkeypatch):
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(mid=Fragile()), "O1", torch.float16, steps=8)
    assert result["first_nonfinite"]["phase"] == "backward"
    assert result["first_nonfinite"]["module"] == "mid"
    assert result["recommendation"]["keep_fp32"] == ["mid"]
    assert result["skipped_steps"] == list(range(8))  # no loss scale helps: the scaler is not blamed


def test_a_catastrophic_cancellation_in_bfloat16_has_the_largest_local_error(tmp_path, monkeypatch):
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(mid=Cancel()), "O4", None)
    assert result["first_nonfinite"] is None
    leaves = [m for m in result["modules"] if m["leaf"]]
    assert leaves[0]["name"] == "mid" and leaves[0]["rel_error"] > 0.5
    assert all(m["rel_error"] < error_floor("bfloat16") for m in leaves[1:] if m["rel_error"] is not None)
    assert result["recommendation"]["keep_fp32"] == ["mid"]


def test_grad_underflow_without_a_loss_scale_recommends_a_dynamic_one(tmp_path, monkeypatch):
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(), "O3", torch.float16, loss_mult=1e-7)
    rec = result["recommendation"]
    assert rec["settings"] == {"loss_scale": "dynamic"}
    assert any("underflow" in n and "dynamic loss scale" in n for n in rec["notes"])
    assert rec["keep_fp32"] == []


@pytest.mark.parametrize("level,half,lr", [("O1", torch.float16, 1e-3), ("O2", torch.float16, 1e-3), ("O4", None, 1e-3),
                                           ("O5", None, 1e-3), ("O3", torch.bfloat16, 0.1), ("O0", None, 1e-3)])
def test_a_clean_model_gets_an_empty_recommendation(tmp_path, monkeypatch, level, half, lr):
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(), level, half, lr=lr)
    assert result["first_nonfinite"] is None
    assert result["recommendation"]["keep_fp32"] == []
    assert result["recommendation"]["settings"] == {}
    assert result["stall"] is None


@pytest.mark.parametrize("level", ["O3", "O5"])
def test_updates_below_bfloat16_resolution_are_stalled_updates_without_masters(tmp_path, monkeypatch, level):
    """SGD at lr 1e-3 on weights of ~0.1: every update is below half of bfloat16's spacing around
    its weight. At O3 (bfloat16 weights, no masters) the steps leave ~90% of the weights as they
    were: a finding, with FP32 masters recommended; at O5 the FP32 masters take every update."""
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(), level, torch.bfloat16 if level == "O3" else None, lr=1e-3)
    unchanged = {m["name"]: m["unchanged"] for m in result["modules"] if m["unchanged"] is not None}
    if level == "O5":
        assert result["stall"] is None and max(unchanged.values()) < 0.05   # (a dead ReLU unit's row stays)
        assert {m["held_in"] for m in result["modules"] if m["held_in"]} == {"float32"}
        return
    stall = result["stall"]
    assert stall["finding"] and stall["unchanged"] > 0.8 and stall["held_in"] == "bfloat16"
    assert {m["name"] for m in stall["modules"]} >= {"big", "inp"} and unchanged["big"] > 0.8
    rec = result["recommendation"]
    assert rec["settings"] == {"master_weights": True} and rec["keep_fp32"] == []
    note = next(n for n in rec["notes"] if n.startswith("stalled updates"))
    assert "big: 9" in note and "below bfloat16's resolution" in note and "O2/O5" in note and "kahan" in note
    text = render(diagnosis(json.loads((tmp_path / "diag.json").read_text())), "test")
    assert "stalled updates:" in text and "recommendation: master_weights=True" in text and "unchanged" in text


def test_recording_changes_nothing_in_the_training(tmp_path, monkeypatch):
    """Dropout draws the same masks, batch norm's running statistics move once, the losses
    and weights are bit-for-bit those of an unrecorded run, and no hook stays behind."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))

    plain = model()
    torch.manual_seed(5)
    losses = _train(plain, "O2", torch.bfloat16)
    watched = model()
    monkeypatch.setenv(env.DIAGNOSE, str(tmp_path / "d.json"))
    torch.manual_seed(5)
    assert _train(watched, "O2", torch.bfloat16) == losses
    assert json.loads((tmp_path / "d.json").read_text())["recorded"]["steps"]  # it did record
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    for m in watched.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(not p._backward_hooks for p in watched.parameters())
    assert all(math.isfinite(x) for x in losses)


def test_the_recorder_stops_after_its_steps_and_removes_its_hooks():
    model = Net()
    rec = Recorder([model], torch.bfloat16, steps=2)
    rec.attach()
    for _ in range(3):
        out = model(torch.randn(4, 16))
        rec.on_loss(out.sum(), 1.0)
        out.sum().backward()
        rec.on_step(False)
    assert len(rec.steps) == 2 and not rec.active
    assert all(not m._forward_hooks for m in model.modules())
    assert {m["name"] for m in rec.result()["modules"]} == {"", "inp", "big", "mid", "norm", "out"}


def test_relative_error_and_underflow_figures():
    a = torch.tensor([1.0, 2.0, 2.0])
    assert relative_error([a], [a]) == 0.0
    assert relative_error([a * 1.1], [a]) == pytest.approx(0.1)
    assert relative_error([torch.tensor([math.inf, 0, 0])], [a]) == math.inf
    assert relative_error([a], [torch.tensor([math.nan, 0, 0])]) is None  # no finite reference
    assert relative_error([a], [a[:2]]) is None
    g = torch.tensor([0.0, 1e-6, 1e-3, 1.0])
    assert underflow_fraction(g, torch.float16) == 0.5   # 0 and 1e-6 are below float16's smallest normal
    assert underflow_fraction(g, torch.bfloat16) == 0.25


@pytest.mark.parametrize("workload", ["lm", "cnn", "lstm"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_no_false_alarm_on_the_built_in_workloads(tmp_path, monkeypatch, workload, level):
    """A model that trains fine shows nothing alarming, at every level (bfloat16, the CPU's
    half dtype): nothing non-finite, no module to keep, no setting to change."""
    import importlib
    module = importlib.import_module(f"ampatch.workloads.{workload}")
    path = tmp_path / "diag.json"
    monkeypatch.setenv(env.DIAGNOSE, str(path))
    module.main(["--steps", "4", "--size", "tiny", "--opt-level", level, "--threads", "1"])
    amp.deinitialize()
    result = analyse(json.loads(path.read_text()))
    assert result["steps"] == 4
    assert result["first_nonfinite"] is None
    assert result["recommendation"]["keep_fp32"] == [], result["recommendation"]["notes"]
    assert result["recommendation"]["settings"] == {}


def test_a_loss_scale_forced_from_outside_wins_and_a_bad_one_names_the_variable(monkeypatch):
    monkeypatch.setenv(env.LOSS_SCALE, "dynamic")
    model = nn.Linear(2, 2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O3", half_dtype=torch.float16,
                   verbosity=0)
    assert amp.loss_scale() == 2.0 ** 16 and amp._amp_state.loss_scalers[0].dynamic
    amp.deinitialize()
    monkeypatch.setenv(env.LOSS_SCALE, "lots")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="AMPATCH_LOSS_SCALE='lots'"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O3", verbosity=0)


def test_a_bad_max_steps_names_the_variable(monkeypatch):
    monkeypatch.setenv(env.MAX_STEPS, "-3")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="AMPATCH_MAX_STEPS='-3'"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)


def test_the_plot_draws_each_leaf_and_marks_the_recommended_one(tmp_path, monkeypatch):
    """`--plot`: a PNG with one bar per leaf module in each panel, the recommended module red."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from ampatch.diagnose.render import write_plot

    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(big=20000.0), "O2", torch.float16)
    drawn: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: (drawn.append(self), save(self, *a, **kw)))
    write_plot(str(tmp_path / "diag.png"), diagnosis(json.loads((tmp_path / "diag.json").read_text())),
               "planted overflow")
    assert (tmp_path / "diag.png").read_bytes().startswith(b"\x89PNG")
    errors, headroom = drawn[0].axes
    leaves = [m["name"] for m in result["modules"] if m["leaf"]]
    assert [t.get_text() for t in errors.get_yticklabels()] == leaves
    bars = {name: bar for name, bar in zip(leaves, headroom.patches)}
    assert bars["big"].get_facecolor()[:3] == (0.8392156862745098, 0.15294117647058825, 0.1568627450980392)  # tab:red
    assert bars["big"].get_width() < 1.5 and bars["out"].get_width() > 1.5


class Whisper(nn.Module):
    """A residual branch scaled by 1e-9: its weights' gradients are below float16's smallest
    subnormal, so without a loss scale that layer never learns."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return x + 1e-9 * self.lin(x)


def test_one_layer_whose_gradient_underflows_whole_is_a_finding(tmp_path, monkeypatch):
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(mid=Whisper()), "O3", torch.float16)
    rec = result["recommendation"]
    under = {m["name"]: m["grad_underflow"] for m in result["modules"] if m["grad_underflow"] is not None}
    assert under["mid.lin"] >= 0.99 and sum(u >= 0.5 for u in under.values()) * 2 < len(under)  # one of many
    assert rec["settings"] == {"loss_scale": "dynamic"}
    assert any("mid.lin" in n and "never learns" in n for n in rec["notes"])


class Dead(nn.Module):
    """A layer behind a ReLU that never fires: its weights' gradients are exactly 0 in FP32 too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        with torch.no_grad():
            self.lin.bias.fill_(-1e3)

    def forward(self, x):
        return x + torch.relu(self.lin(x))


def test_zero_gradients_in_bfloat16_are_not_underflow(tmp_path, monkeypatch):
    """bfloat16's range is FP32's: a gradient that is 0 in it is 0 at O0 too (a dead layer, a
    saturated softmax) and no loss scale brings it back, so no loss scale is recommended."""
    torch.manual_seed(0)
    result = _diagnose(tmp_path, monkeypatch, Net(mid=Dead()), "O4", None)
    under = {m["name"]: m["grad_underflow"] for m in result["modules"] if m["grad_underflow"] is not None}
    assert under["mid.lin"] >= 0.99
    assert result["recommendation"]["settings"] == {}
    assert not any("underflow" in n for n in result["recommendation"]["notes"])


def test_an_optimizer_step_that_makes_weights_nan_is_a_step_fault_not_a_module(tmp_path, monkeypatch):
    """O3 float16 with Adam's eps=1e-8 (0 in float16): a weight whose gradient is 0 becomes
    0/0 = NaN at the step. No module's precision causes it, so none is recommended: FP32 master
    weights are (the optimizer then steps FP32 copies), as the notes say. No note blames the
    data for the loss that goes NaN after that step."""
    torch.manual_seed(0)
    path = tmp_path / "diag.json"
    monkeypatch.setenv(env.DIAGNOSE, str(path))
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    model, opt = amp.initialize(model, opt, opt_level="O3", half_dtype=torch.float16, verbosity=0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(8, 16, generator=gen)
        x[:, :4] = 0  # the first inputs are always 0: their weights' gradients are 0
        loss = nn.functional.cross_entropy(model(x.half()).float(), torch.randint(0, 4, (8,), generator=gen))
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    amp.deinitialize()
    found = diagnosis(json.loads(path.read_text()))
    result = found.to_dict()
    fault = result["step_fault"]
    assert fault is not None and fault["step"] == 0 and "inp" in fault["modules"]
    assert result["recommendation"]["keep_fp32"] == []
    assert result["recommendation"]["settings"]["master_weights"] is True
    assert result["first_nonfinite"]["phase"] == "step"
    notes = result["recommendation"]["notes"]
    assert any(n.startswith("step fault") for n in notes) and not any("bad labels" in n for n in notes)
    text = render(found, "test")
    assert "first non-finite: step nonfinite weights in inp at step 0" in text
    assert "recommendation: master_weights=True (the optimizer's own step" in text


def test_the_recorder_loads_only_for_a_diagnosis():
    """`import ampatch` and a plain session leave diagnose's recorder unimported: it is loaded
    when AMPATCH_DIAGNOSE asks for it, not paid for by every training script."""
    import subprocess
    import sys
    code = ("import sys, torch, ampatch as amp; m = torch.nn.Linear(2, 2); "
            "amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level='O1', verbosity=0); "
            "print('ampatch.record.recorder' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AMPATCH_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_the_growth_rule_diagnose_and_tune_share():
    """A kept set that did not make the run finite grows by the run's first non-finite module if
    it is new, else by the parent of the last module kept; never after a step fault."""
    from ampatch.diagnose.analysis import grow
    from ampatch.diagnose.result import Diagnosis, FirstNonfinite, Recommendation, StepFault

    def found(module=None, fault=None):
        first = FirstNonfinite(0, "forward", module, "overflow") if module else None
        return Diagnosis(1, "float16", first, (), Recommendation(), step_fault=fault)
    assert grow(["a.b"], found("c")) == "c"
    assert grow(["a.b"], found("a.b")) == "a" and grow(["a.b"], None) == "a"
    assert grow(["a", ""], found("a")) is None
    fault = StepFault(*[None] * len(StepFault.__dataclass_fields__))
    assert grow(["a.b"], found("c", fault)) is None


def test_an_outlier_among_exact_modules_is_named_in_plain_numbers():
    """Most leaves exact in half (norms run in FP32, identities): the typical module's error is 0,
    so the note names the floor the outlier cleared, not a ratio to 0."""
    from ampatch.record.records import ModuleRecord, Recording, StepRecord
    steps = [StepRecord(i, 2.0, True, 1.0, False) for i in range(4)]
    modules = [ModuleRecord("fc", "Linear", True, 4, 1.0, rel_errors=[0.003]),
               *(ModuleRecord(f"norm{i}", "LayerNorm", True, 4, 1.0, rel_errors=[0.0]) for i in range(3)),
               ModuleRecord("shift", "Shift", True, 4, 1.0, rel_errors=[0.7])]
    r = diagnosis(Recording("O4", "bfloat16", 1.0, "none", [], [], True, 4, steps, modules, [])).recommendation
    assert r.keep_fp32 == ("shift",)
    note = next(n for n in r.notes if n.startswith("shift"))
    assert "the typical module's is 0" in note and "e+" not in note, note
