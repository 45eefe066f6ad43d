"""The arithmetic of the low-memory master modes, apart from their bookkeeping (`lowmem`).

- `thresholds_`: 16-bit rounding thresholds for a run of a parameter's elements, a hash of
  (seed, parameter, element index in the whole parameter): the same element gets the same
  draw wherever it is stepped (on any rank holding it, in any chunk), different elements
  independent-looking ones; shifted by `rotation(step)`;
- `round_with_`: an FP32 buffer rounded, in place, to values bfloat16 holds exactly, up or
  down with probabilities that make the rounding unbiased (E[round(x)] = x);
- `stochastic_round_`: both in one call.

No RNG is drawn from (the global one least of all). How the steps are cut into chunks is `chunks`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["stochastic_round_", "thresholds_", "round_with_", "rotation", "stream"]

_LOW_BITS = 1 << 16      # the FP32 bits bfloat16 drops: the low half of the word
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # odd 64-bit constants
# the hash's multipliers, 0x9E3779B1 and 0x85EBCA6B, as the int32 values whose product wraps alike
_M1, _M2 = -1640531535, -2048144789


# 2**16 / golden ratio, odd: the additive recurrence k * GOLDEN_STEP mod 2**16 visits every
# 16-bit value once per 65536 steps and spreads any run of consecutive ones evenly.
GOLDEN_STEP = 40503


def rotation(step: int) -> int:
    """The shift added to every threshold at optimizer step `step` (0..65535)."""
    return (step * GOLDEN_STEP) & (_LOW_BITS - 1)


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def stream(seed: int, ordinal: int) -> tuple[int, int]:
    """The two 32-bit keys of the thresholds of the `ordinal`-th parameter under `seed`."""
    mixed = (seed * _MIX[0] + ordinal * _MIX[1]) % (1 << 64)
    return mixed & 0xFFFFFFFF, (mixed * _MIX[2] >> 32) & 0xFFFFFFFF


def thresholds_(r: torch.Tensor, scratch: torch.Tensor, runs: Sequence[tuple[int, tuple[int, int], int]],
                shift: int = 0) -> torch.Tensor:
    """Fill `r` (int32, contiguous) with 16-bit thresholds, plus `shift`, mod 2**16: `runs` are
    its consecutive parts, each (n, keys, first): the thresholds of elements `first` ..
    `first` + n of the parameter whose `stream` is `keys`. `scratch`: int32, as long as `r`
    (overwritten).

    The hash, in int32 arithmetic that wraps: x = (index + k1) * M1; x ^= x >> 16; x += k2;
    x *= M2; threshold = x >> 16 (logical shifts): a multiply-xorshift mix, vectorized over
    the whole of `r` but for two adds per run, about 3x cheaper than drawing from torch's CPU
    generator (a Mersenne Twister, ~4 ns per element), and a function of the element alone."""
    s = scratch.view(-1)[:r.numel()]
    torch.arange(r.numel(), out=r)
    o = 0
    for n, keys, first in runs:
        r[o:o + n].add_(_int32(keys[0] + first - o))
        o += n
    r.mul_(_M1)
    torch.bitwise_right_shift(r, 16, out=s).bitwise_and_(_LOW_BITS - 1)
    r.bitwise_xor_(s)
    o = 0
    for n, keys, _ in runs:
        r[o:o + n].add_(_int32(keys[1]))
        o += n
    r.mul_(_M2).bitwise_right_shift_(16).bitwise_and_(_LOW_BITS - 1)
    if shift:
        r.add_(shift).bitwise_and_(_LOW_BITS - 1)
    return r


def round_with_(flat: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Round the FP32 values of `flat` (1-D, contiguous) in place to bfloat16-exact values with
    the thresholds `r` (int32, as many, from `thresholds_`): each threshold is added below
    bfloat16's last bit, then the low half of each word is cleared, so x goes up one bfloat16
    ulp with probability (dropped part / ulp) for a uniform threshold. Works on the
    sign-magnitude bits, so negative values round symmetrically; a value that rounds past the
    largest finite bfloat16 becomes inf, as round-to-nearest would. Returns `flat`, whose
    `.to(torch.bfloat16)` is now exact."""
    bits = flat.view(torch.int32)
    bits.add_(r).bitwise_and_(_HIGH_MASK)
    return flat


def stochastic_round_(flat: torch.Tensor, keys: tuple[int, int], shift: int = 0, first: int = 0,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Round the FP32 values of `flat` (1-D, contiguous) in place to bfloat16-exact values,
    stochastically, with the thresholds of elements `first`.. of stream `keys` (`thresholds_`)
    shifted by `shift`. `scratch`: int32, at least twice `flat`'s elements (made if None).

    Why the shift: each element draws the same threshold every step, shifted by
    `rotation(step)`. Each step's threshold is still uniform over the elements, but one
    element's thresholds over the steps are a golden-ratio sequence from a random start
    instead of independent draws: an update of a tenth of an ulp per step goes up about once
    in every ten steps, not at random, so the rounding error a weight accumulates stays near
    one ulp instead of growing as the square root of the steps (measured: 5-10x closer to
    FP32-master training on the fine-tuning tests), and whatever unevenness the hash has
    across elements averages out over the steps."""
    n = flat.numel()
    if scratch is None:
        scratch = torch.empty(2 * n, dtype=torch.int32, device=flat.device)
    r, s = scratch.view(-1)[:n], scratch.view(-1)[n:2 * n]
    return round_with_(flat, thresholds_(r, s, [(n, keys, first)], shift))
