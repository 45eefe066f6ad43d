"""The ``ampatch`` command: compare, run, failed rows, argument errors.

Most tests run ``python -m ampatch`` in a subprocess, as a user would; the table and plot
helpers are also checked in-process on hand-made reports, which needs no torch in children.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ampatch import cli

ROOT = Path(__file__).resolve().parents[1]

AMP_SCRIPT = textwrap.dedent("""\
    import os, sys
    import torch
    import ampatch as amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen)
    for step in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step == 2 and os.environ.get("AMPATCH_OPT_LEVEL") == "O2":
            raise RuntimeError("boom at O2")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(amp.report().to_dict()["opt_level"])
""")

FAKE_REPORT_SCRIPT = textwrap.dedent("""\
    # Writes a report like ampatch's without importing torch: fast children for CLI tests.
    import json, math, os
    level = os.environ["AMPATCH_OPT_LEVEL"]
    losses = [2 * math.exp(-i / 4) + (0.0 if level == "O0" else 0.01) for i in range(10)]
    report = {"opt_level": level, "half_dtype": "bfloat16", "enabled": True, "casts": {},
              "cache": {"hits": 0, "misses": 0}, "steps": 10, "skipped_steps": [],
              "loss_scale": {"loss_scaler0": 1.0},
              "loss_scale_history": {"loss_scaler0": [[0, 1.0]]},
              "time_s": {"wrappers": 0.0, "scale_loss": 0.0},
              "step_times_s": [0.02 if level == "O0" else 0.01] * 9, "losses": losses,
              "peak_memory_bytes": 100 * 2**20}
    with open(os.environ["AMPATCH_REPORT"], "w") as f:
        json.dump(report, f)
