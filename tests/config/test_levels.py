"""Opt levels and properties: the DESIGN.md table, overrides, configuration
errors, the forced level from AMPATCH_OPT_LEVEL, refusal of wrapped models, return shapes,
and `enabled=False` being bit-for-bit plain FP32 training.
"""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from _config import props
from torch import nn

import ampatch as amp
from ampatch.config import levels
from ampatch.config.options import Properties

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")



def expected_row(level: str, half: torch.dtype) -> dict:
    """The DESIGN.md table with "half" resolved and the bfloat16 loss-scale default applied."""
    dyn = "dynamic" if half == F16 else 1.0
    return {
        "O0": dict(cast_model_type=F32, patch_torch_functions=False, keep_batchnorm_fp32=None,
                   master_weights=False, loss_scale=1.0),
        "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
                   master_weights=None, loss_scale=dyn),
        "O2": dict(cast_model_type=half, patch_torch_functions=False, keep_batchnorm_fp32=True,
                   master_weights=True, loss_scale=dyn),
        "O3": dict(cast_model_type=half, patch_torch_functions=False, keep_batchnorm_fp32=False,
                   master_weights=False, loss_scale=1.0),
        "O4": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
                   master_weights=None, loss_scale=1.0),
        "O5": dict(cast_model_type=BF16, patch_torch_functions=False, keep_batchnorm_fp32=True,
                   master_weights=True, loss_scale=1.0),
    }[level]


def row_of(props: Properties) -> dict:
    return {k: getattr(props, k) for k in ("cast_model_type", "patch_torch_functions",
                                           "keep_batchnorm_fp32", "master_weights", "loss_scale")}


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


# ------------------------------------------------------------------ the table
@pytest.mark.parametrize("level,half", [
    pytest.param(level, half, id=f"{level}-{name}")
    for level in LEVELS for half, name in ((None, "auto"), (F16, "fp16"), (BF16, "bf16"))
    if not (half == F16 and level in ("O4", "O5"))  # a contradiction, tested below
])
def test_table_without_overrides(level, half):
    got = props(level, device=torch.device("cpu"), half_dtype=half)
    resolved_half = half or BF16  # auto on CPU is bfloat16
    if level in ("O4", "O5"):
        resolved_half = BF16
    assert got.opt_level == level
    assert got.enabled is True
    assert got.half_dtype == resolved_half
    assert row_of(got) == expected_row(level, resolved_half)
    assert got.casts_model == (level in ("O2", "O3", "O5"))


def test_auto_half_dtype_follows_device():
    assert levels.default_half_dtype(torch.device("cpu")) == BF16
    assert levels.default_half_dtype(None) == BF16
    assert levels.default_half_dtype(torch.device("cuda")) == F16
    got = props("O2", device=torch.device("cuda"))
    assert got.half_dtype == F16 and got.cast_model_type == F16 and got.loss_scale == "dynamic"
    # O5 stays bfloat16 with scale 1.0 even where float16 is the default
    got = props("O5", device=torch.device("cuda"))
    assert got.half_dtype == BF16 and got.loss_scale == 1.0


def test_cpu_default_loss_scale_is_one_for_bfloat16():
    m, o = amp.initialize(bn_model(), torch.optim.SGD(bn_model().parameters(), lr=0.1), opt_level="O1")
    assert amp.loss_scale() == 1.0
    assert amp.report().half_dtype == "bfloat16"
    m, o = amp.initialize(bn_model(), torch.optim.SGD(bn_model().parameters(), lr=0.1), opt_level="O1",
                          half_dtype=F16)
    assert amp.loss_scale() == 2.0 ** 16
    assert amp.report().half_dtype == "float16"


def test_bfloat16_with_explicit_loss_scale_keeps_it():
    assert props("O2", loss_scale="dynamic").loss_scale == "dynamic"
    assert props("O5", loss_scale=128).loss_scale == 128.0
    assert props("O1", half_dtype=F16, loss_scale=1.0).loss_scale == 1.0


@pytest.mark.parametrize("level", ["O4", "O5"])
@pytest.mark.parametrize("spelling", [F16, "float16", "torch.float16", "half"])
def test_bfloat16_levels_refuse_float16(level, spelling):
    with pytest.raises(ValueError, match="bfloat16") as err:
        props(level, half_dtype=spelling)
    assert ("O1" if level == "O4" else "O2") in str(err.value)  # names the level to use instead
    with pytest.raises(ValueError):
        amp.initialize(bn_model(), opt_level=level, half_dtype=spelling)
    with pytest.raises(ValueError):
        amp.initialize(bn_model(), opt_level=level, patch_torch_functions_type=spelling)


