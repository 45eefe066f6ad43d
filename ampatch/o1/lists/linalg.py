"""O1 policy for ``torch.linalg`` (``torch.linalg.matmul``, ``multi_dot``, norms, solvers).

These are separate objects from their torch-namespace look-alikes (``torch.linalg.matmul``
is not ``torch.matmul``), so patching ``torch`` does not cover them. GEMM-like ops run in
half; norms, decompositions and solvers run in FP32 (most have no half kernels at all, and
they need the precision); ``cross`` promotes.

Not listed: ``diagonal`` (a view), ``matrix_power`` and ``vander`` (output follows the
input, as ``torch.matrix_power`` does).
"""
from __future__ import annotations

# Deliberate differences
# ----------------------
# From the torch.autocast op reference:
# - matmul is listed explicitly (autocast reaches it through aten::matmul).
# - Norms, decompositions and solvers are FLOAT on every device. Autocast differs per device
#   (measured on torch 2.13, CPU): linalg_vector_norm / linalg_matrix_norm are FP32 only in
#   its CUDA lists (the "set dtype" list); CPU autocast does not register them, so a bfloat16
#   input stays bfloat16 there, as for linalg.norm, det and matrix_exp. Most decompositions
#   and solvers (inv, svd, cholesky, qr, eigh, solve, lstsq, cond) are FP32 in the CPU list.
# - cross is PROMOTE (autocast: linalg_cross is not listed; it fails with mixed dtypes).
# From Apex amp: Apex predates torch.linalg and patched none of it.

HALF: tuple[str, ...] = (
    "matmul",
    "multi_dot",
    "vecdot",
)

FLOAT: tuple[str, ...] = (
    # norms
    "norm",
    "vector_norm",
    "matrix_norm",
    "cond",
    # determinants and inverses
    "det",
    "slogdet",
    "inv",
    "inv_ex",
    "pinv",
    "tensorinv",
    "matrix_rank",
    "matrix_exp",
    # solvers
    "solve",
    "solve_ex",
    "solve_triangular",
    "tensorsolve",
    "lstsq",
    "lu_solve",
    "ldl_solve",
    # decompositions
    "cholesky",
    "cholesky_ex",
    "lu",
    "lu_factor",
    "lu_factor_ex",
    "ldl_factor",
    "ldl_factor_ex",
    "qr",
    "householder_product",
    "eig",
    "eigh",
    "eigvals",
    "eigvalsh",
    "svd",
    "svdvals",
)

# Fails with float32 mixed with bfloat16/float16 on torch 2.13 (tests prove it).
PROMOTE: tuple[str, ...] = (
    "cross",
)

SEQUENCE_PROMOTE: tuple[str, ...] = ()

BANNED: dict[str, str] = {}

# No candidate here promotes natively: vecdot and solve fail with mixed dtypes too, and
# are covered by HALF / FLOAT.
NATIVELY_PROMOTING: tuple[str, ...] = ()
