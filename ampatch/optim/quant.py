"""The arithmetic of `optimizer_states="int8"`: block-wise 8-bit codes of an FP32 buffer, apart
from their bookkeeping (`states`).

A block of `BLOCK` elements keeps its largest magnitude (`absmax`, FP32, exact: a change the
whole block shares is never lost) and one byte per element for the element's value relative
to it, on a logarithmic grid (a small float: 3 mantissa bits, so about 6% apart everywhere,
as the dynamic quantization of bitsandbytes and torchao spends its codes, without their
lookup table). Signed tensors (a first moment) spend a bit on the sign: 4 exponent bits, down
to about 2e-6 of the block's largest; unsigned ones (a second moment) 5, down to about
1e-10. A smaller signed value rounds to zero (what a block cannot hold: its update stops);
a smaller unsigned one that is not zero is held at the smallest code, never at zero (an
optimizer divides by a second moment: m / (sqrt(0) + eps) would throw the weight far).

The grid is FP32's own bit pattern cut down: a value scaled so that the block's largest is
the largest code, shifted right by 20 bits (after adding half of the dropped part: round to
nearest), is its code; a code shifted left by 20 bits is an FP32 number again (the lowest
binade as FP32 subnormals, zero as zero). So both directions are a handful of integer ops on
a whole chunk, no table, no search: what keeps the chunked step's overhead small.
"""
from __future__ import annotations

import torch

__all__ = ["BLOCK", "MIN_NUMEL", "blocks", "aligned", "quantize_", "dequantize_", "code_dtype"]

BLOCK = 256        # elements per scale
MIN_NUMEL = 4096   # smaller tensors keep FP32 state (their scales would cost more than they save)

_SHIFT = 20                  # FP32 bits dropped: 23 mantissa bits kept down to 3
_HALF = 1 << (_SHIFT - 1)    # added before the shift: round to nearest
_MAGNITUDE = 0x7FFFFFFF
_SIGN = -(1 << 31)           # 0x80000000 as an int32
_TOP = {True: 127, False: 255}  # the largest code of each kind
# A block's largest magnitude scales to 1.875 (the largest mantissa of 3 bits), then by a power
# of two to the bits of the largest code, the binades below it down to FP32's subnormals (two
# multiplies: one product of both would overflow or underflow for large or small blocks)
_MANTISSA = 1.875
_EXPONENT = {True: 2.0 ** -112, False: 2.0 ** -96}
_TINY = torch.finfo(torch.float32).tiny


def code_dtype(signed: bool) -> torch.dtype:
    """The dtype codes are kept in: int8 (sign and magnitude, as their bits) or uint8."""
    return torch.int8 if signed else torch.uint8


def blocks(n: int) -> int:
    """Blocks (scales) of a tensor of `n` elements."""
    return -(-n // BLOCK)


def aligned(n: int) -> int:
    """`n` rounded up to whole blocks."""
    return blocks(n) * BLOCK


def quantize_(x: torch.Tensor, absmax: torch.Tensor, signed: bool, sign: torch.Tensor) -> torch.Tensor:
    """Codes of `x` (FP32, 1-D, whole blocks; overwritten) into its own storage, as int32 (a
    view of it is returned: copy it into the kept int8/uint8 codes), and each block's largest
    magnitude into `absmax` (FP32, one per block). `sign`: int32 scratch, as long as `x`. An
    unsigned tensor's negative values (none, for a second moment) become 0."""
    bits = x.view(torch.int32)
    rows = x.view(-1, BLOCK)
    if signed:
        torch.bitwise_and(bits, _MAGNITUDE, out=sign)  # |x|'s bits: their max is the largest magnitude's
        torch.amax(sign.view(-1, BLOCK), dim=1, out=absmax.view(torch.int32))
    else:
        torch.amax(rows, dim=1, out=absmax)
    # a block of zeros keeps 0 (codes 0); one of subnormals scales as if its largest were the
    # smallest normal number; NaN stays NaN (the block decodes to NaN, as FP32 state would hold it)
    torch.where(absmax > 0, absmax.clamp(min=_TINY), absmax.clamp(min=0), out=absmax)
    rows.mul_(torch.where(absmax > 0, _MANTISSA / absmax, 0.0).unsqueeze(1))
    x.mul_(_EXPONENT[signed])
    if signed:
        torch.bitwise_right_shift(bits, 31, out=sign).bitwise_left_shift_(7)  # 0, or -128 for a negative value
        bits.bitwise_and_(_MAGNITUDE)
    else:
        torch.clamp(bits, 0, 1, out=sign)  # 1 where a value is above zero: its code is at least 1
    bits.add_(_HALF).bitwise_right_shift_(_SHIFT).clamp_(0, _TOP[signed])
    if signed:
        bits.add_(sign)  # -128 + magnitude: the byte 0x80 | magnitude
    else:
        torch.maximum(bits, sign, out=bits)
    return bits


def dequantize_(out: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                scratch: torch.Tensor) -> torch.Tensor:
    """The values of `codes` (int32, 1-D, whole blocks, as copied from the kept codes; overwritten)
    with each block's `absmax`, into `out` (FP32, as long). `scratch`: int32, as long (signed only)."""
    if signed:
        torch.bitwise_and(codes, 0x7F, out=scratch).bitwise_left_shift_(_SHIFT)
        codes.bitwise_and_(_SIGN).bitwise_or_(scratch)
    else:
        codes.bitwise_left_shift_(_SHIFT)
    # the top code reads as exactly 1.0 and then as exactly the block's largest: coding decoded
    # values again gives the same codes and scales (a checkpoint's FP32 state kept again, bit for bit)
    values = codes.view(torch.float32).mul_(1.0 / (_MANTISSA * _EXPONENT[signed])).view(-1, BLOCK)
    torch.mul(values, absmax.unsqueeze(1), out=out.view(-1, BLOCK))
    return out
