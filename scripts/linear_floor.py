"""Where the time of a patched tiny F.linear goes under O1, against torch.autocast.

Prints µs per call (best of 5 repeats) for: unpatched, autocast, ampatch O4, and the parts a
Python-level wrapper cannot avoid (the cast of the activation, the linear on cached bfloat16
weights, the cast-cache hits), plus a hand-written three-line wrapper as a lower bound.
Run: .venv/bin/python scripts/linear_floor.py
"""
from __future__ import annotations

import itertools
import timeit

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.base.patcher import cast_switch
from ampatch.session.session import current

N = 100_000


def us(fn) -> float:
    return min(timeit.repeat(fn, number=N, repeat=5)) / N * 1e6


def main() -> None:
    torch.set_num_threads(1)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    w, b = lin.weight, lin.bias
    linear = F.linear
    rows = [("unpatched F.linear", us(lambda: linear(x, w, b)))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows.append(("torch.autocast", us(lambda: F.linear(x, w, b))))
    amp.initialize(lin, opt_level="O4", verbosity=0)
    rows.append(("ampatch O4 (patched F.linear)", us(lambda: F.linear(x, w, b))))
    wg, bg = w.bfloat16(), b.bfloat16()  # cached casts carry a grad_fn, as in training
    rows.append(("floor: cast x + linear on cached bf16", us(lambda: linear(x.bfloat16(), wg, bg))))
    hit = current().cache.caster(torch.bfloat16)
    rows.append(("one cast-cache hit", us(lambda: hit(w))))
    tick = itertools.count()

    def hand(wrapped, instance, args, kwargs):
        if not cast_switch.enabled:
            return wrapped(*args)
        next(tick)
        a, weight, bias = args
        return linear(a.bfloat16(), hit(weight), hit(bias))

    rows.append(("hand-written 3-line wrapper", us(lambda: hand(linear, None, (x, w, b), {}))))
    amp.deinitialize()
    auto = rows[1][1]
    print(f"{'µs per call (best of 5)':40s} {'µs':>7s} {'/autocast':>10s}")
    for name, value in rows:
        print(f"{name:40s} {value:7.2f} {value / auto:10.2f}")


if __name__ == "__main__":
    main()