def test_patch_torch_functions_type_is_an_alias_of_half_dtype():
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", patch_torch_functions_type=F16)
    assert model[0].weight.dtype == F16
    assert amp.loss_scale() == 2.0 ** 16
    amp.initialize(bn_model(), opt_level="O1", patch_torch_functions_type="bfloat16")
    assert amp.report().half_dtype == "bfloat16"
    # both given and equal: fine; disagreeing: a ValueError
    amp.initialize(bn_model(), opt_level="O1", half_dtype=F16, patch_torch_functions_type=F16)
    assert amp.report().half_dtype == "float16"
    with pytest.raises(ValueError, match="disagree"):
        amp.initialize(bn_model(), opt_level="O1", half_dtype=F16, patch_torch_functions_type=BF16)


def test_level_names_are_case_and_space_tolerant():
    assert props(" o2 ").opt_level == "O2"


# ------------------------------------------------------------------ overrides
def test_string_forms_of_overrides():
    assert props("O2", keep_batchnorm_fp32="False").keep_batchnorm_fp32 is False
    assert props("O3", keep_batchnorm_fp32="True").keep_batchnorm_fp32 is True
    assert props("O2", master_weights="False").master_weights is False
    assert props("O2", half_dtype=F16, loss_scale="128.0").loss_scale == 128.0
    assert props("O2", loss_scale="dynamic").loss_scale == "dynamic"
    assert props("O2", loss_scale=512).loss_scale == 512.0
    assert isinstance(props("O2", loss_scale=512).loss_scale, float)
    assert props("O2", cast_model_type="float16").cast_model_type == F16
    assert props("O2", cast_model_type="torch.bfloat16").half_dtype == BF16


def test_string_overrides_through_initialize():
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0")
    assert model[1].weight.dtype == BF16  # batch norm cast too
    assert amp.loss_scale() == 128.0
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O3", keep_batchnorm_fp32="True")
    assert model[1].weight.dtype == F32 and model[0].weight.dtype == BF16
    assert opt.param_groups[0]["params"][0] is model[0].weight  # O3: no masters


def test_overrides_replace_level_defaults():
    p = props("O2", half_dtype=F16, keep_batchnorm_fp32=False, master_weights=False, loss_scale=8.0)
    assert (p.keep_batchnorm_fp32, p.master_weights, p.loss_scale) == (False, False, 8.0)
    p = props("O3", master_weights=True)
    assert p.master_weights is True
    p = props("O1", cast_model_type=F32)  # allowed: a no-op, as in Apex
    assert p.cast_model_type == F32 and p.master_weights is None and p.patch_torch_functions
    p = props("O2", patch_torch_functions=False)
    assert p.patch_torch_functions is False
    p = props("O0", cast_model_outputs="float16")
    assert p.cast_model_outputs == F16


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_patching_level_with_master_weights(level, value):
    # Apex refused any master_weights other than None at O1 (its warn_or_err), False included
    with pytest.raises(ValueError, match="master_weights") as err:
        props(level, master_weights=value)
    assert "O2" in str(err.value)


@pytest.mark.parametrize("half", [F16, BF16])
def test_o1_with_half_cast_model_type(half):
    with pytest.raises(ValueError, match="cast_model_type") as err:
        props("O1", cast_model_type=half)
    assert "O2" in str(err.value)


@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5"])
def test_patch_torch_functions_outside_o1_o4(level):
    with pytest.raises(ValueError, match="patch_torch_functions") as err:
        props(level, patch_torch_functions=True)
    assert "O1" in str(err.value)


@pytest.mark.parametrize("value", [True, False, "True", "False"])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_keep_batchnorm_fp32_at_a_patching_level(level, value):
    with pytest.raises(ValueError, match="keep_batchnorm_fp32"):
        props(level, keep_batchnorm_fp32=value)


def test_overrides_apex_accepted_at_o0_are_accepted():
    # Apex checked these only at O1; at O0 they are accepted and change nothing for an FP32 model
    p = props("O0", master_weights=True, keep_batchnorm_fp32="True")
    assert p.master_weights is True and p.keep_batchnorm_fp32 is True and not p.casts_model


def test_other_contradictions():
    with pytest.raises(ValueError, match="conflicts"):
        props("O2", half_dtype=F16, cast_model_type=BF16)
    with pytest.raises(ValueError, match="O0"):
        props("O2", half_dtype=F32)


@pytest.mark.parametrize("bad", ["O6", "O", "fp16", ""])
def test_unknown_level_names_the_valid_ones(bad):
    with pytest.raises(ValueError) as err:
        props(bad)
    for name in LEVELS:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        amp.initialize(bn_model(), opt_level=bad)


