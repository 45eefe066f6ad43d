"""Apex's argument values mean what they meant in Apex.

Apex's `Properties` checks (apex/amp/frontend.py), value by value: what Apex accepted is
accepted with the same meaning, what it refused (`warn_or_err`) raises, and
`_amp_state.hard_override = True` turns those refusals into warnings. `cast_model_type=False`
leaves the model uncast at every level; at O2 half params passed in (with
`_amp_state.allow_incoming_model_not_fp32`) still get FP32 master weights.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _config import props
from torch import nn

import ampatch as amp
from ampatch.config import env, options

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")


@pytest.fixture(autouse=True)
def _flags():
    amp._amp_state.hard_override = False
    amp._amp_state.allow_incoming_model_not_fp32 = False
    yield
    amp._amp_state.hard_override = False
    amp._amp_state.allow_incoming_model_not_fp32 = False


class Mixed(nn.Module):
    """An FP32 weight next to a half one (Apex's tests build models like this)."""

    def __init__(self, half: torch.dtype) -> None:
        super().__init__()
        self.w32 = nn.Parameter(torch.arange(1.0, 3.0))
        self.w16 = nn.Parameter(torch.arange(2.0, 4.0).to(half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w32 * self.w16.float()).sum()


# ------------------------------------------------------------------ cast_model_type=False
@pytest.mark.parametrize("level", LEVELS)
def test_cast_model_type_false_leaves_the_model_alone_at_every_level(level) -> None:
    got = props(level, cast_model_type=False)
    assert got.cast_model_type is None and not got.casts_model
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    out = amp.initialize(model, opt_level=level, cast_model_type=False, verbosity=0)
    assert all(p.dtype == F32 for p in out.parameters())
    if level not in ("O1", "O4"):  # no forward wrapper: an uncast model's output is FP32
        assert out(torch.randn(3, 4)).dtype == F32


@pytest.mark.parametrize("half", [F16, BF16], ids=["fp16", "bf16"])
def test_o2_uncast_model_half_params_get_fp32_masters(half) -> None:
    model = Mixed(half)
    opt = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    model, opt = amp.initialize(model, opt, opt_level="O5" if half == BF16 else "O2", half_dtype=half,
                                cast_model_type=False, verbosity=0)
    masters = list(amp.master_params(opt))
    assert [m.dtype for m in masters] == [F32, F32]
    assert masters[0] is model.w32 and masters[1] is not model.w16  # a separate FP32 master
    assert torch.equal(masters[1], model.w16.float())
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0
    x = torch.ones(2)
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(x), opt) as scaled:
            scaled.backward()
        assert masters[1].grad.dtype == F32
        torch.testing.assert_close(masters[1].grad, model.w32.detach())  # unscaled: d/dw16 = x * w32
        opt.step()
    assert model.w16.dtype == half and torch.equal(model.w16, masters[1].to(half))
    # the same steps in FP32: the master carries FP32 precision the half param cannot
    ref = Mixed(F32)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.25, momentum=0.5)
    for _ in range(3):
        ref_opt.zero_grad()
        ref(x).backward()
        ref_opt.step()
    torch.testing.assert_close(masters[1], ref.w16, rtol=0.02, atol=0.02)


def test_o2_without_masters_keeps_half_params_as_they_are() -> None:
    model = Mixed(F16)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    amp.initialize(model, opt, opt_level="O2", half_dtype=F16, cast_model_type=False, master_weights=False,
                   verbosity=0)
    assert list(amp.master_params(opt))[1] is model.w16


# ------------------------------------------------------------------ half models
def test_a_float16_model_is_refused_as_in_apex() -> None:
    model = nn.Linear(4, 4).half()
    with pytest.raises(RuntimeError, match="allow_incoming_model_not_fp32") as err:
        amp.initialize(model, opt_level="O1", verbosity=0)
    assert isinstance(err.value, ValueError) and ".half()" in str(err.value)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    amp.initialize(model, opt_level="O1", verbosity=0)  # let in on purpose
    amp._amp_state.allow_incoming_model_not_fp32 = False
    amp.initialize(model, opt_level="O1", verbosity=0, enabled=False)  # disabled: not checked, as in Apex
    amp._amp_state.hard_override = True
    with pytest.warns(UserWarning, match="hard_override"):
        amp.initialize(model, opt_level="O1", verbosity=0)


def test_a_model_cast_by_the_previous_session_is_not_refused() -> None:
    model = nn.Linear(4, 4)
    amp.initialize(model, opt_level="O2", half_dtype=F16, verbosity=0)
    assert model.weight.dtype == F16
    amp.initialize(model, opt_level="O1", verbosity=0)  # the first session is undone first
    assert model.weight.dtype == F32


