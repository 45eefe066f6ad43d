"""Smoke tests for examples/: every recipe runs a few steps and prints a sane final line.

The examples are imported and their `main(argv)` called in-process (a subprocess per run
would cost a torch import each); the conftest fixture deinitializes around every test.
One subprocess runs checkpoint.py as a script, as the crash needs a real process.
"""
from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ampatch.o1.lists import user as user_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FINAL = re.compile(r"^final .*?(-?\d+\.\d+)", re.MULTILINE)


@pytest.fixture(autouse=True)
def _keep_registrations():
    """custom_function.py registers an op; registrations last for the process, so undo it."""
    saved = list(user_policy.REGISTERED)
    yield
    user_policy.REGISTERED[:] = saved


def load(name: str) -> ModuleType:
    module_name = f"ampatch_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def run(capsys, name: str, *argv: str) -> tuple[float, str]:
    result = load(name).main(list(argv))
    out = capsys.readouterr().out
    match = FINAL.search(out)
    assert match, f"{name} printed no 'final ...' line:\n{out}"
    assert math.isfinite(float(match.group(1))) and math.isfinite(result), out
    return result, out


CASES = [
    ("basic", "O1"), ("basic", "O2"), ("basic", "O3"), ("basic", "O5"),
    ("clipping", "O1"), ("clipping", "O2"),
    ("accumulation", "O1"), ("gradient_penalty", "O1"), ("gradient_penalty", "O2"),
    ("gan", "O1"), ("gan", "O2"), ("custom_function", "O1"), ("checkpoint", "O1"),
    ("custom_batch", "O1"), ("custom_batch", "O2"),
]


@pytest.mark.parametrize("name,level", CASES, ids=[f"{n}-{lv}" for n, lv in CASES])
def test_example_runs(capsys, name: str, level: str) -> None:
    run(capsys, name, "--steps", "3", "--opt-level", level)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_float16_loss_scaling_paths(capsys, monkeypatch, level: str) -> None:
    """float16 (dynamic loss scale) on CPU: the recipes where scaling matters."""
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")
    run(capsys, "gradient_penalty", "--steps", "2", "--opt-level", level)
    _, out = run(capsys, "gan", "--steps", "2", "--opt-level", level)
    assert "loss scales [65536, 65536, 65536]" in out
    plain, _ = run(capsys, "accumulation", "--steps", "2", "--opt-level", level)
    delayed, _ = run(capsys, "accumulation", "--steps", "2", "--opt-level", level, "--delay-unscale")
    assert delayed == pytest.approx(plain, abs=1e-3)


# The examples train on CUDA when there is one, where O1-O3's automatic half type is float16.
AUTO_HALF = torch.float16 if torch.cuda.is_available() else torch.bfloat16


def test_custom_function_dtypes(capsys) -> None:
    module = load("custom_function")
    _, out = run(capsys, "custom_function", "--steps", "1", "--opt-level", "O1")
    assert module.SEEN == {"linear_gelu": AUTO_HALF, "my_ext.rms_norm": torch.float32}, out
    run(capsys, "custom_function", "--steps", "1", "--opt-level", "O0")
    assert set(module.SEEN.values()) == {torch.float32}


def test_custom_batch_is_cast_through_its_to(capsys) -> None:
    _, out = run(capsys, "custom_batch", "--steps", "1", "--opt-level", "O2")
    assert f"tokens torch.int64, features {AUTO_HALF}; output torch.float32" in out


def test_checkpoint_crash_and_resume_is_bit_for_bit(capsys, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    crashed = subprocess.run(
        [sys.executable, str(EXAMPLES / "checkpoint.py"), "--opt-level", "O2", "--steps", "4",
         "--save", str(ckpt), "--kill-at", "2"],
        capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 1, crashed.stderr
    assert "simulated crash at step 2" in crashed.stdout
    assert "final" not in crashed.stdout
    assert torch.load(ckpt, weights_only=True)["step"] == 2

    resumed, out = run(capsys, "checkpoint", "--opt-level", "O2", "--steps", "4", "--resume", str(ckpt))
    assert "resumed from" in out
    straight, _ = run(capsys, "checkpoint", "--opt-level", "O2", "--steps", "4")
    assert resumed == straight


def test_every_example_is_tested() -> None:
    tested = {name for name, _ in CASES}
    owned_elsewhere = {"cnn", "distributed", "fsdp", "apex_main_amp", "diagnose", "tune",  # their own tests
                       "finetune_stall",  # tests/commands/test_stall_verdicts.py
                       "fp8_outliers",  # tests/commands/test_diagnose_fp8.py
                       # tests/integrations/ (need the integrations extra)
                       "lightning_mlp", "lightning_fabric", "hf_trainer"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} - owned_elsewhere <= tested