@pytest.mark.parametrize("bad", ["02", "05"])
def test_a_level_written_with_a_zero_says_it_is_the_letter_o(bad):
    with pytest.raises(ValueError, match=f"'O{bad[1]}': the letter O, not the digit zero"):
        props(bad)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1.0, "abc", "-2"])
def test_bad_loss_scale_values(value):
    with pytest.raises(ValueError, match="loss_scale"):
        props("O2", loss_scale=value)


@pytest.mark.parametrize("kwargs", [
    dict(opt_level=2),
    dict(opt_level=None),
    dict(keep_batchnorm_fp32=1, opt_level="O2"),
    dict(keep_batchnorm_fp32="yes", opt_level="O2"),
    dict(master_weights="true", opt_level="O2"),
    dict(patch_torch_functions=1),
    dict(loss_scale=True),
    dict(loss_scale=[1.0]),
    dict(half_dtype=16),
    dict(cast_model_type=2, opt_level="O2"),
    dict(cast_model_outputs=object()),
    dict(enabled="yes"),
    dict(enabled=1),
    dict(verbosity="1"),
    dict(allow_banned="no"),
], ids=lambda kw: ",".join(f"{k}={type(v).__name__ if type(v) is object else repr(v)}" for k, v in kw.items()))
def test_wrong_types_raise_type_error(kwargs):  # ids without object addresses: the same in every xdist worker
    model = bn_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    # nothing was done to the model and no session exists
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        amp.loss_scale()


def test_non_float_dtypes_are_value_errors():
    with pytest.raises(ValueError, match="half_dtype"):
        props("O2", half_dtype=torch.int32)
    with pytest.raises(ValueError, match="half_dtype"):
        props("O2", half_dtype="int8")


def test_wrong_model_and_optimizer_types():
    model = bn_model()
    with pytest.raises(TypeError, match="models"):
        amp.initialize("model")
    with pytest.raises(TypeError, match="models"):
        amp.initialize([model, 3])
    with pytest.raises(TypeError, match="optimizers"):
        amp.initialize(model, "adam")
    with pytest.raises(TypeError, match="optimizers"):
        amp.initialize(model, [torch.optim.SGD(model.parameters(), lr=0.1), model])
    with pytest.raises(ValueError, match="num_losses"):
        amp.initialize(model, num_losses=0)
    with pytest.raises(TypeError, match="not_a_property"):
        amp.initialize(model, not_a_property=1)


# ------------------------------------------------------------------ forced level
def _drop_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ampatch" and "dropping" in r.getMessage()]


def test_forced_level_wins(monkeypatch, caplog):
    monkeypatch.setenv("AMPATCH_OPT_LEVEL", "O2")
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="ampatch"):
        amp.initialize(model, opt, opt_level="O1")
    assert amp.report().opt_level == "O2"
    assert model[0].weight.dtype == BF16 and model[1].weight.dtype == F32
    assert opt.param_groups[0]["params"][0].dtype == F32  # masters
    assert any("AMPATCH_OPT_LEVEL" in r.getMessage() for r in caplog.records if r.name == "ampatch")


def test_forced_level_drops_conflicting_overrides_and_logs_each(monkeypatch, caplog):
    monkeypatch.setenv("AMPATCH_OPT_LEVEL", "o1")
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="ampatch"):
        amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=True, master_weights=True,
                       loss_scale=64.0)
    dropped = _drop_records(caplog)
    assert len(dropped) == 2, dropped
    assert any("keep_batchnorm_fp32" in d for d in dropped)
    assert any("master_weights" in d for d in dropped)
    assert amp.report().opt_level == "O1"
    assert amp.loss_scale() == 64.0  # a compatible override is kept
    assert model[0].weight.dtype == F32


