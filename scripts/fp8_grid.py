#!/usr/bin/env python3
"""`ampatch diagnose --fp8` on a generated family of planted FP8 problems: the table of
docs/fp8.md, "The grid", and the cells tests/commands/test_fp8_grid.py checks.

Each case is a residual MLP (`inp`, `blocks.0` ... `blocks.{depth-1}`, `out`) classifying
directions. One block, `blocks.{position}`, sees its input with a per-sample scale drawn from
10**-decades to 1 (and scales each sample back to unit length after it, so the class still
depends on the direction only); every other layer sees unit-length samples. Its axes:

- ``depth`` (3, 5) and ``position`` (every block: first, middle, last);
- ``decades``: 0 and 3 fit inside what e4m3 holds under one tensorwise scale (about 5.4
  decades, from 448 down to its smallest subnormal, 2**-9), so FP8 costs that block nothing
  beyond rounding; 6 and 12 do not, and the smaller samples flush to zero;
- ``seed`` (0, 1): weights and data.

The right verdict is set by the format, not by diagnose: for decades beyond e4m3's range the
planted block, and only it, is named, and the rerun without it follows O0; within the range no
layer is named. Each cell runs `ampatch diagnose --fp8 --steps 40 --json` on this script's
`train` (at diagnose's default 8 steps the reruns are too short to tell whether the fix
follows O0: the verification says "can't tell").

    python scripts/fp8_grid.py                     # the whole grid: 64 cells, ~14 min on 2 cores
    python scripts/fp8_grid.py --depth 3 --decades 0,12 --seeds 0
    python scripts/fp8_grid.py train --depth 3 --position 1 --decades 12     # one run, as a script
    ampatch diagnose --fp8 --steps 40 -- python scripts/fp8_grid.py train --depth 3 --position 1 --decades 12
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

E4M3_DECADES = math.log10(448.0 / 2.0 ** -9)  # what e4m3 holds under one scale: max over smallest subnormal
STEPS = 40   # diagnose's --steps: at its default 8 the reruns are too short to tell whether a fix follows O0
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    depth: int
    position: int
    decades: float
    seed: int = 0

    @property
    def planted(self) -> str:
        return f"blocks.{self.position}"

    @property
    def expected(self) -> list[str]:
        """The layers a right diagnosis names: the planted block when its input's range is wider
        than e4m3's under one scale, none when it fits."""
        return [self.planted] if self.decades > E4M3_DECADES else []

    def args(self) -> list[str]:
        return ["--depth", str(self.depth), "--position", str(self.position), "--decades", str(self.decades),
                "--seed", str(self.seed)]


@dataclass
class Cell:
    case: Case
    named: list[str]
    verified: bool | None  # the rerun without the named layers follows O0 (None: nothing named)
    fp8_alone_dev: float | None  # the FP8 run's deviation from O0 with every layer converted
    seconds: float
    error: str = ""

    @property
    def right(self) -> bool:
        """The named layers are the expected ones and, where some are, the rerun without them is
        judged to follow O0 (not "can't tell")."""
        return not self.error and self.named == self.case.expected and self.verified is (
            True if self.case.expected else None)


def train(argv: list[str]) -> float:
    """One training run of a case, as a user's script: `amp.initialize` at O5 (AMPATCH_* from
    outside decide FP8 and its layers, as diagnose sets them)."""
    import torch
    from torch import nn

    import ampatch as amp

    p = argparse.ArgumentParser(prog="fp8_grid.py train")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--position", type=int, default=1)
    p.add_argument("--decades", type=float, default=12.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--opt-level", default="O5")
    a = p.parse_args(argv)
    if not 0 <= a.position < a.depth:
        p.error(f"--position must name one of the {a.depth} blocks (0 to {a.depth - 1})")

    class Planted(nn.Module):
        def __init__(self, width: int = 128) -> None:
            super().__init__()
            self.inp = nn.Linear(64, width)
            # the planted block has no bias: a bias would drown its smallest samples in any precision
            self.blocks = nn.ModuleList(nn.Linear(width, width, bias=i != a.position) for i in range(a.depth))
            self.out = nn.Linear(width, 16)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            h = nn.functional.normalize(torch.relu(self.inp(x)), dim=-1) * 4
            for i, block in enumerate(self.blocks):
                if i == a.position:
                    h = nn.functional.normalize(block(h * scale), dim=-1, eps=1e-30) * 4
                else:
                    h = h + torch.relu(block(h))
            return self.out(h)

    torch.manual_seed(a.seed)
    model = Planted()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=a.opt_level)
    gen = torch.Generator().manual_seed(a.seed)
    directions = torch.randn(64, 16, generator=gen)
    loss = torch.tensor(float("nan"))
    for _ in range(a.steps):
        x = torch.randn(256, 64, generator=gen)
        scale = 10.0 ** (-a.decades * torch.rand(256, 1, generator=gen))
        loss = nn.functional.cross_entropy(model(x, scale), (x @ directions).argmax(-1))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    print(f"final loss {loss.item():.4f}")
    return loss.item()