""")


def ampatch(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m ampatch ARGS`` with this checkout importable and no inherited AMPATCH_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "ampatch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.slow
def test_compare_default_workload(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = ampatch("compare", "--levels", "O0,O4,O5", "--steps", "4", "--json", str(out),
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["workload"] == "lm" and data["steps"] == 4
    assert [r["level"] for r in data["rows"]] == ["O0", "O4", "O5"]
    for row in data["rows"]:
        assert row["ok"] and row["error"] is None
        assert row["report"]["opt_level"] == row["level"]
        assert row["report"]["steps"] == 4 and len(row["losses"]) == 4
        assert row["median_step_ms"] > 0 and row["peak_memory_mib"] > 0
        assert math.isfinite(row["final_loss"]) and math.isfinite(row["max_loss_dev_vs_O0"])
        assert row["skipped_steps"] == [] and row["final_loss_scale"] == 1.0
        assert "loss_scaler0" in row["loss_scale_history"]
    o0, o4, _ = data["rows"]
    assert o0["half_dtype"] is None and o4["half_dtype"] == "bfloat16"
    assert o0["speedup_vs_O0"] == 1.0 and o0["max_loss_dev_vs_O0"] == 0.0
    assert o4["max_loss_dev_vs_O0"] < 0.5          # bfloat16 follows the fp32 curve
    table = proc.stdout.splitlines()
    assert any(line.startswith("level") for line in table)
    assert sum(line.split()[:1] in (["O0"], ["O4"], ["O5"]) for line in table) == 3
    assert proc.stderr.count("running") == 3 and "[3/3] O5 ok" in proc.stderr


@pytest.mark.slow
def test_compare_user_script_with_a_failing_level(tmp_path: Path) -> None:
    script = write(tmp_path / "train.py", AMP_SCRIPT)
    out, png = tmp_path / "out.json", tmp_path / "curves.png"
    proc = ampatch("compare", "--levels", "O0,O2,O4", "--json", str(out), "--plot", str(png),
                   "--", "python", str(script), cwd=tmp_path)
    assert proc.returncode == 1
    rows = {r["level"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["O0", "O2", "O4"]
    assert not rows["O2"]["ok"] and rows["O2"]["error"] == "RuntimeError: boom at O2"
    assert rows["O0"]["ok"] and rows["O4"]["ok"]
    assert len(rows["O0"]["losses"]) == len(rows["O4"]["losses"]) == 5
    assert "O2     FAILED: RuntimeError: boom at O2" in proc.stdout
    assert "Traceback" not in proc.stdout
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_run_forces_the_level_and_passes_the_exit_code(tmp_path: Path) -> None:
    script = write(tmp_path / "train.py", AMP_SCRIPT)
    seen, report = tmp_path / "seen.txt", tmp_path / "report.json"
    proc = ampatch("run", "--opt-level", "O3", "--report", str(report), "--",
                   "python", str(script), str(seen), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text() == "O3"                       # the script asked for O1
    assert json.loads(report.read_text())["opt_level"] == "O3"
    failing = ampatch("run", "--opt-level", "O2", "--", "python", str(script), cwd=tmp_path)
    assert failing.returncode == 1 and "boom at O2" in failing.stderr


def test_apex_alias(tmp_path: Path) -> None:
    script = write(tmp_path / "apex_train.py",
                   "from apex import amp\nassert callable(amp.initialize)\n")
    proc = ampatch("run", "--opt-level", "O1", "--apex-alias", "--", "python", str(script),
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_a_script_without_initialize_is_a_failed_row(tmp_path: Path) -> None:
    script = write(tmp_path / "plain.py", "print('no amp here')\n")
    proc = ampatch("compare", "--levels", "O1", "--", "python", str(script), cwd=tmp_path)
    assert proc.returncode == 1
    assert "FAILED: script never called amp.initialize" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["compare", "--levels", "O0,O9"], "unknown opt level 'O9'"),
    (["compare", "--steps", "0"], "positive integer"),
    (["run", "--opt-level", "O2"], "missing command after '--'"),
    (["compare", "--", "python", "does_not_exist.py"], "script not found"),
    (["run", "--opt-level", "O1", "--", "python", "does_not_exist.py"], "script not found"),
    (["compare", "--budget", "soon"], "expected a time"),
    (["compare", "--budget", "60", "--", "python", "x.py"], "--budget apply to the built-in workloads"),
    (["compare", "--device", "cpu", "--", "python", "x.py"], "--device apply to the built-in workloads"),
    (["compare", "--threads", "2", "--", "python", "x.py"], "--threads apply to the built-in workloads"),
    (["compare", "--threads", "-1"], "--threads must be"),
    (["compare", "--device", "tpu"], "--device: Expected one of cpu"),
    pytest.param(["compare", "--device", "cuda"], "--device cuda: ",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path: Path, args: list[str],
                                            message: str) -> None:
    proc = ampatch(*args, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("ampatch: error:") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_table_without_matplotlib_still_prints_then_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    script = write(tmp_path / "fake.py", FAKE_REPORT_SCRIPT)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # import now fails
    code = cli.main(["compare", "--levels", "O0,O1", "--plot", str(tmp_path / "p.png"),
                     "--", sys.executable, str(script)])
    out, err = capsys.readouterr()
    assert code == 1 and not (tmp_path / "p.png").exists()
    assert "pip install matplotlib" in err
    o1 = next(line for line in out.splitlines() if line.startswith("O1")).split()
    assert o1[3] == "2.00x" and o1[6] == "0.01"     # speed-up and max deviation from O0


def test_summary_of_hand_made_reports() -> None:
    base = {"opt_level": "O0", "losses": [3.0, 2.0, 1.0], "step_times_s": [0.5, 0.2, 0.2, 0.2, 0.2],
            "peak_memory_bytes": 2**30, "loss_scale": {"loss_scaler0": 1.0}}
    half = dict(base, opt_level="O1", losses=[3.0, 2.5, float("nan")],
                step_times_s=[0.5, 0.1, 0.1, 0.1, 0.1], skipped_steps=[1],
                loss_scale={"loss_scaler0": 32768.0})
    rows = cli.summarize_all([{"level": "O0", "ok": True, "report": base},
                              {"level": "O1", "ok": True, "report": half},
                              {"level": "O2", "ok": False, "error": "boom", "report": None}])
    o0, o1, _ = rows
    assert o0["median_step_ms"] == pytest.approx(200) and o1["speedup_vs_O0"] == pytest.approx(2)
    assert o0["peak_memory_mib"] == 1024 and o0["final_loss"] == pytest.approx(2.0)
    assert o1["max_loss_dev_vs_O0"] == math.inf           # a NaN loss is an infinite deviation
    table = cli.format_table(rows, "title")
    assert "O2     FAILED: boom" in table and "32768" in table and "mean of the last" in table


def test_report_at_exit_is_the_last_session(tmp_path: Path) -> None:
    """A script that initializes twice reports its last session, not the first one."""
    script = write(tmp_path / "twice.py", textwrap.dedent("""
        import torch, ampatch as amp
        m = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), 0.1)
        amp.initialize(m, opt, opt_level="O1", verbosity=0)
        m, opt = amp.initialize(m, opt, opt_level="O1", verbosity=0)
        for _ in range(3):
            with amp.scale_loss(m(torch.ones(1, 2)).float().sum(), opt) as s:
                s.backward()
            opt.step()
    """))
    report = tmp_path / "report.json"
    env = {**os.environ, "AMPATCH_REPORT": str(report)}
    env.pop("AMPATCH_OPT_LEVEL", None)
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=120, cwd=tmp_path)
    assert json.loads(report.read_text())["steps"] == 3


# ----------------------------------------------------------------------------- budget, progress, Ctrl-C

def test_budget_values() -> None:
    assert cli._budget("120") == 120 and cli._budget("90s") == 90 and cli._budget("2m") == 120
    assert cli._budget("1.5min") == 90 and cli._budget("none") is None and cli._budget("0") is None
    for bad in ("-5", "soon", "5h"):
        with pytest.raises(Exception, match="expected a time"):
            cli._budget(bad)


def test_budget_shares_the_time_left_and_caps_steps() -> None:
    now = [1000.0]
    levels = ["O0", "O1", "O2", "O3", "O4", "O5"]
    budget = cli.Budget(120, 150, clock=lambda: now[0])         # start-up 4 s and exit 1 s assumed
    assert budget.next_run(levels, []) == (150, 1000 + 5 + 90 / 6 - 1)   # equal weights: equal shares
    now[0] = 1010.0                                                # the first level ended early
    budget.ran(3.0, 2.5)                                           # it started faster, exited slower
    assert budget.next_run(levels[1:], [88]) == (88, 1010 + 5.5 + (110 - 5 * 5.5) / 5 - 2.5)
    budget.ran(None, 0.5)                                          # the slowest exit seen counts
    now[0] = 1200.0                                                # over budget: start-up and exit only
    assert budget.next_run(levels[5:], [88, 40]) == (40, 1200 + 3.0)

    weighted = cli.Budget(120, 150, weights={lv: 3.0 for lv in levels[1:]}, clock=lambda: 1000.0)
    cap, deadline = weighted.next_run(levels, [])                  # O0's steps are 3x cheaper
    assert deadline == 1000 + 5 + 90 * 1 / 16 - 1
    assert weighted.next_run(levels[1:], [])[1] == 1000 + 5 + (120 - 25) * 3 / 15 - 1


def test_step_weights_follow_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampatch import hardware
    info = hardware.describe("cpu")
    slow = dataclasses_replace(info, native={"bfloat16": False, "float16": False})
    monkeypatch.setattr(hardware, "describe", lambda device: slow)
    assert cli._step_weights("cpu", ["O0", "O1", "O5"], None) == {"O1": cli.SLOW_HALF_WEIGHT,
                                                                   "O5": cli.SLOW_HALF_WEIGHT}
    fast = dataclasses_replace(info, native={"bfloat16": True, "float16": False})
    monkeypatch.setattr(hardware, "describe", lambda device: fast)
    assert cli._step_weights("cpu", ["O0", "O2", "O4"], None) == {"O2": 1.0, "O4": 1.0}
    assert cli._step_weights("cpu", ["O2", "O4"], "float16") == {"O2": cli.SLOW_HALF_WEIGHT, "O4": 1.0}


def dataclasses_replace(obj, **changes):
    import dataclasses
    return dataclasses.replace(obj, **changes)


def test_workload_stops_at_its_deadline_after_the_minimum_steps() -> None:
    import time

    import ampatch as amp
    from ampatch.workloads import _common, lstm
    assert lstm.main(["--steps", "50", "--deadline", str(time.time() - 1), "--opt-level", "O0",
                      "--device", "cpu"]) == 0
    assert amp.report().steps == _common.MIN_STEPS


@pytest.mark.parametrize("args, message", [(["--device", "tpu"], "--device: Expected one of cpu"),
                                           (["--threads", "-1"], "--threads must be 0")])
def test_workload_bad_arguments_are_one_clear_line(capsys, args: list[str], message: str) -> None:
    from ampatch.workloads import lstm
    with pytest.raises(SystemExit) as exc:
        lstm.main(["--steps", "1", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_progress_line() -> None:
    import io
    stream = io.StringIO()
    p = cli.Progress("O2", total=20, stream=stream, log_every_s=0)
    p.render(force=True)
    assert "O2" in stream.getvalue() and "0/20" in stream.getvalue() and "elapsed" in stream.getvalue()
    for step in range(1, 11):
        p.update(step, 3.0 / step)
    p.seen[0] = (p.seen[-1][0] - 9 * 0.5, 1)  # ten steps, 0.5 s apart
    line = p.line()
    assert "[==========>" in line and "10/20" in line and "loss 0.3000" in line
    assert "0.50 s/step" in line and "ETA 0:05" in line
    unknown = cli.Progress("O1", stream=stream)
    unknown.update(7, 1.25)
    assert "step 7" in unknown.line() and "loss 1.2500" in unknown.line()
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    live = cli.Progress("O3", total=5, stream=tty)
    live.render(force=True)
    live.close()
    assert tty.getvalue().startswith("\r  O3") and tty.getvalue().endswith("\r\x1b[K")


PROGRESS_SCRIPT = textwrap.dedent("""\
    import json, os, time
    for i in range(1, 6):
        with open(os.environ["AMPATCH_PROGRESS"], "a") as f:
            f.write(f"{i} {2.0 / i}\\n")
        time.sleep(0.15)
    with open(os.environ["AMPATCH_REPORT"], "w") as f:
        json.dump({"opt_level": os.environ["AMPATCH_OPT_LEVEL"], "steps": 5, "losses": [1.0] * 5}, f)
