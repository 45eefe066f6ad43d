"""The files of ampatch that an O2 training step runs, with their line counts: the path a
reader follows from `amp.initialize` through `amp.scale_loss` to `optimizer.step()`.

    python scripts/o2_path.py            # the table, then "N files, M lines"
    python scripts/o2_path.py --level O5
    python scripts/o2_path.py --steps    # only the training iterations, after initialize

A profiler hook notes every ampatch function called between `initialize` and the third
`optimizer.step()` of a small MLP with AdamW on the CPU, at the default verbosity (the model
and optimizer are built before it starts; `import ampatch` is not counted). Two measures:
the files whole (what a reader opens), and the lines of the functions that ran in them
(what the reader follows: each outermost function or method that ran, docstring included).
"""
from __future__ import annotations

import argparse
import ast
import collections
import os
import sys

import torch

import ampatch as amp


def path_files(level: str, functions: set | None = None, steps_only: bool = False) -> dict[str, int]:
    """{file relative to the package: calls} for one initialize + 3 steps at `level` (only the
    steps with `steps_only`); the (file, first line, qualified name) of every function that ran
    are added to `functions`."""
    functions = set() if functions is None else functions
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = os.path.dirname(amp.__file__)
    calls: collections.Counter[str] = collections.Counter()

    def hook(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls[os.path.relpath(frame.f_code.co_filename, root)] += 1
            functions.add((os.path.relpath(frame.f_code.co_filename, root), frame.f_code.co_firstlineno,
                           frame.f_code.co_qualname))

    if not steps_only:
        sys.setprofile(hook)
    try:
        model, opt = amp.initialize(model, opt, opt_level=level)  # default verbosity: its advice too
        sys.setprofile(hook)
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
    finally:
        sys.setprofile(None)
        amp.deinitialize()
    return dict(calls)


def followed_lines(source: str, first_lines: set[int]) -> int:
    """Lines of the outermost functions and methods of `source` whose code objects start at
    one of `first_lines` (a nested function that ran counts with its outer one)."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            if node.lineno in first_lines or start in first_lines:
                spans.append((start, node.end_lineno))
    covered: set[int] = set()
    for start, end in spans:
        covered.update(range(start, end + 1))
    return len(covered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", default="O2")
    parser.add_argument("--steps", action="store_true", help="only the training iterations (initialize left out)")
    parser.add_argument("--functions", action="store_true", help="list the functions that ran, by file")
    args = parser.parse_args()
    root = os.path.dirname(amp.__file__)
    ran: set[tuple[str, int, str]] = set()
    files = path_files(args.level, ran, steps_only=args.steps)
    if args.functions:
        for name, _, fn in sorted(ran):
            print(f"  ampatch/{name}: {fn}")
    total = followed_total = 0
    print(" file  ran  path")
    for name in sorted(files):
        source = open(os.path.join(root, name)).read()
        n = len(source.splitlines())
        followed = followed_lines(source, {line for f, line, _ in ran if f == name})
        total += n
        followed_total += followed
        print(f"{n:5d} {followed:4d}  ampatch/{name}")
    print(f"{len(files)} files, {total} lines; {followed_total} lines in the functions that ran")


if __name__ == "__main__":
    main()
