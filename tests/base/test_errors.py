"""The error family (`ampatch/errors.py`): every refusal a caller can meet through the public
API is an `AmpatchError` and also the builtin type DESIGN.md promises ("Errors": bad
configuration a ValueError/TypeError, the wrong order a RuntimeError, a banned function a
NotImplementedError), with one message shape: "ampatch: " first, on one line."""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch import errors
from ampatch.errors import AmpatchError

PACKAGE = Path(amp.__file__).resolve().parent
BUILTINS = (ValueError, TypeError, RuntimeError, NotImplementedError, KeyError, ImportError, AttributeError)
# `raise` of a builtin error that stays so: internal checks no caller can meet
INTERNAL = {("runs/forkserver.py", "ValueError"), ("runs/forkserver.py", "RuntimeError"),
            ("runs/noise.py", "ValueError")}


@pytest.fixture(autouse=True)
def _no_session(monkeypatch: pytest.MonkeyPatch):
    for name in [n for n in os.environ if n.startswith("AMPATCH_")]:
        monkeypatch.delenv(name)
    yield
    amp.deinitialize()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _init(**kwargs) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = _model()
    return amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), verbosity=0, **kwargs)


def _scale_loss_before_initialize() -> None:
    m = _model()
    with amp.scale_loss(m(torch.randn(2, 4)).sum(), torch.optim.SGD(m.parameters(), lr=0.1)):
        pass


def _wrapped_before_initialize() -> None:
    m = _model()
    amp.initialize(nn.DataParallel(m), torch.optim.SGD(m.parameters(), lr=0.1), verbosity=0)


def _banned_function() -> None:
    _init(opt_level="O1", half_dtype=torch.bfloat16)
    p = torch.sigmoid(F.linear(torch.randn(4, 3), torch.randn(1, 3)))  # a half tensor under O1
    F.binary_cross_entropy(p, torch.ones(4, 1))


def _loss_id(loss_id: object) -> Callable[[], None]:
    def run() -> None:
        m, o = _init(opt_level="O2", half_dtype=torch.bfloat16)
        with amp.scale_loss(m(torch.randn(2, 4)).float().sum(), o, loss_id=loss_id) as loss:
            loss.backward()
    return run


def _bad_state_dict_key() -> None:
    _init(opt_level="O2", half_dtype=torch.bfloat16)
    amp.load_state_dict({"not_a_loss_scaler": {"loss_scale": 1.0, "unskipped": 0}})


def _bad_policy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format": 1, "opt_level": "O2", "no_such_key": 1}))
    monkeypatch.setenv("AMPATCH_POLICY", str(path))
    _init(opt_level="O2")


def _bad_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPATCH_OPT_LEVEL", "O9")
    _init(opt_level="O2")


def _apex_module_not_provided() -> None:
    from ampatch.compat import install_apex_alias
    install_apex_alias()
    sys.modules.pop("apex.contrib", None)
    importlib.import_module("apex.contrib")


# (what, how, the DESIGN builtin type); `how` takes (tmp_path, monkeypatch)
CASES: list[tuple[str, Callable[[Path, pytest.MonkeyPatch], None], type[BaseException]]] = [
    ("unknown opt_level", lambda t, mp: _init(opt_level="O9"), ValueError),
    ("opt_level of the wrong type", lambda t, mp: _init(opt_level=2), TypeError),
    ("bad master_weights", lambda t, mp: _init(opt_level="O2", master_weights="sometimes"), ValueError),
    ("float16 at O5", lambda t, mp: _init(opt_level="O5", half_dtype=torch.float16), ValueError),
    ("bad loss_scale", lambda t, mp: _init(opt_level="O1", loss_scale="lots"), ValueError),
    ("a flag given as another string", lambda t, mp: _init(opt_level="O2", keep_batchnorm_fp32="yes"), ValueError),
    ("verbosity of the wrong type", lambda t, mp: amp.initialize(_model(), opt_level="O1", verbosity="x"), TypeError),
    ("scale_loss before initialize", lambda t, mp: _scale_loss_before_initialize(), RuntimeError),
    ("report before initialize", lambda t, mp: amp.report(), RuntimeError),
    ("DataParallel-wrapped model before initialize", lambda t, mp: _wrapped_before_initialize(), RuntimeError),
    ("a banned function", lambda t, mp: _banned_function(), NotImplementedError),
    ("a loss_id that is not an int", lambda t, mp: _loss_id("first")(), TypeError),
    ("a loss_id out of range", lambda t, mp: _loss_id(3)(), ValueError),
    ("a bad state_dict key", lambda t, mp: _bad_state_dict_key(), KeyError),
    ("a bad policy file", _bad_policy_file, ValueError),
    ("a bad AMPATCH_* variable", lambda t, mp: _bad_flag(mp), ValueError),
    ("an Apex module ampatch does not provide", lambda t, mp: _apex_module_not_provided(), ImportError),
]