""")


def test_run_level_shows_the_steps_of_the_run(tmp_path: Path) -> None:
    import io
    script = write(tmp_path / "steps.py", PROGRESS_SCRIPT)
    stream = io.StringIO()
    progress = cli.Progress("O1", total=5, stream=stream, log_every_s=0)
    row = cli.run_level([sys.executable, str(script)], "O1", None, progress)
    assert row["ok"], row["error"]
    shown = stream.getvalue()
    assert "/5" in shown and "loss" in shown and progress.step == 5 and progress.loss == 0.4


def test_summary_compares_levels_at_the_steps_all_of_them_ran() -> None:
    base = {"opt_level": "O0", "steps": 6, "losses": [6.0, 5.0, 4.0, 3.0, 2.0, 1.0],
            "step_times_s": [0.1] * 5}
    half = dict(base, opt_level="O5", steps=3, losses=[6.0, 5.5, 4.5])
    rows = [{"level": "O0", "ok": True, "report": base}, {"level": "O5", "ok": True, "report": half}]
    assert cli.common_steps(rows) == 3
    o0, o5 = cli.summarize_all(rows, upto=3)
    assert o0["final_loss"] == pytest.approx(5.0) and o5["final_loss"] == pytest.approx(16 / 3)
    assert o5["max_loss_dev_vs_O0"] == pytest.approx(0.5)
    assert (o0["steps"], o5["steps"]) == (6, 3) and len(o0["losses"]) == 6   # the curves stay whole
    assert cli.format_table(rows, "t").splitlines()[1].split()[-1] == "steps"


def test_losses_compare_at_the_same_step_when_one_curve_was_thinned() -> None:
    """A long run's report keeps every other loss once its curve is full (losses_every=2):
    its losses[i] is step 2i, compared with the other run's loss at step 2i, not at step i."""
    base = {"opt_level": "O0", "steps": 7, "losses": [10.0, 8.0, 6.0, 4.0], "losses_every": 2}
    half = {"opt_level": "O1", "steps": 7, "losses": [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0]}
    rows = [{"level": "O0", "ok": True, "report": base}, {"level": "O1", "ok": True, "report": half}]
    assert cli.common_steps(rows) == 7
    o0, o1 = cli.summarize_all(rows, upto=cli.common_steps(rows))
    assert o1["max_loss_dev_vs_O0"] == 0            # same curve, compared at steps 0, 2, 4, 6
    assert o0["final_loss"] == pytest.approx(7.0) and o1["final_loss"] == pytest.approx(6.0)
    o0, o1 = cli.summarize_all(rows, upto=5)          # steps 0-4 only
    assert o1["final_loss"] == pytest.approx(8.0) and o0["final_loss"] == pytest.approx(8.0)