def test_forced_bfloat16_level_drops_float16(monkeypatch, caplog):
    monkeypatch.setenv("AMPATCH_OPT_LEVEL", "O5")
    model = bn_model()
    with caplog.at_level(logging.INFO, logger="ampatch"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", half_dtype=F16)
    assert any("half_dtype" in d for d in _drop_records(caplog))
    assert model[0].weight.dtype == BF16
    assert amp.loss_scale() == 1.0


def test_forced_level_logs_even_after_a_silent_session(monkeypatch, caplog):
    # The verbosity of *this* call decides what is logged, not the previous session's.
    amp.initialize(bn_model(), opt_level="O0", verbosity=0)
    monkeypatch.setenv("AMPATCH_OPT_LEVEL", "O1")
    caplog.set_level(logging.NOTSET)  # root handler only; leave the ampatch logger's level alone
    amp.initialize(bn_model(), opt_level="O2", master_weights=True, verbosity=1)
    assert any("master_weights" in d for d in _drop_records(caplog))
    caplog.clear()
    amp.initialize(bn_model(), opt_level="O2", master_weights=True, verbosity=0)
    assert _drop_records(caplog) == []


def test_forced_level_overrides_enabled_false(monkeypatch):
    monkeypatch.setenv("AMPATCH_OPT_LEVEL", "O3")
    model = bn_model()
    amp.initialize(model, opt_level="O0", enabled=False)
    assert model[0].weight.dtype == BF16


def test_forced_level_must_be_valid(monkeypatch):
    monkeypatch.setenv("AMPATCH_OPT_LEVEL", "O7")
    with pytest.raises(ValueError, match="O0, O1, O2, O3, O4, O5"):
        amp.initialize(bn_model(), opt_level="O1")


def test_forced_half_dtype(monkeypatch):
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")
    model = bn_model()
    amp.initialize(model, opt_level="O3", half_dtype=BF16)
    assert model[0].weight.dtype == F16


# ------------------------------------------------------------------ wrapped models
def test_data_parallel_is_refused():
    model = bn_model()
    dp = nn.DataParallel(model)  # on CPU: no devices, plain pass-through; with CUDA: every GPU
    assert dp.device_ids == list(range(torch.cuda.device_count()))
    with pytest.raises(RuntimeError, match="DataParallel") as err:
        amp.initialize(dp, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
    assert "after" in str(err.value) or "then wrap" in str(err.value)
    assert model[0].weight.dtype == F32
    with pytest.raises(RuntimeError):
        amp.initialize([bn_model(), dp], opt_level="O1")
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        amp.loss_scale()


def test_distributed_data_parallel_is_refused():
    # A real DDP needs a process group; the check is by type, so an unconstructed instance will do.
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    with pytest.raises(RuntimeError, match="DistributedDataParallel"):
        amp.initialize(ddp, opt_level="O2")


# ------------------------------------------------------------------ return shapes
def test_return_shapes():
    m1, m2 = bn_model(), bn_model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    assert amp.initialize(m1, opt_level="O1") is m1
    out = amp.initialize(m1, o1, opt_level="O1")
    assert isinstance(out, tuple) and len(out) == 2 and out[0] is m1 and out[1] is o1
    out = amp.initialize([m1, m2], opt_level="O2")
    assert isinstance(out, list) and out[0] is m1 and out[1] is m2
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O2")
    assert isinstance(models, list) and isinstance(opts, list)
    assert models[0] is m1 and models[1] is m2 and opts[0] is o1 and opts[1] is o2
    model, opts = amp.initialize(m1, [o1], opt_level="O3")
    assert model is m1 and isinstance(opts, list) and opts == [o1]
    models, opt = amp.initialize([m1], o1, opt_level="O0")
    assert models == [m1] and opt is o1
    models, opts = amp.initialize((m1, m2), (o1, o2), opt_level="O1")
    assert list(models) == [m1, m2] and list(opts) == [o1, o2]
    # disabled: same shapes
    out = amp.initialize(m1, o1, opt_level="O2", enabled=False)
    assert out[0] is m1 and out[1] is o1


# ------------------------------------------------------------------ enabled=False
def _train(model, opt, steps, use_amp):
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if use_amp:
            with amp.scale_loss(loss, opt) as scaled:
                assert scaled is loss  # disabled: the very same tensor, no scaling
                scaled.backward()
        else:
            loss.backward()
        opt.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("half", [F16, BF16], ids=["fp16", "bf16"])
def test_enabled_false_is_bitwise_plain_fp32(level, half):
    ref = bn_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    matmul = torch.matmul
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, enabled=False)
    assert torch.matmul is matmul and "step" not in vars(opt) and "forward" not in vars(model)
    _train(ref, ref_opt, 5, use_amp=False)
    _train(model, opt, 5, use_amp=True)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for a, b in zip(ref_opt.state.values(), opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert math.isfinite(amp.loss_scale())  # the API works while disabled


@pytest.mark.cuda
def test_cuda_model_defaults_to_float16_with_dynamic_scaling():
    model = bn_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    assert model[0].weight.dtype == F16 and model[1].weight.dtype == F32
    assert amp.loss_scale() == 2.0 ** 16
    x, y = torch.randn(16, 4, device="cuda"), torch.randn(16, 2, device="cuda")
    loss = ((model(x) - y) ** 2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    m = next(iter(amp.master_params(opt)))
    assert m.dtype == F32 and torch.equal(m.to(F16), model[0].weight)
