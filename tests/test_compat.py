"""The Apex drop-in path (ampatch.compat): `from apex import amp` loads ampatch, unless a
real apex is importable."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ampatch
from ampatch import compat

APEX_SCRIPT = textwrap.dedent('''\
    # An unmodified Apex-era training script.
    import torch
    from apex import amp
    import apex.amp

    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x[:, 0] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale="dynamic")
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
    print(f"amp is {amp.__name__}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0], losses
''')


@pytest.fixture(autouse=True)
def _no_alias():
    compat.uninstall_apex_alias()
    yield
    compat.uninstall_apex_alias()
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        del sys.modules[name]


def _real_apex_importable() -> bool:
    return "apex" not in sys.modules and importlib.util.find_spec("apex") is not None


def test_unmodified_apex_script_trains_through_the_alias(tmp_path: Path) -> None:
    if _real_apex_importable():
        pytest.skip("a real apex is installed here")
    script = tmp_path / "train_apex.py"
    script.write_text(APEX_SCRIPT)
    bootstrap = ("import ampatch.compat as c, runpy, sys; assert c.install_apex_alias(); "
                 "runpy.run_path(sys.argv[1], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", bootstrap, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "amp is ampatch; loss" in proc.stdout


def test_install_and_uninstall_in_process() -> None:
    if _real_apex_importable():
        pytest.skip("a real apex is installed here")
    assert not compat.apex_alias_installed()
    assert compat.install_apex_alias() is True
    apex_module = sys.modules["apex"]
    assert compat.install_apex_alias() is True  # idempotent: the same alias
    assert sys.modules["apex"] is apex_module and compat.apex_alias_installed()

    from apex import amp
    import apex.amp as amp2
    from apex.amp import scale_loss
    assert amp is ampatch and amp2 is ampatch and scale_loss is ampatch.scale_loss
    assert importlib.import_module("apex.amp") is ampatch

    with pytest.raises(ModuleNotFoundError, match="DistributedDataParallel"):
        importlib.import_module("apex.parallel")
    with pytest.raises(ModuleNotFoundError, match="torch.optim"):
        from apex.optimizers import FusedAdam  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="public amp API"):
        importlib.import_module("apex.amp.scaler")  # never ampatch/scaler.py under a second name
    assert "apex.amp.scaler" not in sys.modules

    assert compat.uninstall_apex_alias() is True
    assert "apex" not in sys.modules and "apex.amp" not in sys.modules
    assert not any(isinstance(f, type(compat._finder)) for f in sys.meta_path)
    with pytest.raises(ImportError):
        importlib.import_module("apex")
    assert compat.uninstall_apex_alias() is False
    assert sys.modules["ampatch"] is ampatch  # ampatch itself untouched


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
    # Already imported (so in sys.modules) counts as real too, and uninstall leaves it alone.
    with pytest.warns(RuntimeWarning):
        assert compat.install_apex_alias() is False
    assert compat.uninstall_apex_alias() is False
    assert sys.modules["apex"] is apex


def test_legacy_names_say_what_to_use() -> None:
    with pytest.raises(AttributeError, match=r"amp\.initialize\(model, optimizer"):
        compat.legacy_attribute("init")
    with pytest.raises(AttributeError, match="amp.loss_scale"):
        compat.legacy_attribute("_amp_state")
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        compat.legacy_attribute("nonsense")


def test_ampatch_module_forwards_legacy_names() -> None:
    if "__getattr__" not in vars(ampatch):
        pytest.skip("not wired yet: ampatch/__init__.py needs `__getattr__ = compat.legacy_attribute`-style hook")
    with pytest.raises(AttributeError, match="initialize"):
        ampatch.init  # noqa: B018
    assert not hasattr(ampatch, "nonsense")
