"""The Apex drop-in path: the `apex` import alias, `amp._amp_state` as a view of the
live session, Apex's old `amp.init()` handle, and `ampatch run --apex-alias`."""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _cli import ampatch_main
from torch import nn

import ampatch
import ampatch as amp
from ampatch import compat

F16, BF16 = torch.float16, torch.bfloat16
ROOT = Path(__file__).resolve().parents[2]

APEX_SCRIPT = textwrap.dedent('''\
    # An unmodified Apex-era training script.
    import torch
    from apex import amp
    import apex.amp
    from apex.amp import _amp_state

    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x[:, 0] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale="dynamic")
    _amp_state.loss_scalers[0]._loss_scale = 2**10   # NVIDIA BERT's starting-scale override
    losses = []
    for step in range(20):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
        optimizer.step()
        losses.append(loss.item())
    checkpoint = {"amp": amp.state_dict()}
    amp.load_state_dict(checkpoint["amp"])
    assert apex.amp is amp
    print(f"amp is {amp.__name__}; level {_amp_state.opt_properties.opt_level}; "
          f"scale {_amp_state.loss_scalers[0]._loss_scale:g}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0], losses
''')


def _real_apex_importable() -> bool:
    return "apex" not in sys.modules and importlib.util.find_spec("apex") is not None


@pytest.fixture(autouse=True)
def _clean():
    if _real_apex_importable():
        pytest.skip("a real apex is installed here")
    compat.uninstall_apex_alias()
    amp._amp_state.hard_override = False
    amp._amp_state.allow_incoming_model_not_fp32 = False
    yield
    compat.uninstall_apex_alias()
    amp._amp_state.hard_override = False
    amp._amp_state.allow_incoming_model_not_fp32 = False
    amp._amp_state.verbosity = 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


