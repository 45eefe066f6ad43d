"""The int8 arithmetic of optimizer_states (`optim.quant`): block-wise codes of an FP32 buffer.

- round trip: within half a grid step (1/16 of a value) of every value a block can hold, the
  block's largest magnitude kept (exactly), zeros exact, signs kept;
- coding the decoded values again gives the same codes and scales, bit for bit (a checkpoint's
  FP32 state, kept again: FSDP2's sharded optimizer state);
- what a block cannot hold (below its range) becomes zero when signed, the smallest code when
  unsigned and not zero (a second moment never reads as zero where it is not);
- large and tiny blocks (1e30, 1e-30, subnormal) and all-zero blocks do not overflow or vanish;
- NaN in a block stays NaN (as FP32 state would hold it);
- codes fit their dtypes (int8 signed, uint8 unsigned).
"""
from __future__ import annotations

import pytest
import torch

from ampatch.optim import quant

BLOCK = quant.BLOCK


def roundtrip(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(decoded values, codes as kept, absmax) of `x` (1-D, whole blocks)."""
    n = x.numel()
    work, absmax, scratch = x.clone(), torch.empty(n // BLOCK), torch.empty(n, dtype=torch.int32)
    codes = quant.quantize_(work, absmax, signed, scratch).to(quant.code_dtype(signed))
    out = torch.empty(n)
    quant.dequantize_(out, codes.to(torch.int32), absmax, signed, scratch)
    return out, codes, absmax


def wide(n: int, signed: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 1.5)
    return x if signed else x.square()


@pytest.mark.parametrize("signed", [True, False])
def test_roundtrip_is_within_half_a_grid_step_and_keeps_each_block_largest(signed):
    x = wide(64 * BLOCK, signed)
    out, codes, absmax = roundtrip(x, signed)
    top = x.abs().view(-1, BLOCK).amax(1)
    assert torch.equal(absmax, top)
    assert torch.equal(out.abs().view(-1, BLOCK).amax(1), top)
    # values within the block's range (1e-4 of its largest for signed, 1e-8 unsigned): 3 mantissa bits
    held = x.abs() >= top.repeat_interleave(BLOCK) * (1e-4 if signed else 1e-8)
    rel = ((out - x).abs() / x.abs())[held]
    assert float(rel.max()) <= 1 / 16 + 1e-6
    assert bool(((out > 0) == (x > 0))[held].all())
    assert codes.dtype == (torch.int8 if signed else torch.uint8)


@pytest.mark.parametrize("signed", [True, False])
def test_zeros_stay_zero_and_what_a_block_cannot_hold_is_zero_or_its_smallest_code(signed):
    x = torch.zeros(4 * BLOCK)
    x[BLOCK] = 1.0
    x[BLOCK + 1] = 1e-15   # far below the block's range (about 2e-6 signed, 1e-10 unsigned)
    x[2 * BLOCK + 5] = -3.0 if signed else 3.0
    out, codes, absmax = roundtrip(x, signed)
    assert float(absmax[0]) == 0 and torch.equal(out[:BLOCK], torch.zeros(BLOCK))
    assert float(out[BLOCK]) == 1.0 and float(out[2 * BLOCK + 5]) == float(x[2 * BLOCK + 5])
    if signed:
        assert float(out[BLOCK + 1]) == 0.0 and int((out != 0).sum()) == 2
    else:  # a second moment is never read as zero where it is not: held at the smallest code
        assert int(codes[BLOCK + 1]) == 1 and 0 < float(out[BLOCK + 1]) < 1e-10
        assert int((out != 0).sum()) == 3


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("scale", [1e30, 1e12, 1e-12, 1e-30, 1e-40])
def test_large_and_tiny_blocks_keep_their_values(signed, scale):
    x = wide(8 * BLOCK, signed, seed=1)
    x = x / x.abs().max() * scale
    out, _, _ = roundtrip(x, signed)
    top = x.abs().view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)
    # a block of subnormals scales as if its largest were the smallest normal number (and keeps the bits it has)
    held = x.abs() >= top.clamp(min=torch.finfo(torch.float32).tiny) * 1e-3
    assert bool(torch.isfinite(out).all())
    tol = 1 / 16 + 1e-6 if scale > 1e-38 else 0.5
    assert float(((out - x).abs() / x.abs())[held].max()) <= tol


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("scale", [1e30, 1.0, 1e-30, 1e-40])
def test_coding_decoded_values_again_gives_the_same_codes_and_scales(signed, scale):
    x = wide(64 * BLOCK, signed, seed=2) * scale
    x[::97] = 0.0
    out, codes, absmax = roundtrip(x, signed)
    again, codes2, absmax2 = roundtrip(out, signed)
    assert torch.equal(codes, codes2) and torch.equal(absmax, absmax2) and torch.equal(out, again)


def test_nan_in_a_block_stays_nan():
    x = wide(2 * BLOCK, True)
    x[3] = float("nan")
    out, _, _ = roundtrip(x, True)
    assert bool(torch.isnan(out[:BLOCK]).any()) and bool(torch.isfinite(out[BLOCK:]).all())


def test_an_unsigned_block_holds_nine_decades_a_signed_one_four():
    """The range each kind holds below its block's largest at full precision (then a few codes
    more, coarser): what tune's planted case exceeds."""
    for signed, below, lost in ((True, 5e-5, 1e-6), (False, 1e-9, 1e-13)):
        x = torch.zeros(BLOCK)
        x[0], x[1], x[2] = 1.0, below, lost
        out, _, _ = roundtrip(x, signed)
        assert float(out[1]) == pytest.approx(below, rel=1 / 16)
        assert float(out[2]) == 0.0 if signed else float(out[2]) > 1e2 * lost  # unsigned: the smallest code
