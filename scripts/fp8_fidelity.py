"""Does O5+fp8 train like O5? The measurement behind docs/fp8.md (issue 36), on CPU (emulated FP8).

    python scripts/fp8_fidelity.py [--steps 300] [--size small] [--recipes tensorwise,rowwise] [--seed 0]
                                   [--only lm|llama] [--llama-fp8-modules GLOBS] [--json PATH]

Two models, each trained from the same seed on the same batches at O0, O5 and O5+fp8 (each
recipe):
- the built-in LM (`python -m ampatch.workloads.lm`, unmodified), each level in its own
  process through `ampatch run --opt-level L [--fp8 RECIPE] --report PATH`;
- a 2-layer `LlamaForCausalLM` (from a `LlamaConfig`, no download) on the package's corpus,
  characters as tokens, in this process.
For each it applies tune's rule (`ampatch.runs.deviation.against`, as `ampatch tune` judges a
candidate: the largest gap between 5-step means of two loss curves relative to what the
reference learns over the run, how far it goes beyond the noise of the paired per-step
differences, and the share of the reference's progress learned) to each run against O0, and
to each O5+fp8 run against O5, at tune's default tolerance (2%).
Emulated FP8 shows numerics only: the step times printed are not FP8's speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ampatch as amp
from ampatch.runs.deviation import MIN_SHARE, TOLERANCE, Basis, Comparison, Reference, against

ROOT = Path(__file__).resolve().parents[1]


def lm_curve(level: str, recipe: str | None, steps: int, size: str, seed: int = 0) -> tuple[list[float], float]:
    """The built-in LM's losses at `level` (with `recipe` in FP8), and its median step time."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "ampatch", "run", "--opt-level", level, "--report", str(report)]
        cmd += ["--fp8", recipe] if recipe else []
        cmd += ["--", sys.executable, "-m", "ampatch.workloads.lm", "--steps", str(steps), "--size", size,
                "--threads", "1", "--seed", str(seed)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, text=True)
        data = json.loads(report.read_text())
    times = sorted(data["step_times_s"])
    return data["losses"], times[len(times) // 2] if times else float("nan")


def corpus_batches(steps: int, batch: int, seq: int, seed: int = 1) -> tuple[list[torch.Tensor], int]:
    """Character-level batches of the corpus that ships with ampatch (the same at every level)."""
    text = (importlib.resources.files("ampatch.workloads") / "data" / "corpus.txt").read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq - 1, (steps, batch), generator=gen)
    return [torch.stack([ids[s:s + seq] for s in row.tolist()]) for row in starts], len(chars)


def llama_curve(level: str, recipe: str | None, steps: int, seed: int = 0, modules: str | None = None
                ) -> tuple[list[float], float]:
    """A 2-layer LlamaForCausalLM's losses at `level` (with `recipe`), and its median step time."""
    import transformers
    batches, vocab = corpus_batches(steps, batch=16, seq=64, seed=seed + 1)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, fp8=recipe, fp8_modules=modules if recipe else None,
                                verbosity=0)
    losses, times = [], []
    for ids in batches:
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    amp.deinitialize()
    times.sort()
    return losses, times[len(times) // 2]


def judged(c: Comparison) -> str:
    """tune's verdict on a comparison (`ampatch.runs.verdict.judge`, at the default tolerance)."""
    margin = c.learned_margin() or 0.0
    if c.learned is None or c.deviation is None:
        return "not judged"
    if c.learned - margin < MIN_SHARE or c.learned + margin > 1 / MIN_SHARE:
        return "learns unlike the reference"
    if (c.noise or 0.0) > TOLERANCE:
        return "too noisy to judge"
    beyond = c.beyond if c.beyond is not None else c.deviation
    return "within 2%" if beyond <= TOLERANCE else "OUTSIDE 2%"


def compare(name: str, curves: dict[str, tuple[list[float], float]]) -> dict[str, object]:
    """tune's rule (`ampatch.runs.deviation.against`), each run against O0, and each FP8 run
    against O5 (O5's curve as the reference, its progress the unit)."""
    as_map = {label: dict(enumerate(losses)) for label, (losses, _) in curves.items()}
    ref0, ref5 = Reference.of(as_map["O0"]), Reference.of(as_map["O5"])
    print(f"\n{name}\n  against O0: {ref0.describe()}\n  against O5: {ref5.describe().replace('O0', 'O5')}")
    print(f"  {'run':<28} {'final':>7} {'step ms':>8}   {'vs O0: dev':>10} {'beyond':>7} {'learned':>8}  verdict"
          f"{'':<12} {'vs O5: dev':>10} {'beyond':>7}  verdict")
    rows = {}
    for label, (losses, step_s) in curves.items():
        final = sum(losses[-5:]) / len(losses[-5:])
        c0 = against(as_map[label], ref0)
        c5 = against(as_map[label], ref5) if "fp8" in label else None
        line = (f"  {label:<28} {final:>7.4f} {step_s * 1e3:>8.1f}   {c0.deviation:>10.2%} {c0.beyond or 0:>7.2%} "
                f"{c0.learned if c0.learned is not None else float('nan'):>8.2f}  {judged(c0):<19}")
        if c5 is not None:
            line += f" {c5.deviation:>10.2%} {c5.beyond or 0:>7.2%}  {judged(c5)}"
        print(line)
        rows[label] = {"final_loss": final, "step_ms": step_s * 1e3, "losses": losses,
                       "vs_o0": dataclasses.asdict(c0), "verdict_vs_o0": judged(c0),
                       "vs_o5": dataclasses.asdict(c5) if c5 else None, "verdict_vs_o5": judged(c5) if c5 else None}
    if ref0.basis is not Basis.PROGRESS:
        print("  (O0 made no detectable progress: run more steps)")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", default="small", help="the built-in LM's size (its SIZES table)")
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--only", choices=("lm", "llama"), default=None)
    parser.add_argument("--seed", type=int, default=0, help="weights and batches")
    parser.add_argument("--llama-fp8-modules", metavar="GLOBS",
                        help="the Llama's fp8_modules (default: the default choice)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipes = [r for r in args.recipes.split(",") if r]
    print(f"torch {torch.__version__}, {args.steps} steps, seed {args.seed}, CPU: FP8 emulated (numerics only, "
          "not speed)")
    out = {}
    for name, curve in (("lm", lambda lv, r: lm_curve(lv, r, args.steps, args.size, args.seed)),
                        ("llama", lambda lv, r: llama_curve(lv, r, args.steps, args.seed, args.llama_fp8_modules))):
        if args.only not in (None, name):
            continue
        curves = {"O0": curve("O0", None), "O5": curve("O5", None)}
        for recipe in recipes:
            curves[f"O5+fp8:{recipe}"] = curve("O5", recipe)
        title = (f"built-in LM (size {args.size})" if name == "lm" else
                 "LlamaForCausalLM (2 layers, hidden 128, intermediate 256, seq 64, batch 16)"
                 + (f", fp8_modules={args.llama_fp8_modules}" if args.llama_fp8_modules else ""))
        out[name] = compare(title, curves)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