# ------------------------------------------------------------------ the alias
def test_unmodified_apex_script_trains_through_the_alias(tmp_path: Path) -> None:
    script = tmp_path / "train_apex.py"
    script.write_text(APEX_SCRIPT)
    bootstrap = ("import ampatch.compat as c, runpy, sys; assert c.install_apex_alias(); "
                 "runpy.run_path(sys.argv[1], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", bootstrap, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "amp is ampatch; level O1; scale 1024; loss" in proc.stdout


def test_install_and_uninstall_in_process() -> None:
    assert not compat.apex_alias_installed()
    assert compat.install_apex_alias() is True
    apex_module = sys.modules["apex"]
    assert compat.install_apex_alias() is True  # idempotent: the same alias
    assert sys.modules["apex"] is apex_module and compat.apex_alias_installed()

    import apex.amp as amp2
    from apex import amp as amp1
    from apex.amp import _amp_state, init, scale_loss
    assert amp1 is ampatch and amp2 is ampatch and scale_loss is ampatch.scale_loss
    assert _amp_state is ampatch._amp_state and init is ampatch.init
    assert importlib.import_module("apex.amp") is ampatch
    from apex.amp._amp_state import _amp_state as state2
    from apex.amp._amp_state import master_params
    assert state2 is ampatch._amp_state and master_params is ampatch.master_params

    from apex import optimizers, parallel
    from apex.parallel.LARC import LARC
    from apex.testing.common_utils import skipIfRocm  # what Apex's own tests import
    assert parallel is importlib.import_module("ampatch.compat.parallel")
    assert optimizers.FusedAdam is compat.optimizers.FusedAdam and LARC is compat.parallel.LARC.LARC
    assert callable(skipIfRocm)
    import apex.parallel.distributed
    from apex.normalization.fused_layer_norm import FusedLayerNorm
    from apex.optimizers.fused_adam import FusedAdam
    assert FusedAdam is optimizers.FusedAdam and FusedLayerNorm is compat.normalization.FusedLayerNorm
    assert apex.parallel.distributed.DistributedDataParallel is parallel.DistributedDataParallel

    assert compat.uninstall_apex_alias() is True
    assert not any(n == "apex" or n.startswith("apex.") for n in sys.modules)
    assert not any(type(f).__module__ == "ampatch.compat.alias" for f in sys.meta_path)
    with pytest.raises(ImportError):
        importlib.import_module("apex")
    assert compat.uninstall_apex_alias() is False
    assert sys.modules["ampatch"] is ampatch  # ampatch itself untouched


@pytest.mark.parametrize("statement, hint", [
    ("import apex.contrib.optimizers", "ZeroRedundancyOptimizer"),
    ("from apex import contrib", "scaled_dot_product_attention"),
    ("from apex.contrib.xentropy import SoftmaxCrossEntropyLoss", "label_smoothing"),
    ("from apex import transformer", "torch.distributed.tensor"),
    ("import apex.amp._initialize", "public API"),
    ("from apex.amp._process_optimizer import AmpOptimizerState", "public API"),
    ("import fused_layer_norm_cuda", "layer_norm"),
    ("from apex.extensions import syncbn", "amp_C and apex_C are provided"),
    ("import apex.extensions.mlp_cuda", "amp_C and apex_C are provided"),
])
def test_what_is_not_provided_fails_with_the_replacement(statement: str, hint: str) -> None:
    """An ImportError naming the replacement, also through `from X import Y` (which swallows a
    ModuleNotFoundError for the name it asked for); `except ImportError` skips, as Apex's
    tests do without amp_C."""
    assert compat.install_apex_alias()
    with pytest.raises(ImportError, match="ampatch does not provide") as err:
        exec(statement, {})
    assert hint in str(err.value)
    assert not any(n.startswith(("apex.contrib", "apex.transformer", "apex.amp._initialize",
                                 "apex.amp._process_optimizer", "fused_layer_norm_cuda", "apex.extensions.syncbn",
                                 "apex.extensions.mlp_cuda")) for n in sys.modules)


def test_extension_names_are_left_alone_without_the_alias() -> None:
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module("amp_C")
    assert "ampatch" not in str(err.value)


def test_real_apex_wins(tmp_path: Path, monkeypatch, caplog) -> None:
    package = tmp_path / "apex"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ampatch"), \
            pytest.warns(RuntimeWarning, match="real 'apex' package is importable"):
        assert compat.install_apex_alias() is False
    assert "not aliasing apex.amp" in caplog.text and str(package) in caplog.text
    assert "apex" not in sys.modules and not compat.apex_alias_installed()
    import apex
    assert apex.REAL is True
    with pytest.warns(RuntimeWarning):
        assert compat.install_apex_alias() is False
    assert compat.uninstall_apex_alias() is False
    assert sys.modules["apex"] is apex
    del sys.modules["apex"]


def test_unknown_names_stay_attribute_errors() -> None:
    assert not hasattr(ampatch, "nonsense")
    with pytest.raises(AttributeError, match="amp._amp_state.loss_scalers"):
        ampatch.loss_scalers  # noqa: B018 - an Apex attribute of _amp_state, asked of amp
    assert compat.install_apex_alias()
    import apex
    assert not hasattr(apex, "contrib")
    with pytest.raises(AttributeError, match="ampatch does not provide 'apex.contrib'"):
        apex.contrib  # noqa: B018


# ------------------------------------------------------------------ _amp_state
def test_amp_state_before_initialize_is_empty() -> None:
    state = amp._amp_state
    assert state.loss_scalers == []
    assert not hasattr(state, "opt_properties")  # as in Apex, it appears with initialize
    assert state.handle.is_active() is False
    state.handle._deactivate()  # a no-op
    assert state.hard_override is False and state.allow_incoming_model_not_fp32 is False


@pytest.mark.parametrize("half", [F16, BF16], ids=["fp16", "bf16"])
def test_loss_scaler_view_reads_and_writes_the_live_scaler(half) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, loss_scale="dynamic",
                                num_losses=2, min_loss_scale=2.0, verbosity=0)
    views = amp._amp_state.loss_scalers
    assert len(views) == 2 and views[0].dynamic is True
    assert views[0].loss_scale() == views[0]._loss_scale == amp.loss_scale(0) == 2.0 ** 16
    assert (views[0]._min_loss_scale, views[0]._max_loss_scale) == (2.0, 2.0 ** 24)

    views[0]._loss_scale = 2 ** 10  # what NVIDIA's BERT scripts do
    views[1]._loss_scale = 16.0
    assert amp.loss_scale(0) == 1024.0 and amp.loss_scale(1) == 16.0
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 0}
    x = torch.randn(4, 8)
    with amp.scale_loss(model(x).sum(), opt) as scaled:
        assert scaled.item() == pytest.approx(1024.0 * model(x).sum().item(), rel=1e-2)
        scaled.backward()
    opt.step()
    assert views[0]._unskipped == 1 and views[0]._has_overflow is False

    with amp.scale_loss(model(x).sum() * float("inf"), opt) as scaled:  # an overflow halves the scale
        scaled.backward()
    assert views[0]._has_overflow is True and views[0]._loss_scale == 512.0 and views[0]._unskipped == 0
    views[0]._unskipped = 7
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 512.0, "unskipped": 7}


