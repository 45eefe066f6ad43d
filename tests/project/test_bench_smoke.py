"""Smoke test of scripts/bench (`python scripts/bench`): it runs (quick, restricted sections)
and its JSON carries the ratio keys the README table and the speed targets are read from; its
child processes start through `python -m bench.child`. No timing assertions: ratios from a
few rounds on a shared machine are noise."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
BENCH = SCRIPTS / "bench"  # a package, run as a folder
if str(SCRIPTS) not in sys.path:  # `bench` importable, for the tests that call its entry points in this process
    sys.path.insert(0, str(SCRIPTS))


def _run(tmp_path: Path, only: str) -> dict:
    out = tmp_path / "out" / "bench.json"  # a folder that does not exist yet, as out/ in a fresh clone
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--only", only, "--json", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "targets" in proc.stdout
    return json.loads(out.read_text())


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# The quick CPU sections, run once for the tests below (one bench process and its imports instead
# of one per section); the memory section reads /proc (Linux), as its test says.
QUICK = ["mlp", "micro", "o1"] + (["memory"] if Path("/proc/self/status").exists() else []) + ["gpu"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`python scripts/bench --quick --only mlp,micro,o1,memory,gpu --json out/bench.json`'s JSON."""
    return _run(tmp_path_factory.mktemp("bench"), ",".join(QUICK))


def test_bench_quick_mlp_and_micro(quick: dict) -> None:
    data = quick
    ratios = data["ratios"]
    for key in ("mlp.O1/autocast", "mlp.O2/autocast", "mlp.O2/O3", "mlp.autocast/fp32",
                "micro.linear.O1/autocast", "micro.add.O1-unpatched_us", "micro.nocast.O1-unpatched_us",
                "micro.unscale.ampatch/GradScaler", "micro.unscale.ampatch_exit/GradScaler_full"):
        assert key in ratios, key
        assert _finite(ratios[key]), (key, ratios[key])
    assert ratios["mlp.O1/autocast"] > 0
    for key in ("mlp.O1/autocast", "mlp.O2/autocast", "micro.linear.O1/autocast", "micro.add.O1-unpatched_us",
                "micro.unscale.ampatch/GradScaler"):
        target = data["targets"][key]
        assert set(target) == {"limit", "value", "met", "what"}
        assert isinstance(target["met"], bool)
    assert data["meta"]["quick"] is True
    assert set(data["results"]["mlp"]["median_step_ms"]) == {"fp32", "autocast", "O1", "O2", "O3"}


@pytest.mark.slow
def test_bench_quick_o1(quick: dict) -> None:
    """Issue 44's section: F.linear calls and the 16-layer MLP step, eager and compiled."""
    data = quick
    for case in ("linear_4x16", "linear_8x64", "mlp16", "mlp16_compiled"):
        assert _finite(data["ratios"][f"o1.{case}.O1/autocast"]), case
    for key in ("o1.linear_8x64.O1/autocast", "o1.mlp16.O1/autocast", "o1.mlp16_compiled.O1/autocast"):
        assert set(data["targets"][key]) == {"limit", "value", "met", "what"}
    phases = data["results"]["o1"]["mlp16"]["phases_us"]
    assert set(phases) == {"autocast", "O1"} and set(phases["O1"]) == {"zero_grad", "forward", "backward", "step"}


def test_bench_quick_memory(quick: dict) -> None:
    if "memory" not in QUICK:
        pytest.skip("the CPU memory measure reads /proc")
    data = quick
    ratio = data["ratios"]["memory.cnn.O2/O0"]
    assert _finite(ratio) and 0 < ratio < 2
    mem = data["results"]["memory"]
    assert mem["peak_bytes"]["O0"] > mem["persistent_bytes"]["O0"] > 0


def test_bench_rejects_unknown_section() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--only", "nope"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert "unknown section" in proc.stderr