# ------------------------------------------------------------------ Apex's checks, value by value
REFUSED = [  # (level, override): Apex's warn_or_err (O4 is checked like O1)
    ("O1", dict(cast_model_type=F16)), ("O1", dict(cast_model_type=BF16)),
    ("O1", dict(keep_batchnorm_fp32=True)), ("O1", dict(keep_batchnorm_fp32="False")),
    ("O1", dict(master_weights=True)), ("O1", dict(master_weights=False)),
    ("O4", dict(master_weights=False)), ("O4", dict(keep_batchnorm_fp32=False)),
    ("O0", dict(patch_torch_functions=True)), ("O2", dict(patch_torch_functions=True)),
    ("O3", dict(patch_torch_functions="True")),
]
ACCEPTED = [  # (level, override, attribute, value): accepted by Apex, with its meaning
    ("O1", dict(cast_model_type=F32), "cast_model_type", F32),
    ("O1", dict(cast_model_type=False), "cast_model_type", None),
    ("O1", dict(patch_torch_functions=False), "patch_torch_functions", False),
    ("O2", dict(cast_model_type=False), "master_weights", True),
    ("O2", dict(cast_model_type=F32), "casts_model", False),
    ("O0", dict(master_weights=True), "master_weights", True),
    ("O0", dict(keep_batchnorm_fp32="True"), "keep_batchnorm_fp32", True),
    ("O0", dict(loss_scale="dynamic"), "loss_scale", "dynamic"),
    ("O0", dict(cast_model_type=F16), "cast_model_type", F16),
    ("O2", dict(keep_batchnorm_fp32="False"), "keep_batchnorm_fp32", False),
    ("O3", dict(keep_batchnorm_fp32="True"), "keep_batchnorm_fp32", True),
    ("O3", dict(master_weights=True), "master_weights", True),
    ("O3", dict(loss_scale="128.0"), "loss_scale", 128.0),
    ("O2", dict(loss_scale=np.float32(512)), "loss_scale", 512.0),
    ("O2", dict(loss_scale=torch.tensor(64.0)), "loss_scale", 64.0),
    ("O2", dict(loss_scale=256), "loss_scale", 256.0),
]


@pytest.mark.parametrize("level, override", REFUSED, ids=lambda v: str(v))
def test_what_apex_refused_raises(level, override) -> None:
    with pytest.raises(options.OverrideError) as err:
        props(level, **override)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)  # ours, and Apex's type
    assert "O2" in str(err.value) or "O1" in str(err.value)  # names the level that does what was meant


@pytest.mark.parametrize("level, override", REFUSED, ids=lambda v: str(v))
def test_hard_override_turns_refusals_into_warnings(level, override) -> None:
    with pytest.warns(UserWarning, match="hard_override"):
        got = props(level, hard_override=True, **override)
    name, value = next(iter(override.items()))
    expected = {"True": True, "False": False}.get(value, value) if isinstance(value, str) else value
    assert getattr(got, name) == expected  # the value stands, as in Apex


def test_hard_override_through_amp_state() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="master_weights"):
        amp.initialize(model, opt_level="O1", master_weights=False, verbosity=0)
    amp._amp_state.hard_override = True
    with pytest.warns(UserWarning, match="master_weights"):
        amp.initialize(model, opt_level="O1", master_weights=False, verbosity=0)
    assert amp._amp_state.opt_properties.master_weights is False


@pytest.mark.parametrize("level, override, attr, value", ACCEPTED, ids=lambda v: str(v))
def test_what_apex_accepted_is_accepted(level, override, attr, value) -> None:
    got = props(level, half_dtype=F16, **override)
    assert getattr(got, attr) == value


def test_unknown_level_is_apex_runtime_error_too() -> None:
    with pytest.raises(RuntimeError, match="O0, O1, O2, O3"):
        amp.initialize(nn.Linear(2, 2), opt_level="O9")
    with pytest.raises(TypeError):  # Apex's argparse-friendly strings yes, other types no
        props("O2", cast_model_type=True)


def test_env_float16_does_not_apply_at_bfloat16_levels(monkeypatch, caplog) -> None:
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")
    forced = env.read()  # initialize reads the environment once and hands it to options.resolve
    assert props("O1", overrides=forced).half_dtype == F16
    with caplog.at_level("WARNING", logger="ampatch"):
        assert props("O4", overrides=forced).half_dtype == BF16
    assert "AMPATCH_HALF_DTYPE=float16 does not apply to O4" in caplog.text
    with pytest.raises(ValueError):  # an explicit argument still contradicts
        props("O5", half_dtype=F16)