def test_table_says_which_machine_and_when_half_is_emulated() -> None:
    device = {"type": "cpu", "name": "Old CPU", "cores": 2, "features": ["avx2"], "lacks": ["avx512_bf16"],
              "native": {"bfloat16": False, "float16": False}, "basis": {"bfloat16": "no AVX512-BF16 or AMX"},
              "torch": "2.13.0+cpu"}
    rep = {"opt_level": "O4", "half_dtype": "bfloat16", "losses": [1.0], "device": device}
    rows = cli.summarize_all([{"level": "O0", "ok": True, "report": dict(rep, opt_level="O0")},
                              {"level": "O4", "ok": True, "report": rep}])
    machine, note = cli.machine_of(rows)
    assert machine.startswith("cpu: Old CPU, 2 cores") and "torch 2.13.0+cpu" in machine
    assert "bfloat16 not native" in machine and note.startswith("note: bfloat16 is emulated")
    table = cli.format_table(rows, "title", machine, [note])
    lines = table.splitlines()
    assert lines[1] == f"machine: {machine}" and lines[2].startswith("level")
    assert "note: bfloat16 is emulated" in table
    native = dict(device, native={"bfloat16": True, "float16": True})
    rows[1]["report"]["device"] = rows[0]["report"]["device"] = native
    assert cli.machine_of(rows)[1] is None