@pytest.mark.parametrize("device, message", [
    ("tpu", "--device: Expected one of cpu"),
    pytest.param("cuda", "no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_bench_rejects_a_device_it_cannot_use(device: str, message: str, capfd: pytest.CaptureFixture) -> None:
    """`bench.cli.main` in this process (what `python scripts/bench` runs; the real process's exit
    status: test_bench_rejects_unknown_section): a usage error before anything is measured."""
    from bench import cli
    with pytest.raises(SystemExit) as exited:
        cli.main(["--device", device, "--quick"])
    err = capfd.readouterr().err
    assert exited.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_quick_fsdp(tmp_path: Path) -> None:
    """`--fsdp`: two gloo rank processes per mode through `python -m bench.child fsdp`; the
    JSON carries the peak of each mode and the ratios the README quotes."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the CPU memory measure needs Linux's /proc/self/clear_refs")
    out = tmp_path / "fsdp.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--fsdp", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FSDP2 peak memory per rank" in proc.stdout
    data = json.loads(out.read_text())
    fsdp = data["results"]["fsdp"]
    assert fsdp["shape"] == {"width": 256, "depth": 3, "batch": 32}
    for mode in ("O0", "O2", "native"):
        assert fsdp["peak_bytes"][mode] > fsdp["persistent_bytes"][mode] > 0
    assert set(data["ratios"]) == {"fsdp.O2/O0", "fsdp.native/O0", "fsdp.O2/native"}


def test_bench_child_entry_rejects_bad_arguments(capfd: pytest.CaptureFixture) -> None:
    """The child processes' entry is a documented command line of its own, not hidden flags."""
    from bench import child  # `python -m bench.child` runs its main, here in this process
    with pytest.raises(SystemExit) as exited:
        child.main(["memory", "--level", "O7"])
    assert exited.value.code == 2 and "invalid choice: 'O7'" in capfd.readouterr().err


def test_bench_files_stay_small() -> None:
    """No module of the bench package past ~300 lines (split it by job)."""
    sizes = {str(p.relative_to(BENCH)): len(p.read_text().splitlines()) for p in BENCH.rglob("*.py")}
    assert sizes and all(n <= 300 for n in sizes.values()), sizes


def test_bench_quick_gpu_section(quick: dict) -> None:
    """The GPU-sized transformer section, shrunk by --quick so its code runs on any device."""
    data = quick
    gpu = data["results"]["gpu"]
    assert set(gpu["median_step_ms"]) == {"fp32", "autocast", "O1", "O2", "O3"}
    assert gpu["config"] == {"d_model": 64, "heads": 4, "layers": 2, "batch": 2, "seq": 16}
    assert gpu["master_bytes"] == 4 * gpu["params"]          # every param has an FP32 master under O2
    for key in ("gpu.O1/autocast", "gpu.O2/autocast", "gpu.O2/O3", "gpu.autocast/fp32"):
        assert _finite(data["ratios"][key]), key
    assert set(data["targets"]) >= {"gpu.O1/autocast", "gpu.O2/autocast"}
    assert data["meta"]["machine"].startswith(data["meta"]["device"].split(":")[0] + ": ")
    assert data["meta"]["sections"] == QUICK          # --only's sections, in the bench's order; no others


def test_check_cost_runs() -> None:
    """scripts/check_cost.py builds the lm workload through the workload's own parser, so it
    keeps running when the workloads grow an argument (it broke when they gained --device)."""
    script = SCRIPTS / "check_cost.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checked / unchecked:" in proc.stdout and "check alone:" in proc.stdout


@pytest.mark.slow
def test_o2_memory_runs() -> None:
    """scripts/o2_memory.py (README's CPU proxy for O2's peak memory) on a tiny transformer: it
    runs, with bench's memory meter, and prints the ratio the README quotes."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the CPU memory measure needs Linux's /proc/self/clear_refs")
    script = SCRIPTS / "o2_memory.py"
    proc = subprocess.run([sys.executable, str(script), "--d-model", "32", "--heads", "2", "--layers", "1",
                           "--batch", "1", "--seq", "8"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "O2 peak / (autocast peak + FP32 masters" in proc.stdout
    assert "scale_loss exit +" in proc.stdout
