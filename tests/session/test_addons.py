"""`session.addons`: what the rooms above the core register, asked by the public API and the
session without importing them (Apex's names through `frameworks.apex`, Accelerate's check
through `frameworks.hf_conventions`)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import ampatch as amp
from ampatch.session import addons


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registrations a test makes are gone after it."""
    for name in ("_module_makers", "_module_values", "_optimizer_makers"):
        monkeypatch.setattr(addons, name, dict(getattr(addons, name)))
    for name in ("_fallbacks", "_checks"):
        monkeypatch.setattr(addons, name, list(getattr(addons, name)))


def test_a_lent_module_attribute_is_made_once_on_first_use(registry: None) -> None:
    made = []
    addons.lend_module_attribute("_test_thing", lambda: made.append(1) or object())
    assert made == []
    first = amp._test_thing
    assert amp._test_thing is first and made == [1]


def test_a_name_nothing_lends_asks_the_fallbacks_and_keeps_their_hint(registry: None) -> None:
    def hint(name: str) -> object:
        raise AttributeError(f"ampatch has no {name!r}: use the other thing.")
    addons.lend_fallback(hint)
    with pytest.raises(AttributeError, match="use the other thing"):
        amp.module_nobody_lends  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute '__wrapped__'"):
        amp.__wrapped__  # noqa: B018 - dunder probes never reach the fallbacks


def test_an_optimizer_attribute_is_made_when_a_script_first_uses_it(registry: None) -> None:
    made = []
    addons.lend_optimizer_attribute("_test_value", lambda handle: made.append(handle) or 7)
    addons.lend_optimizer_attribute("_test_method", lambda handle: lambda: "called", method=True)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        assert made == []
        assert opt._test_value + 1 == 8 and len(made) == 1
        assert callable(opt._test_method) and opt._test_method() == "called"
    finally:
        amp.deinitialize()
    assert not hasattr(opt, "_test_value")


def test_a_registered_check_refuses_the_call_before_anything_changes(registry: None) -> None:
    def refuse(models: object, optimizers: object) -> None:
        raise ValueError("prepared by another library: call amp.initialize first.")
    addons.add_check(refuse)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="another library"):
        amp.initialize(model, opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float32 and amp.session.session.current() is None


def test_apex_names_work_with_nothing_imported_first() -> None:
    """`ampatch._amp_state`, `amp.init` and an Apex name's hint in a fresh process, compat
    loaded only then (by name: the API never imports it)."""
    code = textwrap.dedent("""
        import sys
        import ampatch
        print("ampatch.compat" in sys.modules)
        state = ampatch._amp_state
        print(type(state).__name__, ampatch._amp_state is state, "ampatch.compat" in sys.modules)
        try:
            ampatch.LossScaler
        except AttributeError as e:
            print("hint" if "loss_scalers" in str(e) else e)
        handle = ampatch.init(loss_scale=128.0)
        print(type(handle).__name__, handle.is_active())
        handle._deactivate()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "AmpState", "True", "True", "hint", "Handle", "True"]


def test_what_accelerate_prepared_is_refused_through_the_registered_check() -> None:
    """`frameworks.hf_conventions.check_not_accelerated`, registered on `import ampatch`,
    recognizes Accelerate's leftovers without importing accelerate."""
    model = torch.nn.Linear(4, 4)
    model._original_forward = model.forward  # what Accelerator(mixed_precision="fp16").prepare leaves
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        amp.initialize(model, opt_level="O2", verbosity=0)
    plain = torch.nn.Linear(4, 4)
    prepared = type("AcceleratedOptimizer", (torch.optim.SGD,), {"__module__": "accelerate.optimizer"})
    with pytest.raises(ValueError, match="AcceleratedOptimizer"):
        amp.initialize(plain, prepared(plain.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert plain.weight.dtype == torch.float32
