"""O1 policy for ``torch.Tensor`` methods and operators (``x.mm(w)``, ``x @ w``, ``x ** 2``).

Methods mirror the torch-namespace lists (``torch_ops.py``) for every name that also
exists on ``torch.Tensor`` (a test keeps them in step), plus the operators: ``@`` is
``__matmul__``/``__rmatmul__``, ``**`` is ``__pow__``/``__rpow__``, ``scalar / t`` is
``__rtruediv__`` (a reciprocal). Some names are inherited from ``torch._C.TensorBase``
(``matmul``, ``__matmul__``), others live on ``torch.Tensor`` itself (``__pow__``,
``__rpow__``, ``norm``): the mechanism records which, so restoring deletes what it added.

In-place methods (``exp_``, ``pow_``, ``addmm_``...) and in-place operators (``__ipow__``,
``__iadd__``...) are never HALF or FLOAT: the wrapper would cast ``self`` into a new tensor
and the op would write into that temporary copy, so the caller's tensor would silently
stay unchanged (``x **= 2`` would even rebind ``x`` to the copy). ``torch.autocast`` skips
in-place ops for the same reason. They can be PROMOTE: the promote wrapper casts the other
arguments to ``self``'s dtype and leaves ``self`` alone.
"""
from __future__ import annotations

from .torch_ops import SHARED_NATIVELY_PROMOTING

# Deliberate differences
# ----------------------
# From the torch.autocast op reference:
# - Same HALF/FLOAT choices as the torch namespace (see torch_ops.py), applied to methods.
# - PROMOTE covers in-place variants (index_put_, scatter_add_, lerp_, ...): autocast never
#   touches in-place ops, so with mixed dtypes they raise under autocast.
# From Apex amp (tensor_overrides.py):
# - __ipow__ is not FLOAT (in-place; see the docstring).
# - cpu is FLOAT, as in Apex ("cast to fp32 before transfer to CPU"), on every device: the
#   host copy of a half tensor is FP32, so `logits.detach().cpu().numpy()` works (numpy has
#   no bfloat16) in every evaluation loop written for Apex. numpy is FLOAT for the same reason
#   (`x.numpy()` of a CPU half tensor: Apex's float16 had a numpy dtype, bfloat16 has none).
# - __rmatmul__ is HALF and __rtruediv__/__rdiv__ are FLOAT (autocast's choice; Apex had
#   neither).
# - Apex's operator CASTS (__add__, __mul__, __truediv__, __eq__..., __iadd__...) promote
#   natively now: no wrapper (NATIVELY_PROMOTING proves it).
# Known gap: ``x[idx] = y`` (__setitem__ with a tensor index) fails with mixed dtypes like
# index_put_, but it is not listed: it mutates ``self`` without a trailing underscore, and
# the promote wrapper would treat it as out-of-place and could cast ``self`` to a copy.

HALF: tuple[str, ...] = (
    "__matmul__",
    "__rmatmul__",
    "matmul",
    "mm",
    "mv",
    "bmm",
    "baddbmm",
    "addbmm",
    "addmm",
    "addmv",
    "addr",
    "prelu",
)

FLOAT: tuple[str, ...] = (
    # host copies: FP32, as Apex's `cpu`
    "cpu",
    "numpy",
    # operators
    "__pow__",
    "__rpow__",
    "__rtruediv__",
    "__rdiv__",
    # pointwise
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
    "trace",
    "quantile",
    "nanquantile",
    # norms and distances
    "norm",
    "renorm",
    "dist",
    # decompositions and solvers
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
    # spectral
    "stft",
    "istft",
)

# Each fails with float32 mixed with bfloat16/float16 on torch 2.13 (tests prove it).
# In-place entries keep self's dtype: the wrapper casts the other arguments to it.
PROMOTE: tuple[str, ...] = (
    "dot",
    "vdot",
    "inner",
    "cross",
    "lerp",
    "lerp_",
    "index_put",
    "index_put_",
    "index_copy",
    "index_copy_",
    "index_add",
    "index_add_",
    "index_reduce",
    "index_reduce_",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "scatter_reduce",
    "scatter_reduce_",
    "masked_scatter",
    "masked_scatter_",
    "put",
    "put_",
    "isclose",
    "allclose",
)

SEQUENCE_PROMOTE: tuple[str, ...] = ()

BANNED: dict[str, str] = {}

# Promote candidates measured to handle mixed float dtypes natively (out-of-place: the
# widest dtype; in-place: self's dtype): no wrapper. masked_fill(_) / index_fill(_) are not
# candidates: their value is a scalar (a 0-dim tensor too) and the result keeps self's dtype.
NATIVELY_PROMOTING: tuple[str, ...] = SHARED_NATIVELY_PROMOTING + (
    # operators
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    # in-place
    "add_",
    "sub_",
    "mul_",
    "div_",
    "addcmul_",
    "addcdiv_",
    "atan2_",
    "hypot_",
    "copy_",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ipow__",
)