def cell(case: Case, timeout: float = 600, steps: int = STEPS) -> Cell:
    """Diagnose one case in a child process, as a user runs it (`diagnose --steps steps`), and
    read its JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "diagnosis.json"
        proc = subprocess.run([sys.executable, "-m", "ampatch", "diagnose", "--fp8", "--steps", str(steps),
                               "--json", str(out), "--", sys.executable, str(Path(__file__).resolve()), "train",
                               *case.args()],
                              env=env, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            return Cell(case, [], None, None, seconds, error=(proc.stderr or proc.stdout)[-400:])
        d = json.loads(out.read_text())
    verification = d.get("verification") or {}
    named = list((d.get("recommendation") or {}).get("fp8_exclude") or [])
    alone = verification.get("without") or {}
    return Cell(case, named, verification.get("follows_O0") if named else None,
                alone.get("max_dev_vs_O0"), seconds)


def cases(depths: list[int], decades: list[float], seeds: list[int]) -> list[Case]:
    """Every block of every depth, first, middle and last among them."""
    return [Case(depth, position, dec, seed) for depth in depths for position in range(depth)
            for dec in decades for seed in seeds]


def table(cells: list[Cell]) -> str:
    rows = ["| depth | planted | decades | seed | expected | named | fix follows O0 | FP8 everywhere: dev vs O0 "
            "| right |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        dev = "-" if c.fp8_alone_dev is None else f"{100 * c.fp8_alone_dev:.1f}%"
        fix = {None: "-", True: "yes", False: "no"}[c.verified]
        rows.append(f"| {c.case.depth} | {c.case.planted} | {c.case.decades:g} | {c.case.seed} | "
                    f"{', '.join(c.case.expected) or 'none'} | {', '.join(c.named) or 'none'} | {fix} | {dev} | "
                    f"{'yes' if c.right else 'NO' + (': ' + c.error if c.error else '')} |")
    right = sum(c.right for c in cells)
    rows.append(f"\n{right} of {len(cells)} cells right.")
    return "\n".join(rows)


def summary(cells: list[Cell]) -> str:
    """The grid folded over seeds, for docs/fp8.md: per planted block and input range, what was
    named (and in how many seeds), whether each fix was judged to follow O0, and FP8
    everywhere's largest deviation from O0."""
    decades = sorted({c.case.decades for c in cells})
    rows = ["| depth | planted | " + " | ".join(f"{d:g} decades" for d in decades) + " |",
            "|---|---|" + "---|" * len(decades)]
    for depth, position in sorted({(c.case.depth, c.case.position) for c in cells}):
        out = []
        for d in decades:
            group = [c for c in cells if (c.case.depth, c.case.position, c.case.decades) == (depth, position, d)]
            names = {", ".join(c.named) or "none" for c in group}
            text = " / ".join(sorted(names)) + f" ({len(group)}/{len(group)})" if len(names) == 1 else " / ".join(
                sorted(names))
            if any(c.named for c in group):
                fixed = sum(c.verified is True for c in group)
                worst = max((c.fp8_alone_dev or 0.0) for c in group)
                text += f"; fix follows O0 {fixed}/{len(group)}; FP8 everywhere up to {100 * worst:.0f}% off"
            if not all(c.right for c in group):
                text += " **wrong**"
            out.append(text)
        rows.append(f"| {depth} | blocks.{position} | " + " | ".join(out) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        train(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", default="3,5", help="comma-separated depths (default 3,5)")
    p.add_argument("--decades", default="0,3,6,12", help="comma-separated input ranges in decades")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--json", help="write the cells as JSON here")
    p.add_argument("--from-json", help="print the tables of cells written by --json, running nothing")
    a = p.parse_args(argv)
    if a.from_json:
        loaded = [Cell(Case(c["depth"], c["position"], c["decades"], c["seed"]), c["named"], c["verified"],
                       c["fp8_alone_dev"], 0.0, c["error"]) for c in json.loads(Path(a.from_json).read_text())]
        print(table(loaded) + "\n\n" + summary(loaded))
        return 0 if all(c.right for c in loaded) else 1
    todo = cases([int(v) for v in a.depth.split(",")], [float(v) for v in a.decades.split(",")],
                 [int(v) for v in a.seeds.split(",")])
    done = []
    for i, case in enumerate(todo, 1):
        c = cell(case)
        done.append(c)
        print(f"[{i}/{len(todo)}] depth {case.depth} {case.planted} decades {case.decades:g} seed {case.seed}: "
              f"named {c.named or 'none'} ({'right' if c.right else 'WRONG'}, {c.seconds:.0f} s)", flush=True)
    print(table(done))
    print()
    print(summary(done))
    if a.json:
        Path(a.json).write_text(json.dumps([{**vars(c.case), "named": c.named, "verified": c.verified,
                                             "fp8_alone_dev": c.fp8_alone_dev, "right": c.right, "error": c.error}
                                            for c in done], indent=1))
    return 0 if all(c.right for c in done) else 1


if __name__ == "__main__":
    sys.exit(main())
