"""`ampatch diagnose --fp8 [RECIPE]`: each layer run in FP8 against bfloat16 on its own inputs,
the layers FP8 hurts named from the run's own figures (`diagnose.fp8.judge`), and the fix
verified by a rerun without them (AMPATCH_FP8_MODULES). The planted case,
examples/fp8_outliers.py, must be found; the built-in LM must not be blamed."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from _cli import ampatch_main

from ampatch.diagnose import fp8
from ampatch.diagnose.analysis import diagnosis
from ampatch.record.records import Fp8LayerRecord

ROOT = Path(__file__).resolve().parents[2]
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def record(name: str, out: float, wgrad: float, flushed: float = 0.0, saturated: float = 0.0,
           recipe: str = "tensorwise", wgrad_dtype: str | None = E5M2) -> Fp8LayerRecord:
    n = 10_000
    casts = {"input@output": {"dtype": E4M3, "n": n, "saturated": int(saturated * n), "underflow": int(flushed * n),
                              "subnormal": 0},
             "weight@output": {"dtype": E4M3, "n": n, "saturated": 0, "underflow": 0, "subnormal": 0}}
    if wgrad_dtype is not None:
        casts["grad_output@grad_weight"] = {"dtype": wgrad_dtype, "n": n, "saturated": 0, "underflow": 0,
                                            "subnormal": 0}
        casts["input@grad_weight"] = {"dtype": E4M3, "n": n, "saturated": 0, "underflow": 0, "subnormal": 0}
    return Fp8LayerRecord(name, "Linear", recipe, True, 2, [out], [wgrad], casts)


def judged(*records: Fp8LayerRecord):
    entries, notes = fp8.judge(fp8.entries(records))
    return [e.name for e in entries if e.hurts], notes, entries


@pytest.fixture
def in_process(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``ampatch ARGS`` through `cli.main` in this process, what ``python -m ampatch`` runs, with its
    runs as child processes and no AMPATCH_* inherited (tests/_cli.py)."""
    return lambda *args, cwd=None: ampatch_main(capfd, monkeypatch, *args, cwd=cwd)


def test_the_formats_rounding():
    assert fp8.rounding(E4M3) == 2 ** -4 and fp8.rounding(E5M2) == 2 ** -3 and fp8.rounding(None) == 0.0


def test_values_lost_beyond_the_formats_rounding_name_the_layer():
    named, notes, entries = judged(record("a", 0.04, 0.05, flushed=0.07), record("b", 0.04, 0.05, flushed=0.05),
                                   record("c", 0.04, 0.05, saturated=0.1))
    assert named == ["a", "c"]           # 7% > e4m3's 6.25%; 5% is not
    assert "7% of the non-zero values of its input@output cast flush to zero in FP8 (e4m3fn" in entries[0].why
    assert "saturate" in entries[2].why
    assert any(n.startswith("fp8: a (Linear, tensorwise): ") and n.endswith("Leave it out of FP8.") for n in notes)
    assert entries[0].flushed == pytest.approx(0.07) and entries[0].flushed_in == "input@output"


def test_an_error_beyond_rounding_that_stands_out_of_the_others():
    base = [record(f"l{i}", 0.035 + 0.002 * i, 0.05 + 0.003 * i) for i in range(5)]
    named, _, entries = judged(*base, record("odd", 0.035, 0.6))
    assert named == ["odd"]
    assert "weight gradient's error against bfloat16, 0.6, is more than FP8's rounding" in entries[-1].why
    assert "above the other FP8 layers' errors beyond their scatter" in entries[-1].why
    # within what rounding explains (e5m2 + e4m3 = 0.1875), an error that stands out is not blamed
    assert judged(*base, record("odd", 0.035, 0.15))[0] == []


def test_every_layer_beyond_rounding_is_the_model_not_a_layer():
    named, notes, _ = judged(*(record(f"l{i}", 0.2 + 0.01 * i, 0.05) for i in range(5)))
    assert named == []
    assert any("FP8 hurts this model as a whole rather than a layer of it" in n for n in notes)


def test_with_few_layers_the_bound_alone_decides():
    assert judged(record("a", 0.04, 0.05), record("b", 0.3, 0.05))[0] == ["b"]


def test_a_gemm_kept_in_high_precision_is_not_blamed():
    assert judged(*(record(f"l{i}", 0.04, 0.0, recipe="rowwise_with_gw_hp", wgrad_dtype=None)
                    for i in range(4)))[0] == []


