"""O1 policy for functions in the ``torch`` namespace (``torch.mm``, ``torch.exp``, ...).

These are the functions users call directly. ``torch.nn`` modules mostly go through
``torch.nn.functional`` (see ``functional.py``), whose builtins are separate attributes
even where they are the same objects as here (``F.conv2d is torch.conv2d``), so both
namespaces list them. A function listed in both runs through two wrappers; the inner one
finds its arguments already cast and does nothing.

Every name exists on torch 2.13 (tests check it); PROMOTE entries and NATIVELY_PROMOTING
were measured there with float32 mixed with bfloat16 and with float16.
"""
from __future__ import annotations

# Deliberate differences
# ----------------------
# From the torch.autocast op reference (CUDA and CPU lists):
# - std, var, std_mean, var_mean are FLOAT (Apex's choice: a half variance overflows at
#   65504); autocast leaves them alone.
# - pairwise_distance is FLOAT like its siblings dist/pdist/cdist/cosine_similarity.
# - Decompositions and solvers without half kernels (cholesky*, inverse, det, logdet,
#   slogdet, svd, qr, lu_solve, triangular_solve, geqrf, orgqr, ormqr, pinverse,
#   matrix_exp) are FLOAT on every device; autocast lists most only for CPU.
# - complex is FLOAT like polar (no bfloat16 complex type; complex32 is barely supported).
# - HALF is the union of the CUDA and CPU lower-precision lists: one policy on every device.
# - grid_sampler is FLOAT (see grid_sample in functional.py; autocast: FP32 on CPU, promote
#   on CUDA).
# - PROMOTE keeps autocast's bilinear, dot, vdot, cross, tensordot, index_put,
#   scatter_add, and adds ops measured to fail with mixed dtypes: inner, lerp, index_copy,
#   index_add, index_reduce, scatter, scatter_reduce, masked_scatter, put, embedding_bag
#   (per_sample_weights), isclose, allclose, meshgrid, cartesian_prod.
# - addcdiv, addcmul, atan2 are not PROMOTE: they promote natively now (NATIVELY_PROMOTING).
# - CPU-only FP32 entries left out: pooling and padding kernels (max_pool3d,
#   adaptive_avg_pool3d, reflection/replication pads...: half CPU kernels exist on torch
#   2.13; avg_pool3d, which has none, is CPU_FLOAT in functional.py, its only entry point),
#   view_as_complex (a view; a cast would silently make a copy), and the torch.fft namespace
#   (not a patched namespace).
# - _transformer_encoder_layer_fwd and _native_multi_head_attention are HALF (autocast: the
#   latter is in its lower-precision lists): nn.TransformerEncoderLayer and
#   nn.MultiheadAttention call them directly for inference (eval, no grad), skipping that
#   fast path only when torch.autocast is on. Listed, the fused path runs in half with half
#   weights, as the per-op path does in training, instead of failing on a half input.
# - Deprecated aliases frobenius_norm / nuclear_norm are not listed (torch.norm and
#   torch.linalg.*_norm cover them), nor private or internal kernels (_convolution,
#   native_layer_norm, _thnn_fused_*_cell, _scaled_dot_product_flash_attention, nll_loss2d,
#   upsample_* kernels): the public entry points that reach them are listed instead (the
#   transformer fast path above is the exception: modules call it directly).
# - binary_cross_entropy is not reachable as torch.binary_cross_entropy; it is BANNED in
#   functional.py (autocast raises on CUDA and runs it in FP32 on CPU).
# From Apex amp (torch_overrides.py):
# - Added to HALF: bmm/baddbmm/addbmm unconditionally (Apex: only with CUDA >= 9.1),
#   convolution, chain_matmul, einsum, and the RNN cells (Apex patched those separately).
# - Added to FLOAT: log1p, softmax, log_softmax, logsumexp, trace, quantile, nanquantile,
#   layer_norm, group_norm, rms_norm, distances, losses, decompositions, stft/istft, polar,
#   complex, std_mean, var_mean.
# - mean is FLOAT (Apex and autocast leave it alone): a loss `out.mean()` of a half output
#   would be half, and the scaled loss's backward sends the scale (2**16 by default) into
#   that half loss, where it overflows: every first step would be skipped. As FP32 (like
#   sum) the loss and its gradient stay finite.
# - Apex CASTS add, div, mul, eq/ne/lt/le/gt/ge, equal, addcdiv, addcmul, atan2 and
#   SEQUENCE_CASTS cat, stack promote natively on current torch: no wrapper
#   (NATIVELY_PROMOTING proves it). SEQUENCE_PROMOTE is empty for that reason.
# - The full-sequence RNN functions (torch.lstm, torch.gru, torch.rnn_tanh, ...) are not
#   listed: nn.RNN/LSTM/GRU are handled at the module level (ampatch.o1.rnn).