def test_a_loss_scale_write_that_does_not_take_says_so() -> None:
    """A static scale stays, a dynamic one is clamped into its range (as amp.load_state_dict
    does): either way the write is not silently dropped."""
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), opt_level="O1", loss_scale=128.0)
    view = amp._amp_state.loss_scalers[0]
    with pytest.warns(UserWarning, match=r"_loss_scale = 1024 .*static \(128"):
        view._loss_scale = 1024
    assert view.loss_scale() == 128.0
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), opt_level="O1", loss_scale="dynamic",
                   max_loss_scale=2.0 ** 20)
    view = amp._amp_state.loss_scalers[0]
    with pytest.warns(UserWarning, match=r"outside .*it is now 1.04858e\+06"):
        view._loss_scale = 2 ** 30
    assert view.loss_scale() == 2.0 ** 20


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-4.0, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), ("big", ValueError), (True, TypeError)])
def test_loss_scale_writes_are_validated_like_load_state_dict(bad, error) -> None:
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), opt_level="O1", verbosity=0)
    view = amp._amp_state.loss_scalers[0]
    before = view._loss_scale
    with pytest.raises(error):
        view._loss_scale = bad
    assert view._loss_scale == before == amp.loss_scale()
    with pytest.raises(AttributeError, match="cannot be set"):
        view.dynamic = False
    with pytest.raises(TypeError):
        view._unskipped = -1.5


def test_the_view_keeps_no_copy() -> None:
    """A view taken before a new initialize reads the new session, not a stale copy."""
    state = amp._amp_state
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), opt_level="O1",
                   half_dtype=F16, loss_scale=128.0, verbosity=0)
    assert state.loss_scalers[0].loss_scale() == 128.0 and state.loss_scalers[0].dynamic is False
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), opt_level="O2",
                   half_dtype=F16, verbosity=0)
    assert state.loss_scalers[0].loss_scale() == 2.0 ** 16 and state.opt_properties.opt_level == "O2"
    amp.deinitialize()
    assert state.loss_scalers == []


def test_a_loss_scaler_view_held_past_its_session_refuses() -> None:
    """A scaler view kept across a new initialize would read and write a scaler nothing uses
    any more; it says so instead."""
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), opt_level="O1", half_dtype=F16,
                   verbosity=0)
    held = amp._amp_state.loss_scalers[0]
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), opt_level="O1", half_dtype=F16,
                   verbosity=0)
    with pytest.raises(RuntimeError, match="session has ended"):
        held._loss_scale = 8.0
    with pytest.raises(RuntimeError, match="session has ended"):
        held.loss_scale()
    amp._amp_state.loss_scalers[0]._loss_scale = 8.0
    assert amp.loss_scale() == 8.0


@pytest.mark.parametrize("level, half, expected", [
    ("O0", F16, dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
                     master_weights=False, loss_scale=1.0)),
    ("O1", F16, dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
                     master_weights=None, loss_scale="dynamic")),
    ("O2", F16, dict(cast_model_type=F16, patch_torch_functions=False, keep_batchnorm_fp32=True,
                     master_weights=True, loss_scale="dynamic")),
    ("O3", F16, dict(cast_model_type=F16, patch_torch_functions=False, keep_batchnorm_fp32=False,
                     master_weights=False, loss_scale=1.0)),
    ("O2", BF16, dict(cast_model_type=BF16, patch_torch_functions=False, keep_batchnorm_fp32=True,
                      master_weights=True, loss_scale=1.0)),
])
def test_opt_properties_have_apex_names_and_values(level, half, expected) -> None:
    amp.initialize(_model(), opt_level=level, half_dtype=half, verbosity=0)
    props = amp._amp_state.opt_properties
    assert props.options == dict(enabled=True, opt_level=level, **expected)
    assert props.loss_scale == expected["loss_scale"] and props.enabled is True
    with pytest.raises(AttributeError, match="amp.initialize"):
        props.loss_scale = 4.0