@pytest.mark.parametrize("what, how, builtin", CASES, ids=[c[0] for c in CASES])
def test_every_refusal_is_an_ampatch_error_of_the_design_type(what, how, builtin, tmp_path, monkeypatch):
    with pytest.raises(builtin) as raised:
        how(tmp_path, monkeypatch)
    check_shape(raised.value)


def check_shape(error: BaseException) -> None:
    """An ampatch error whose message starts with the prefix and is one line."""
    assert isinstance(error, AmpatchError), f"{type(error).__mro__} is not an AmpatchError: {error}"
    message = str(error)
    assert message.startswith("ampatch: ") and "ampatch: ampatch: " not in message, message
    assert "\n" not in message, message
    assert errors.reason(error) == message.removeprefix("ampatch: ")


def test_the_shape_check_can_fail():
    with pytest.raises(AssertionError, match="not an AmpatchError"):
        check_shape(ValueError("ampatch: a bare ValueError"))
    with pytest.raises(AssertionError):
        check_shape(errors.ConfigError("two\nlines"))


def test_the_prefix_is_added_once_and_survives_pickling():
    import pickle
    e = errors.ConfigError("ampatch: already prefixed")
    assert str(e) == "ampatch: already prefixed" and e.reason == "already prefixed"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.ConfigError and str(back) == str(e)
    key = errors.StateDictKeyError("bad key 'x'")
    assert str(key) == "ampatch: bad key 'x'"  # not KeyError's quoted repr
    assert str(errors.ConfigError(f"where: {errors.reason(e)}")) == "ampatch: where: already prefixed"


def strays(module: types.ModuleType) -> list[str]:
    """The classes `module` defines that are not AmpatchErrors, or that are not also one of the
    builtin types a caller may catch (AmpatchError itself aside)."""
    bad = []
    for name, cls in vars(module).items():
        if not inspect.isclass(cls) or cls.__module__ != module.__name__:
            continue
        if not issubclass(cls, AmpatchError):
            bad.append(f"{name} is not an AmpatchError")
        elif cls is not AmpatchError and not issubclass(cls, BUILTINS):
            bad.append(f"{name} is none of the builtin types {[b.__name__ for b in BUILTINS]}")
    return bad


def test_every_class_in_errors_is_an_ampatch_error_and_a_builtin_type():
    assert not strays(errors), strays(errors)
    assert set(errors.__all__) >= {n for n, c in vars(errors).items() if inspect.isclass(c)
                                   and c.__module__ == errors.__name__}


def test_the_class_scan_can_fail():
    fake = types.ModuleType("fake_errors")
    exec("from ampatch.errors import AmpatchError\n"
         "class Loose(ValueError): pass\nclass Bare(AmpatchError): pass\nclass Fine(AmpatchError, KeyError): pass\n",
         fake.__dict__)
    assert strays(fake) == ["Loose is not an AmpatchError",
                            f"Bare is none of the builtin types {[b.__name__ for b in BUILTINS]}"]


def bare_raises(root: Path) -> list[str]:
    """`raise ValueError(...)` and the like under `root`: refusals outside the family."""
    names = {b.__name__ for b in BUILTINS if b is not AttributeError}  # AttributeError: the getattr protocol
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            exc = node.exc if isinstance(node, ast.Raise) else None
            if isinstance(exc, ast.Call):
                exc = exc.func
            if isinstance(exc, ast.Name) and exc.id in names and (rel, exc.id) not in INTERNAL:
                found.append(f"{rel}:{node.lineno} raises a bare {exc.id}")
    return found


def test_the_package_raises_no_bare_builtin_error():
    assert not bare_raises(PACKAGE), "raise a type of ampatch.errors instead:\n" + "\n".join(bare_raises(PACKAGE))


def test_the_raise_scan_can_fail(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    raise ValueError('x')\n\ndef g():\n    raise KeyError\n")
    assert bare_raises(tmp_path) == ["m.py:2 raises a bare ValueError", "m.py:5 raises a bare KeyError"]
