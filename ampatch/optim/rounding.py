"""The arithmetic of the low-memory master modes, apart from their bookkeeping (`lowmem`).

- `stochastic_round_`: an FP32 buffer rounded, in place, to values bfloat16 holds exactly,
  up or down with probabilities that make the rounding unbiased (E[round(x)] = x), from a
  `torch.Generator` of the caller's (never the global RNG), its draws shifted by
  `rotation(step)` so that one element's thresholds over the steps are evenly spread.

How the steps are cut into chunks is `chunks`.
"""
from __future__ import annotations

import torch

__all__ = ["stochastic_round_", "rotation"]

_LOW_BITS = 1 << 16      # the FP32 bits bfloat16 drops: the low half of the word
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32


# 2**16 / golden ratio, odd: the additive recurrence k * GOLDEN_STEP mod 2**16 visits every
# 16-bit value once per 65536 steps and spreads any run of consecutive ones evenly.
GOLDEN_STEP = 40503


def rotation(step: int) -> int:
    """The shift `stochastic_round_` adds to its draws at optimizer step `step` (0..65535)."""
    return (step * GOLDEN_STEP) & (_LOW_BITS - 1)


def stochastic_round_(flat: torch.Tensor, noise: torch.Tensor, generator: torch.Generator,
                      shift: int = 0) -> torch.Tensor:
    """Round the FP32 values of `flat` (1-D, contiguous) in place to bfloat16-exact values,
    stochastically: a uniform 16-bit threshold per element, (draw + `shift`) mod 2**16, is added
    below bfloat16's last bit, then the low half of each word is cleared, so x goes up one
    bfloat16 ulp with probability (dropped part / ulp): unbiased for any shift.

    Why the shift: the caller reseeds `generator` alike at every step, so each element draws
    the same number every step, and shifts it by `rotation(step)`. Each step's threshold is
    still uniform (the draw is), but one element's thresholds over the steps are a randomly
    started golden-ratio sequence instead of independent draws: an update of a tenth of an ulp
    per step goes up about once in every ten steps, not at random, so the rounding error a
    weight accumulates stays near one ulp instead of growing as the square root of the steps
    (measured: 5-10x closer to FP32-master training on the fine-tuning tests).

    Works on the sign-magnitude bits, so negative values round symmetrically; a value that
    rounds past the largest finite bfloat16 becomes inf, as round-to-nearest would. `noise`:
    a scratch buffer of at least `flat.numel()` 4-byte elements (overwritten). Returns
    `flat`, whose `.to(torch.bfloat16)` is now exact."""
    n = flat.numel()
    bits = flat.view(torch.int32)
    r = noise.view(-1)[:n].view(torch.int32)
    # random_() over int32's whole range (31 uniform bits) is ~2.5x faster on CPU than
    # random_(0, 2**16), whose range reduction costs a division per element; its low 16 bits
    # are uniform all the same
    r.random_(generator=generator).bitwise_and_(_LOW_BITS - 1)
    if shift:
        r.add_(shift).bitwise_and_(_LOW_BITS - 1)
    bits.add_(r).bitwise_and_(_HIGH_MASK)
    return flat
