"""The built-in workloads `ampatch compare` trains: sizes, determinism, learning, deadline."""

from __future__ import annotations

import importlib
import time

import pytest
import torch

import ampatch as amp
from ampatch import workloads
from ampatch.workloads import _common, calibrate, lstm


def module(name: str):
    return importlib.import_module(f"ampatch.workloads.{name}")


def args_for(name: str, size: str, steps: int = 3, seed: int = 0):
    return _common.parse_args(name, ["--steps", str(steps), "--size", size, "--device", "cpu",
                                     "--seed", str(seed)], steps)


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_every_workload_has_every_size_growing(name: str) -> None:
    sizes = module(name).SIZES
    assert list(sizes) == list(workloads.SIZES)
    params = []
    for size in ("tiny", "small", "large"):
        torch.manual_seed(0)
        model = module(name).build(args_for(name, size))[0]
        params.append(sum(p.numel() for p in model.parameters()))
    assert params == sorted(params) and params[0] < params[-1]
    assert len({d.describe() for d in sizes.values()}) == len(sizes)


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_the_same_seed_builds_the_same_run(name: str) -> None:
    """Nothing in a build depends on the level: every level starts from the same weights and data."""
    built = []
    for _ in range(2):
        torch.manual_seed(0)
        model, _, batches, _ = module(name).build(args_for(name, "tiny"))
        built.append(([t.clone() for t in model.state_dict().values()], batches))
    (w1, b1), (w2, b2) = built
    assert all(torch.equal(a, b) for a, b in zip(w1, w2))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(b1, b2))


@pytest.mark.slow
@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_the_loss_falls_within_thirty_steps_at_the_small_sizes(name: str, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path) -> None:
    monkeypatch.setenv("AMPATCH_REPORT", str(tmp_path / "report.json"))   # record the losses
    for size in ("tiny", "small"):
        assert module(name).main(["--steps", "30", "--size", size, "--opt-level", "O0", "--device", "cpu"]) == 0
        losses = amp.report().losses
        assert len(losses) == 30
        assert sum(losses[-5:]) / 5 < 0.8 * losses[0], (size, losses)


def test_step_kinds_name_the_dtype_each_level_runs_in() -> None:
    assert calibrate.step_kinds(["O0", "O1", "O4"], "cpu", "float16") == {"O0": "float32", "O1": "float16",
                                                                         "O4": "bfloat16"}
    assert calibrate.step_kinds(["O2"], "cpu", None) == {"O2": "bfloat16"}


def test_workload_stops_at_its_deadline_after_the_minimum_steps() -> None:
    assert lstm.main(["--steps", "50", "--deadline", str(time.time() - 1), "--opt-level", "O0",
                      "--device", "cpu", "--size", "tiny"]) == 0
    assert amp.report().steps == workloads.MIN_STEPS


@pytest.mark.parametrize("args, message", [(["--device", "tpu"], "--device: Expected one of cpu"),
                                           (["--threads", "-1"], "--threads must be 0"),
                                           (["--size", "xl"], "argument --size: invalid choice: 'xl'")])
def test_workload_bad_arguments_are_one_clear_line(capsys, args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        lstm.main(["--steps", "1", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