@pytest.mark.slow
def test_compare_within_a_budget(tmp_path: Path) -> None:
    from ampatch import hardware
    out = tmp_path / "out.json"
    proc = ampatch("compare", "--levels", "O0,O5", "--budget", "14s", "--device", "cpu",
                   "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["budget_s"] == 14 and data["steps"] == 150 and data["interrupted"] is False
    o0, o5 = data["rows"]
    assert 3 <= o5["steps"] <= o0["steps"] <= 150        # later levels never run more steps
    assert data["compared_steps"] == min(len(o0["losses"]), len(o5["losses"])) == o5["steps"]
    assert "in a 14s budget" in proc.stdout and f"compared over the first {o5['steps']} steps" in proc.stdout
    assert "(cpu, 1 torch thread)" in proc.stdout and data["threads"] == 1
    assert ("left time for only" in proc.stdout) is (o5["steps"] < cli.FEW_STEPS)
    native = hardware.describe("cpu").native["bfloat16"]
    assert o5["report"]["device"]["half_native"] is native
    assert "machine: cpu: " in proc.stdout and ("bfloat16 not native" in proc.stdout) is (not native)
    assert ("note: bfloat16 is emulated" in proc.stdout) is (not native)
    assert proc.stderr.startswith("machine: cpu: ") and "[2/2] O5 ok" in proc.stderr


SLOW_SCRIPT = textwrap.dedent("""\
    import json, os, sys, time
    level = os.environ["AMPATCH_OPT_LEVEL"]
    with open(sys.argv[1], "a") as f:
        f.write(f"{level} {os.getpid()}\\n")
    if level != "O0":
        time.sleep(600)  # a long run, interrupted
    with open(os.environ["AMPATCH_REPORT"], "w") as f:
        json.dump({"opt_level": level, "steps": 3, "losses": [1.0, 0.5, 0.25]}, f)
""")


def test_ctrl_c_prints_the_levels_that_finished(tmp_path: Path) -> None:
    """A real SIGINT to the command (not to its runs): it stops the running level, prints
    the table of the finished ones and exits 130."""
    import signal
    script, pids = write(tmp_path / "slow.py", SLOW_SCRIPT), tmp_path / "pids.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "ampatch", "compare", "--levels", "O0,O1,O2", "--",
                             "python", str(script), str(pids)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = []
        for line in proc.stderr:  # wait until O1 runs (and has started its script)
            seen.append(line)
            if line.startswith("[2/3] O1 running"):
                break
        for _ in range(200):
            if "O1" in (pids.read_text() if pids.exists() else ""):
                break
            import time
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, "".join(seen) + err
    lines = out.splitlines()
    assert any(line.split()[:1] == ["O0"] for line in lines)
    assert not any(line.split()[:1] in (["O1"], ["O2"]) for line in lines)
    assert "interrupted: 1 of 3 levels finished (O0)" in out
    assert "[2/3] O1 interrupted" in err and "O2 running" not in err
    o1_pid = int(next(line.split()[1] for line in pids.read_text().splitlines() if line.startswith("O1")))
    with pytest.raises(ProcessLookupError):  # the interrupted run did not outlive the command
        os.kill(o1_pid, 0)