HALF: tuple[str, ...] = (
    # convolutions
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "convolution",
    # GEMMs
    "addmm",
    "addmv",
    "addr",
    "addbmm",
    "baddbmm",
    "bmm",
    "mm",
    "mv",
    "matmul",
    "chain_matmul",
    "einsum",
    "prelu",
    # the fused inference path of nn.TransformerEncoderLayer / nn.MultiheadAttention
    "_transformer_encoder_layer_fwd",
    "_native_multi_head_attention",
    # RNN cells (nn.*Cell call them through torch._VF, see vf.py; same objects as these)
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "lstm_cell",
    "gru_cell",
)

FLOAT: tuple[str, ...] = (
    # pointwise ops whose half result loses range or precision
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "reciprocal",
    "rsqrt",
    "pow",
    # softmax
    "softmax",
    "log_softmax",
    # reductions
    "sum",
    "mean",
    "prod",
    "cumsum",
    "cumprod",
    "logsumexp",
    "std",
    "var",
    "std_mean",
    "var_mean",
    "trace",
    "quantile",
    "nanquantile",
    # norms and distances
    "norm",
    "renorm",
    "dist",
    "cdist",
    "pdist",
    "pairwise_distance",
    "cosine_similarity",
    "layer_norm",
    "group_norm",
    "rms_norm",
    # losses exposed in the torch namespace
    "binary_cross_entropy_with_logits",
    "cosine_embedding_loss",
    "ctc_loss",
    "hinge_embedding_loss",
    "kl_div",
    "margin_ranking_loss",
    "poisson_nll_loss",
    "triplet_margin_loss",
    # decompositions and solvers (no half kernels; precision-sensitive)
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "det",
    "logdet",
    "slogdet",
    "inverse",
    "pinverse",
    "svd",
    "qr",
    "geqrf",
    "orgqr",
    "ormqr",
    "lu_solve",
    "triangular_solve",
    "matrix_exp",
    # spectral and complex
    "stft",
    "istft",
    "polar",
    "complex",
    # resampling (F.grid_sample calls it)
    "grid_sampler",
)

# Each fails with float32 mixed with bfloat16/float16 on torch 2.13 (tests prove it).
# meshgrid and cartesian_prod take their tensors as separate arguments (meshgrid also
# accepts one list); the promote wrapper looks one level into list/tuple arguments.
PROMOTE: tuple[str, ...] = (
    "dot",
    "vdot",
    "inner",
    "tensordot",
    "cross",
    "bilinear",
    "lerp",
    "index_put",
    "index_copy",
    "index_add",
    "index_reduce",
    "scatter",
    "scatter_add",
    "scatter_reduce",
    "masked_scatter",
    "put",
    "embedding_bag",
    "isclose",
    "allclose",
    "meshgrid",
    "cartesian_prod",
)

# cat, stack and the *stack family promote natively (see NATIVELY_PROMOTING).
SEQUENCE_PROMOTE: tuple[str, ...] = ()

BANNED: dict[str, str] = {}

# Promote candidates that handle mixed float dtypes natively (result in the widest dtype):
# no wrapper. Kept as data so the tests keep proving it on each torch version.
# Not candidates: masked_fill / index_fill (their value is a scalar, a 0-dim tensor
# included, and the result keeps self's dtype by design), broadcast_tensors (reshapes only),
# searchsorted / bucketize (integer results).
# The functions that torch and torch.Tensor share (tensor.py lists them as methods too).
SHARED_NATIVELY_PROMOTING: tuple[str, ...] = (
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "addcmul",
    "addcdiv",
    "atan2",
    "hypot",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "clamp",
    "where",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "equal",
    "outer",
    "ger",
    "kron",
)
NATIVELY_PROMOTING: tuple[str, ...] = SHARED_NATIVELY_PROMOTING + (
    "block_diag",
    "trapezoid",
    "cat",
    "concat",
    "concatenate",
    "stack",
    "hstack",
    "vstack",
    "dstack",
    "column_stack",
    "row_stack",
)
