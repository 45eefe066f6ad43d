"""O1 policy for ``torch.nn.functional`` (``F.linear``, ``F.softmax``, losses, ...).

``torch.nn`` modules call these (``nn.Linear`` -> ``F.linear``, ``nn.CrossEntropyLoss`` ->
``F.cross_entropy``), looking them up on the module at call time, and the functions
defined in Python here call each other through the module's globals, which patching
replaces too. So a composite such as ``F.multi_head_attention_forward`` is covered by the
pieces it calls (``linear``, ``softmax``, ``scaled_dot_product_attention`` here, and
``torch.bmm``/``torch.baddbmm`` in the torch namespace) and is deliberately not listed.

Not listed on purpose:
- ``batch_norm`` and ``instance_norm``: they take a half input with FP32 weights and
  return the input's dtype, with FP32 statistics.
- ``embedding``: an index lookup; the output follows the weight.
- ``linear_cross_entropy`` (new in torch 2.13): by default it is ``linear`` then
  ``cross_entropy``, both patched; its chunked path (``options=...``) manages its own
  accumulation dtype and accepts mixed dtypes.
- ``gumbel_softmax`` and the deprecated ``upsample``/``upsample_nearest``/
  ``upsample_bilinear``: they reach ``Tensor.softmax`` / ``interpolate``, which are patched.
- ``grouped_mm``, ``scaled_mm``, ``scaled_grouped_mm``: explicit low-precision GEMM APIs
  with their own dtype contract (float8 scales); casting their arguments would break it.
"""
from __future__ import annotations

# Deliberate differences
# ----------------------
# From the torch.autocast op reference (CUDA and CPU lists):
# - binary_cross_entropy is BANNED for half inputs (raises with the fix; FP32 inputs run, as
#   in Apex, since there is nothing to protect). CUDA autocast refuses it for every input;
#   CPU autocast runs it in FP32. allow_banned=True runs it in FP32 here too.
# - softmin, normalize, local_response_norm, multilabel_soft_margin_loss,
#   gaussian_nll_loss, triplet_margin_with_distance_loss, pairwise_distance, ctc_loss and
#   cross_entropy are FLOAT as functions (autocast covers some only through the kernels
#   they call, or only on CPU).
# - interpolate is FLOAT as a whole (autocast: the upsample_* kernels, CUDA list only);
#   the deprecated upsample/upsample_nearest/upsample_bilinear call it and are covered.
# - grid_sample is FLOAT: its sampling coordinates need more than bfloat16's 8 bits (just
#   below 1.0 a bfloat16 step is 2**-8, a whole pixel of a 512-wide image). Autocast: FP32
#   on CPU, promote on CUDA.
# - embedding_bag is PROMOTE: it fails with mixed dtypes (per_sample_weights); autocast
#   does not list it.
# - avg_pool3d is CPU_FLOAT (FP32 when its input is on the CPU): it has no bfloat16/float16
#   CPU kernel; lp_pool3d calls it. Autocast: in the CPU FP32 list. The other pooling and
#   padding ops of that list have half CPU kernels on torch 2.13 (max_pool3d,
#   adaptive_avg/max_pool3d, fractional_max_pool3d, max_unpool3d, reflection and
#   replication pads; tests run each one in both half dtypes), so they are left alone.
# From Apex amp (functional_overrides.py):
# - Added to HALF: prelu, scaled_dot_product_attention.
# - Added to FLOAT: rms_norm, pdist, pairwise_distance, gaussian_nll_loss, huber_loss,
#   ctc_loss, triplet_margin_with_distance_loss.
# - bilinear is PROMOTE here (Apex: a promote cast in the torch namespace only).

HALF: tuple[str, ...] = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "linear",
    "prelu",
    "scaled_dot_product_attention",
)

FLOAT: tuple[str, ...] = (
    # softmax family and smooth activations with exp/log inside
    "softmax",
    "log_softmax",
    "softmin",
    "softplus",
    # normalization (batch_norm / instance_norm deliberately absent, see the docstring)
    "layer_norm",
    "group_norm",
    "rms_norm",
    "normalize",
    "local_response_norm",
    # similarities and distances
    "cosine_similarity",
    "pairwise_distance",
    "pdist",
    # resampling
    "interpolate",
    "grid_sample",
    # losses
    "binary_cross_entropy_with_logits",
    "cosine_embedding_loss",
    "cross_entropy",
    "ctc_loss",
    "gaussian_nll_loss",
    "hinge_embedding_loss",
    "huber_loss",
    "kl_div",
    "l1_loss",
    "margin_ranking_loss",
    "mse_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "nll_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "triplet_margin_with_distance_loss",
)

# Each fails with float32 mixed with bfloat16/float16 on torch 2.13 (tests prove it).
PROMOTE: tuple[str, ...] = (
    "bilinear",
    "embedding_bag",
)

# FP32 when the input is on the CPU, where these have no half kernel; untouched elsewhere.
CPU_FLOAT: tuple[str, ...] = (
    "avg_pool3d",
)

SEQUENCE_PROMOTE: tuple[str, ...] = ()

_BCE_MESSAGE = (
    "ampatch: F.binary_cross_entropy (and torch.nn.BCELoss) is banned under O1. It takes "
    "probabilities, usually from a sigmoid that ran in half precision, where they round to "
    "exactly 0 or 1 and the loss turns into inf/NaN. Use torch.nn.BCEWithLogitsLoss or "
    "F.binary_cross_entropy_with_logits on the logits instead: they fuse the sigmoid and "
    "run in FP32. Or call amp.register_float_function(torch, \"sigmoid\") before "
    "amp.initialize so the sigmoid output is FP32. If you know the input is safe, "
    "amp.initialize(..., allow_banned=True) runs banned functions in FP32."
)

BANNED: dict[str, str] = {
    "binary_cross_entropy": _BCE_MESSAGE,
}

# No candidate in this namespace promotes natively on torch 2.13: the multi-tensor
# functionals measured (bilinear, grid_sample, embedding_bag) all fail with mixed dtypes.
NATIVELY_PROMOTING: tuple[str, ...] = ()