def test_handle_deactivates_the_live_session_only() -> None:
    model = _model()
    amp.initialize(model, opt_level="O1", verbosity=0)
    old = amp._amp_state.handle
    assert old.is_active()
    amp.initialize(_model(), opt_level="O2", verbosity=0)
    assert not old.is_active()
    old._deactivate()  # the ended session's handle does nothing to the new one
    assert amp._amp_state.opt_properties.opt_level == "O2"
    amp._amp_state.handle._deactivate()
    assert amp._amp_state.loss_scalers == []
    with pytest.raises(RuntimeError, match="session has ended"):
        old.scale_loss(torch.ones(()), torch.optim.SGD(model.parameters(), lr=0.1))


def test_flags_are_plain_settable_flags() -> None:
    state = amp._amp_state
    state.hard_override = True
    state.allow_incoming_model_not_fp32 = True
    assert state.hard_override and state.allow_incoming_model_not_fp32
    with pytest.raises(TypeError):
        state.hard_override = "yes"
    with pytest.raises(AttributeError, match="settable flags"):
        state.loss_scalers = []
    state.verbosity = 0
    amp.initialize(_model(), opt_level="O1", verbosity=2)
    assert state.verbosity == 2  # initialize's verbosity, as in Apex
    assert logging.getLogger("ampatch").level == logging.DEBUG
    state.verbosity = 0
    assert amp._amp_state.session().verbosity == 0
    assert logging.getLogger("ampatch").level == logging.ERROR  # silenced, as initialize(verbosity=0) does


# ------------------------------------------------------------------ amp.init
@pytest.mark.parametrize("patch_type, dtype, level", [(F16, F16, "O1"), (BF16, BF16, "O4")],
                         ids=["fp16", "bf16"])
def test_init_patches_torch_and_returns_a_handle(patch_type, dtype, level) -> None:
    original_mm = torch.mm
    handle = amp.init(patch_type=patch_type)
    assert handle.is_active() and amp._amp_state.opt_properties.opt_level == level
    assert amp._amp_state.loss_scalers[0].dynamic  # amp.init's loss_scale="dynamic"
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    assert torch.mm(x, w).dtype == dtype
    with handle.disable_casts():
        assert torch.mm(x, w).dtype == torch.float32
    handle._deactivate()
    assert torch.mm is original_mm and not handle.is_active()


def test_init_disabled_is_a_no_op_handle() -> None:
    handle = amp.init(enabled=False)
    assert not handle.is_active() and amp._amp_state.loss_scalers == []
    loss = torch.ones((), requires_grad=True)
    with handle.scale_loss(loss, torch.optim.SGD([loss], lr=0.1)) as scaled:
        assert scaled is loss
    handle._deactivate()


@pytest.mark.parametrize("half", [F16, BF16], ids=["fp16", "bf16"])
def test_init_handle_scale_loss_unscales_and_skips_on_overflow(half) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = amp.init(loss_scale=64.0, patch_type=half)
    x = torch.randn(4, 8)
    with handle.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    ref = _model()
    ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):  # unscaled (half matmuls: loose)
        torch.testing.assert_close(p.grad, r.grad, rtol=0.05, atol=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))

    opt.zero_grad()
    with handle.scale_loss(model(x).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # skipped: a static scale, checked for overflow
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    handle._deactivate()


def test_init_wrap_optimizer_uses_one_scaler_per_loss() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = amp.init(patch_type=F16)
    wrapped = handle.wrap_optimizer(opt, num_loss=2)
    assert wrapped.param_groups is opt.param_groups  # forwards the rest
    x = torch.randn(4, 8)
    for _ in range(2):
        wrapped.zero_grad()
        with wrapped.scale_loss(model(x).float().mean()) as scaled:
            scaled.backward()
        with wrapped.scale_loss(model(x).float().mean() * float("inf")) as scaled:  # loss 2 overflows
            scaled.backward()
        before = [p.detach().clone() for p in model.parameters()]
        wrapped.step()
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
    assert scales == [2.0 ** 16, 2.0 ** 14]  # the second scaler halved twice, the first never
    with wrapped.scale_loss(model(x).float().mean()) as scaled:
        scaled.backward()
    with wrapped.scale_loss(model(x).float().mean()) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="num_loss=3"):
        wrapped.scale_loss(model(x).float().mean())
    handle._deactivate()


