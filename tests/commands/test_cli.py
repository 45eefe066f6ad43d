"""The ``ampatch`` command: compare, run, failed rows, argument errors, Ctrl-C.

Most tests run the command through `cli.main` in this process (`in_process`, tests/_cli.py:
what ``python -m ampatch`` runs, its runs real child processes, without a second interpreter
start per command); those about the process itself (its exit status and one-line usage error,
Ctrl-C) run ``python -m ampatch`` as a user would. The pieces of
``ampatch.runs`` and ``ampatch.compare`` have their own tests (tests/commands/test_runs_*.py, test_compare_*.py).
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
from _cli import ampatch_main, as_from_a_terminal

from ampatch import cli
from ampatch.cli import common

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.fixture
def in_process(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``ampatch ARGS`` through `cli.main` in this process, as `ampatch` above runs it (tests/_cli.py)."""
    return lambda *args, cwd, env=None: ampatch_main(capfd, monkeypatch, *args, cwd=cwd, env=env)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.slow
def test_compare_default_workload(tmp_path: Path, in_process) -> None:
    out = tmp_path / "out.json"
    proc = in_process("compare", "--levels", "O0,O4,O5", "--steps", "4", "--size", "tiny", "--json", str(out),
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["workload"] == "lm" and data["steps"] == 4
    assert (data["size"], data["size_dims"], data["calibration"]) == ("tiny", "d_model 64, seq 32", None)
    assert proc.stdout.splitlines()[1] == "size tiny (d_model 64, seq 32), from --size"
    assert "calibrat" not in proc.stderr
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
def test_compare_user_script_with_a_failing_level(tmp_path: Path, in_process) -> None:
    script = write(tmp_path / "train.py", AMP_SCRIPT)
    out, png = tmp_path / "out.json", tmp_path / "curves.png"
    proc = in_process("compare", "--levels", "O0,O2,O4", "--json", str(out), "--plot", str(png),
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
def test_run_forces_the_level_and_passes_the_exit_code(tmp_path: Path, in_process) -> None:
    script = write(tmp_path / "train.py", AMP_SCRIPT)
    seen, report = tmp_path / "seen.txt", tmp_path / "report.json"
    proc = in_process("run", "--opt-level", "O3", "--report", str(report), "--",
                      "python", str(script), str(seen), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text() == "O3"                       # the script asked for O1
    assert json.loads(report.read_text())["opt_level"] == "O3"
    failing = in_process("run", "--opt-level", "O2", "--", "python", str(script), cwd=tmp_path)
    assert failing.returncode == 1 and "boom at O2" in failing.stderr


def test_apex_alias(tmp_path: Path, in_process) -> None:
    script = write(tmp_path / "apex_train.py",
                   "from apex import amp\nassert callable(amp.initialize)\n")
    proc = in_process("run", "--opt-level", "O1", "--apex-alias", "--", "python", str(script),
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_apex_alias_still_runs_the_sitecustomize_it_shadows(tmp_path: Path, in_process) -> None:
    """The alias is a sitecustomize first on the run's path: the user's own one runs too."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    write(site_dir / "sitecustomize.py", "import builtins\nbuiltins.USER_SITE_RAN = True\n")
    script = write(tmp_path / "both.py", "import builtins\nfrom apex import amp\n"
                                         "assert builtins.USER_SITE_RAN and callable(amp.initialize)\n")
    path = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), str(site_dir), os.environ.get("PYTHONPATH")) if p)}
    proc = in_process("run", "--apex-alias", "--", "python", str(script), cwd=tmp_path, env=path)
    assert proc.returncode == 0, proc.stderr
    plain = in_process("run", "--", "python", str(script), cwd=tmp_path, env=path)
    assert plain.returncode == 1 and "No module named 'apex'" in plain.stderr   # the alias did it


def test_a_script_without_initialize_is_a_failed_row(tmp_path: Path, in_process) -> None:
    script = write(tmp_path / "plain.py", "print('no amp here')\n")
    proc = in_process("compare", "--levels", "O1", "--", "python", str(script), cwd=tmp_path)
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
    (["compare", "--size", "small", "--", "python", "x.py"], "--size apply to the built-in workloads"),
    (["compare", "--size", "enormous"], "argument --size: invalid choice: 'enormous'"),
    (["compare", "--device", "tpu"], "--device: Expected one of cpu"),
    (["run", "--keep-fp32", " , ", "--", "python", "x.py"], "--keep-fp32 needs module names"),
    pytest.param(["compare", "--device", "cuda"], "--device cuda: ",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capfd: pytest.CaptureFixture, args: list[str], message: str) -> None:
    """In this process (`cli.main`, what ``python -m ampatch`` runs; capfd reads file descriptor 2, as
    a terminal would): each usage error is refused before anything runs. The real process's exit
    status and stderr: test_a_bad_argument_from_the_real_command."""
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith("AMPATCH_")]:
        monkeypatch.delenv(name)
    assert cli.main(list(args)) == 2
    err = capfd.readouterr().err
    assert err.startswith("ampatch: error:") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_bad_argument_from_the_real_command(tmp_path: Path) -> None:
    """``python -m ampatch`` itself: exit status 2 and the one line (an argparse error; those and
    ampatch's own checks alike are `cli.main`'s return value and line: test_bad_arguments_exit_2_with_one_line)."""
    proc = ampatch("compare", "--size", "enormous", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("ampatch: error:") and "argument --size: invalid choice: 'enormous'" in proc.stderr
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
    # speed-up and max deviation from O0, relative to what O0 learns: 0.01 against its fall of 0.92 (5-loss means)
    assert o1[3] == "2.00x" and o1[8] == "1.09%"


# ----------------------------------------------------------------------------- --keep-fp32

ENV_SCRIPT = textwrap.dedent("""\
    # Writes a report like ampatch's, with the AMPATCH_KEEP_FP32 it was given as keep_fp32.
    import json, os
    report = {"opt_level": os.environ.get("AMPATCH_OPT_LEVEL", "O1"), "half_dtype": "bfloat16", "enabled": True,
              "casts": {}, "cache": {"hits": 0, "misses": 0}, "steps": 2, "skipped_steps": [],
              "loss_scale": {"loss_scaler0": 1.0}, "loss_scale_history": {"loss_scaler0": [[0, 1.0]]},
              "time_s": {"wrappers": 0.0, "scale_loss": 0.0}, "step_times_s": [0.01], "losses": [1.0, 0.5],
              "peak_memory_bytes": 0, "keep_fp32": os.environ.get("AMPATCH_KEEP_FP32", "").split(",")}
    with open(os.environ["AMPATCH_REPORT"], "w") as f:
        json.dump(report, f)
""")


def test_run_and_compare_pass_keep_fp32_to_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("AMPATCH_KEEP_FP32", raising=False)
    script = write(tmp_path / "env.py", ENV_SCRIPT)
    report = tmp_path / "report.json"
    assert cli.main(["run", "--keep-fp32", "head, blocks.0", "--report", str(report), "--",
                     sys.executable, str(script)]) == 0
    assert json.loads(report.read_text())["keep_fp32"] == ["head", "blocks.0"]
    out = tmp_path / "out.json"
    assert cli.main(["compare", "--levels", "O0,O2", "--keep-fp32", "head", "--json", str(out), "--",
                     sys.executable, str(script)]) == 0
    data = json.loads(out.read_text())
    assert data["keep_fp32"] == "head" and [r["report"]["keep_fp32"] for r in data["rows"]] == [["head"]] * 2
    assert "kept in FP32 at every level (--keep-fp32): head" in capsys.readouterr().out


@pytest.mark.slow
def test_run_keep_fp32_reaches_initialize(tmp_path: Path, in_process) -> None:
    """An unmodified script rerun with a module kept in FP32; a name it lacks fails, naming the variable."""
    script = write(tmp_path / "train.py", AMP_SCRIPT)
    report = tmp_path / "report.json"
    proc = in_process("run", "--opt-level", "O3", "--keep-fp32", "2", "--report", str(report), "--",
                      "python", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["keep_fp32"] == ["2"]
    bad = in_process("run", "--keep-fp32", "head", "--", "python", str(script), cwd=tmp_path)
    assert bad.returncode == 1 and "AMPATCH_KEEP_FP32: no module is named 'head'" in bad.stderr


@pytest.mark.slow
def test_compare_built_in_workload_with_keep_fp32(tmp_path: Path, in_process) -> None:
    out = tmp_path / "out.json"
    proc = in_process("compare", "--levels", "O1,O2", "--steps", "2", "--size", "tiny", "--keep-fp32", "head",
                      "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["report"]["keep_fp32"] for r in rows] == [["head"], ["head"]]
    assert all(r["ok"] and math.isfinite(r["final_loss"]) for r in rows)


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

def test_help_says_what_each_size_is(in_process) -> None:
    proc = in_process("compare", "--help", cwd=ROOT)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--size SIZE" in text and "auto (default" in text and "small = d_model 128, seq 32" in text


def test_budget_values() -> None:
    assert common.budget("120") == 120 and common.budget("90s") == 90 and common.budget("2m") == 120
    assert common.budget("1.5min") == 90 and common.budget("none") is None and common.budget("0") is None
    for bad in ("-5", "soon", "5h"):
        with pytest.raises(Exception, match="expected a time"):
            common.budget(bad)


@pytest.mark.slow
def test_compare_within_a_budget(tmp_path: Path, in_process) -> None:
    """The default size is calibrated first, within the budget; the title says what it chose."""
    from ampatch.machine import hardware
    from ampatch.runs.builtin import FEW_STEPS
    out = tmp_path / "out.json"
    proc = in_process("compare", "--levels", "O0,O5", "--budget", "25s", "--device", "cpu",
                      "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["budget_s"] == 25 and data["steps"] == 150 and data["interrupted"] is False
    o0, o5 = data["rows"]
    assert 3 <= o5["steps"] <= o0["steps"] <= 150        # later levels never run more steps
    assert data["compared_steps"] == min(len(o0["losses"]), len(o5["losses"])) == o5["steps"]
    assert "in a 25s budget" in proc.stdout and f"compared over the first {o5['steps']} steps" in proc.stdout
    assert "(cpu, 1 torch thread)" in proc.stdout and data["threads"] == 1
    assert ("left time for only" in proc.stdout) is (o5["steps"] < FEW_STEPS)
    calibration = data["calibration"]
    assert calibration["chosen"] == data["size"] and calibration["sizes"][0]["size"] == "tiny"
    assert set(calibration["sizes"][0]["step"]) == {"float32", "bfloat16"}
    assert proc.stdout.splitlines()[1].startswith(f"size {data['size']} ({data['size_dims']}), ")
    assert "calibrating: timing float32 and bfloat16 steps of lm" in proc.stderr and "calibrated in " in proc.stderr
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
        json.dump({"opt_level": level, "half_dtype": None, "enabled": True, "casts": {}, "cache": {},
                   "steps": 3, "skipped_steps": [], "loss_scale": {}, "loss_scale_history": {},
                   "time_s": {}, "losses": [1.0, 0.5, 0.25]}, f)
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
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_from_a_terminal)
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



@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the built-in workloads fork their runs on Linux")
def test_ctrl_c_during_a_built_in_workload_leaves_no_process_behind(tmp_path: Path) -> None:
    """The built-in workloads' runs fork from a warm process: Ctrl-C stops the run and that
    process too, and prints the levels that finished."""
    import signal
    import time
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "ampatch", "compare", "--levels", "O0,O1", "--size", "tiny",
                             "--steps", "150"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_from_a_terminal)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("[2/2] O1 running"):
                break
        time.sleep(1.0)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        family = children + [g for c in children for g in
                             subprocess.run(["pgrep", "-P", c], capture_output=True, text=True).stdout.split()]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, "".join(seen) + err
    assert "warm process ready in" in "".join(seen) and "[2/2] O1 interrupted" in err
    assert "interrupted: 1 of 2 levels finished (O0)" in out
    assert len(family) == 2                                   # the warm process and the O1 run
    time.sleep(0.5)
    for pid in family:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


def test_compare_levels_with_a_low_memory_master_mode(tmp_path: Path, in_process) -> None:
    """`--levels O5+stochastic,O5+kahan` adds those rows beside O5, each run with that
    master_weights, and the B/param column shows what each holds per trained parameter; a
    mode on a level that does not cast the model is a usage error naming the levels."""
    out = tmp_path / "c.json"
    proc = in_process("compare", "--levels", "O0,O5,o5+Stochastic,O5+kahan", "--steps", "6", "--size", "tiny",
                      "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["level"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["O0", "O5", "O5+stochastic", "O5+kahan"]
    assert [rows[k]["report"]["master_weights"] for k in rows] == ["none", "fp32", "stochastic", "kahan"]
    per_param = {k: r["train_bytes_per_param"] for k, r in rows.items()}
    assert per_param["O5+stochastic"] < per_param["O5+kahan"] < per_param["O5"]   # 0, 2 and 4 bytes of masters
    assert per_param["O5"] - per_param["O5+stochastic"] == pytest.approx(4.0, abs=0.01)
    assert "B/param" in proc.stdout and "O5+kahan" in proc.stdout
    bad = in_process("compare", "--levels", "O0,O1+kahan", cwd=tmp_path)
    assert bad.returncode == 2 and "applies to the levels that cast the model to bfloat16 (O2, O3, O5)" in bad.stderr


def test_run_forces_master_weights(tmp_path: Path, in_process) -> None:
    """`ampatch run --master-weights kahan` reaches every amp.initialize (AMPATCH_MASTER_WEIGHTS);
    a bad mode is a usage error naming the values."""
    script = write(tmp_path / "train.py", textwrap.dedent("""\
        import torch, ampatch as amp
        m = torch.nn.Linear(4, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)
        m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
        print(amp.report().master_weights)
    """))
    done = in_process("run", "--opt-level", "O5", "--master-weights", "kahan", "--", "python", str(script),
                      cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "kahan", done.stderr
    bad = in_process("run", "--master-weights", "fp8", "--", "python", str(script), cwd=tmp_path)
    assert bad.returncode == 2 and "use True, False, 'stochastic' or 'kahan'" in bad.stderr


LONG_SCRIPT = AMP_SCRIPT.replace("range(5)", "range(10_000)")   # far longer than a comparison needs


@pytest.mark.slow
def test_compare_steps_stop_a_script_as_tune_and_diagnose_do(tmp_path: Path, in_process) -> None:
    """`compare --steps 20 -- python train.py`: each run stops after 20 optimizer steps
    (AMPATCH_MAX_STEPS), as tune's and diagnose's runs do; the table has the verdict and noise
    columns beside the deviation."""
    script = write(tmp_path / "train.py", LONG_SCRIPT)
    out = tmp_path / "out.json"
    proc = in_process("compare", "--steps", "20", "--levels", "O0,O4", "--json", str(out), "--", "python", str(script),
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["level"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["O0"]["steps"] == rows["O4"]["steps"] == 20 and len(rows["O4"]["losses"]) == 20
    assert rows["O4"]["verdict"]["outcome"] in ("qualifies", "fails", "cannot tell")
    assert rows["O0"]["verdict"] is None
    header = next(line for line in proc.stdout.splitlines() if line.startswith("level"))
    assert "max dev vs O0  noise  verdict" in header and "20 steps per run" in proc.stdout


def test_the_help_names_all_four_commands(capsys) -> None:
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    description = text.split("positional arguments")[0]
    for name in ("compare", "run", "diagnose", "tune"):
        assert f"({name})" in description