def test_the_recommendation_leaves_the_named_layers_out_and_no_loss_scale_for_them():
    """A layer whose weight gradient vanished in FP8's casts is FP8's finding: a loss scale,
    which FP8's dynamic scaling cancels, is not recommended for it."""
    from ampatch.record.records import ModuleRecord, ParamRecord, Recording, StepRecord
    steps = [StepRecord(i, 2.0, True, 1.0, False) for i in range(4)]
    modules = [ModuleRecord("embed", "Float8Linear", True, 4, 1.0, grad_underflow=1.0, rel_errors=[0.01]),
               *(ModuleRecord(f"h{i}", "Float8Linear", True, 4, 1.0, grad_underflow=0.0, rel_errors=[0.01])
                 for i in range(3))]
    fp8_records = [record("embed", 0.04, 1.0, flushed=0.58), *(record(f"h{i}", 0.035, 0.05) for i in range(3))]
    rec = Recording("O5", "bfloat16", 1.0, "fp32", [], [], True, 4, steps, modules, [ParamRecord("embed.weight",
                    "embed", "float32", 10, [0.0] * 4)], fp8_records)
    found = diagnosis(rec)
    r = found.recommendation
    assert r.fp8_exclude == ("embed",) and r.fp8_modules == ("h0", "h1", "h2") and r.settings.loss_scale is None
    assert bool(r) and r.to_dict()["fp8_modules"] == ["h0", "h1", "h2"]
    assert [e["name"] for e in found.to_dict()["fp8"]] == ["embed", "h0", "h1", "h2"]
    assert diagnosis(Recording.from_dict(rec.to_dict())).recommendation == r


def test_diagnose_fp8_names_the_planted_layer_and_verifies_its_exclusion(tmp_path, in_process):
    pytest.importorskip("torchao")
    out = tmp_path / "d.json"
    done = in_process("diagnose", "--fp8", "--opt-level", "O5", "--json", str(out), "--",
                      "python", str(ROOT / "examples" / "fp8_outliers.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    hurt = [e["name"] for e in doc["fp8"] if e["hurts"]]
    assert hurt == ["embed"] and [e["name"] for e in doc["fp8"]] == ["embed", "hidden.0", "hidden.1", "hidden.2"]
    assert doc["fp8"][0]["flushed"] > 0.3 and all(e["emulated"] for e in doc["fp8"])
    assert doc["recommendation"]["fp8_exclude"] == ["embed"]
    assert doc["recommendation"]["fp8_modules"] == ["hidden.0", "hidden.1", "hidden.2"]
    assert doc["recommendation"]["settings"] == {}
    v = doc["verification"]
    assert v["follows_O0"] and v["fp8_exclude"] == ["embed"] and v["without"]["follows_O0"] is False
    text = done.stdout
    assert "fp8 layers (tensorwise, fp8 emulated: numerics only, not speed; each against the same GEMMs" in text
    assert "recommendation: leave ['embed'] out of FP8 (fp8_modules=['hidden.0', 'hidden.1', 'hidden.2'])" in text
    assert "O5+fp8:tensorwise + ['embed'] out of FP8" in text
    assert "ampatch run --opt-level O5 --fp8 tensorwise --fp8-modules hidden.0,hidden.1,hidden.2 -- python" in text


def test_diagnose_fp8_blames_no_layer_of_the_builtin_lm(tmp_path, in_process):
    pytest.importorskip("torchao")
    out = tmp_path / "d.json"
    done = in_process("diagnose", "--fp8", "--workload", "lm", "--steps", "4", "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["opt_level"] == "O5" and len(doc["fp8"]) == 4 and not any(e["hurts"] for e in doc["fp8"])
    assert doc["recommendation"]["fp8_exclude"] == [] and doc["verification"] is None
    assert "recommendation: none" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--fp8", "off"], "--fp8 off: diagnose --fp8 measures the layers run in FP8"),
    (["--fp8", "columnwise"], "'columnwise' is not an fp8 recipe; use one of 'tensorwise', 'rowwise'"),
    (["--fp8", "--opt-level", "O2", "--half-dtype", "float16"],
     "fp8='tensorwise' runs where the layers compute in bfloat16 or FP32 (torchao's float8 training), but O2 here "
     "computes in float16"),
])
def test_bad_fp8_options_are_usage_errors(tmp_path, args, message, in_process):
    done = in_process("diagnose", *args, "--workload", "lm", cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr and "recording" not in done.stderr


def test_run_fp8_modules_reaches_every_initialize(tmp_path, in_process):
    pytest.importorskip("torchao")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch, ampatch as amp
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        m, o = amp.initialize(m, o, opt_level="O5", verbosity=0)
        print(" ".join(type(layer).__name__ for layer in m))
    """))
    done = in_process("run", "--fp8", "--fp8-modules", "1, 2", "--", "python", str(script), cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split() == ["Linear", "Float8Linear", "Float8Linear"], done.stderr
    bad = in_process("run", "--fp8-modules", ",", "--", "python", str(script), cwd=tmp_path)
    assert bad.returncode == 2 and "--fp8-modules needs layer names or globs" in bad.stderr