def test_init_arguments() -> None:
    with pytest.raises(TypeError, match="enabled"):
        amp.init(enabled="yes")
    with pytest.raises(ValueError, match="not a half type"):
        amp.init(patch_type=torch.float32)
    handle = amp.init(enable_caching=False, verbose=True, allow_banned=True)
    assert handle.verbose and amp._amp_state.session().options.allow_banned
    handle._deactivate()


# ------------------------------------------------------------------ ampatch run --apex-alias
PROBE = textwrap.dedent('''\
    import sys
    from apex import amp
    from apex.amp import _amp_state
    import torch
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0)
    import os
    open(sys.argv[1], "w").write(
        f"{_amp_state.opt_properties.opt_level} {model.weight.dtype} {os.environ.get('SHADOWED_RAN')}")
''')


@pytest.mark.parametrize("forced, shadow, expected", [(None, True, "O3 torch.bfloat16 yes"),
                                                     ("O1", False, "O1 torch.float32 None")])
def test_run_apex_alias_keeps_or_forces_the_level(tmp_path: Path, forced, shadow, expected,
                                                  capfd: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --opt-level the script's own level; with it, the forced one. The alias's
    sitecustomize completes its own import, and runs the sitecustomize it shadows if any."""
    script, seen = tmp_path / "probe.py", tmp_path / "seen.txt"
    script.write_text(PROBE)
    path: str | None = None
    if shadow:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = 'yes'\n")
        path = str(tmp_path / "site")
    args = ["run", "--apex-alias"] + (["--opt-level", forced] if forced else []) + ["--", "python", str(script),
                                                                                   str(seen)]
    # the command through cli.main in this process (tests/_cli.py; no AMPATCH_*), the script its child process
    proc = ampatch_main(capfd, monkeypatch, *args, cwd=tmp_path, env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr
    assert "Error in sitecustomize" not in proc.stderr
    assert seen.read_text() == expected


def test_readme_commands_run_as_shown(tmp_path: Path, capfd: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The "Coming from Apex" commands (docs/apex.md, and the one the README shows), and the
    CLI's usage line, agree."""
    apex = (ROOT / "docs" / "apex.md").read_text()
    section = apex[apex.index("# Coming from Apex"):]
    section = section[:section.index("\n## ", 3)]
    readme = (ROOT / "README.md").read_text()
    readme_section = readme[readme.index("## Coming from Apex"):]
    end = readme_section.find("\n## ", 3)
    readme_section = readme_section[:end if end > 0 else None]
    command = "ampatch run --apex-alias -- python examples/apex_main_amp.py --steps 3"
    assert command in section and command in readme_section
    assert "ampatch run --apex-alias --opt-level O1 -- python" in section
    from ampatch import cli
    usage = cli.build_parser()._subparsers._group_actions[0].choices["run"].format_usage()
    assert "[--opt-level LEVEL]" in usage and "[--apex-alias]" in usage
    report = tmp_path / "r.json"
    proc = ampatch_main(capfd, monkeypatch, *command.split()[1:3], "--report", str(report), "--",
                        *command.split()[4:], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "final loss" in proc.stdout
    assert json.loads(report.read_text())["opt_level"] == "O2"


@pytest.mark.parametrize("level", ["O4", "O5"])
def test_run_refuses_float16_at_a_bfloat16_level(level, capsys) -> None:
    """`ampatch run --opt-level O4/O5 --half-dtype float16` is a contradiction, refused before
    anything runs (the script would fail loudly if it ran)."""
    from ampatch import cli
    code = cli.main(["run", "--apex-alias", "--opt-level", level, "--half-dtype", "float16", "--",
                     "python", "-c", "raise SystemExit(7)"])
    assert code == 2
    assert f"{level} is the bfloat16 variant of" in capsys.readouterr().err
