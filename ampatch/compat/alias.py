"""The `apex` import alias: `from apex import amp` loads ampatch, for scripts that cannot be
edited (`ampatch run --apex-alias` installs it from a `sitecustomize`).

Under the alias `apex.amp` is ampatch itself, and `apex.parallel`, `apex.optimizers`,
`apex.normalization`, `apex.fp16_utils`, `apex.multi_tensor_apply` (and `apex.testing`, which
Apex's own tests import) are ampatch's thin adapters over PyTorch. Everything else of Apex
(`apex.contrib`, its compiled extensions `amp_C`, `apex_C`, ...) fails to import with an
`ImportError` that says ampatch does not provide it and names the PyTorch replacement; the
message survives `from X import Y`, which swallows a `ModuleNotFoundError` for the name it
asked for. Nothing is installed when a real `apex` is importable: that one wins.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
import warnings
from typing import Any

logger = logging.getLogger("ampatch")

_ALIAS_FLAG = "__ampatch_alias__"
_README = "see 'Coming from Apex' in ampatch's README"

# Apex module -> the ampatch module that stands in for it under the alias.
PROVIDED = {
    "apex.amp": "ampatch",
    "apex.amp._amp_state": "ampatch.compat.state",
    "apex.parallel": "ampatch.compat.parallel",
    "apex.parallel.LARC": "ampatch.compat.larc",
    "apex.optimizers": "ampatch.compat.optimizers",
    "apex.normalization": "ampatch.compat.normalization",
    "apex.fp16_utils": "ampatch.compat.fp16_utils",
    "apex.multi_tensor_apply": "ampatch.compat.multi_tensor_apply",
    "apex.testing": "ampatch.compat.testing",
    "apex.testing.common_utils": "ampatch.compat.testing",
    # Apex's own module names inside those packages, which some scripts import from
    "apex.parallel.distributed": "ampatch.compat.parallel",
    "apex.parallel.sync_batchnorm": "ampatch.compat.parallel",
    "apex.parallel.optimized_sync_batchnorm": "ampatch.compat.parallel",
    "apex.optimizers.fused_adam": "ampatch.compat.optimizers",
    "apex.optimizers.fused_sgd": "ampatch.compat.optimizers",
    "apex.optimizers.fused_adagrad": "ampatch.compat.optimizers",
    "apex.optimizers.fused_lamb": "ampatch.compat.optimizers",
    "apex.optimizers.fused_novograd": "ampatch.compat.optimizers",
    "apex.normalization.fused_layer_norm": "ampatch.compat.normalization",
    "apex.fp16_utils.fp16util": "ampatch.compat.fp16_utils",
    "apex.fp16_utils.fp16_optimizer": "ampatch.compat.fp16_utils",
    "apex.fp16_utils.loss_scaler": "ampatch.compat.fp16_utils",
    "apex.multi_tensor_apply.multi_tensor_apply": "ampatch.compat.multi_tensor_apply",
}

# What ampatch does not provide, and what replaces it in PyTorch (most specific prefix wins).
NOT_PROVIDED = {
    "apex.amp": "Apex's amp internals are not provided; `from apex import amp` gives ampatch's public API "
                f"(initialize, scale_loss, _amp_state, init, ...), {_README}",
    "apex.contrib": "use PyTorch's own: torch.nn.functional.scaled_dot_product_attention (fmha, multihead_attn), "
                    "torch.optim with fused=True (contrib optimizers), "
                    "torch.distributed.optim.ZeroRedundancyOptimizer (DistributedFusedAdam/LAMB), "
                    "torch.nn.functional.cross_entropy(label_smoothing=...) (xentropy), "
                    "torch.nn.GroupNorm / torch.nn.SyncBatchNorm (group_norm, groupbn)",
    "apex.transformer": "use torch.distributed.tensor (tensor parallelism) or Megatron-Core",
    "apex.mlp": "use torch.nn.Sequential of torch.nn.Linear layers",
    "apex.fused_dense": "use torch.nn.Linear (torch.compile fuses the bias and activation)",
    "apex.extensions": "Apex's compiled CUDA extensions are not provided; use torch._foreach_* ops and "
                       "torch.optim's fused=True / foreach=True",
    "apex": f"only apex.amp, apex.parallel, apex.optimizers, apex.normalization, apex.fp16_utils and "
            f"apex.multi_tensor_apply are provided, {_README}",
}
_KERNELS = "Apex's compiled CUDA kernels are not provided; "
EXTENSIONS = {
    "amp_C": _KERNELS + "use torch._foreach_* ops (e.g. torch._foreach_mul_, torch._foreach_norm) and "
                        "torch._amp_foreach_non_finite_check_and_unscale_, or torch.optim's fused=True/foreach=True",
    "apex_C": _KERNELS + "use torch._utils._flatten_dense_tensors / _unflatten_dense_tensors",
    "syncbn": _KERNELS + "use torch.nn.SyncBatchNorm",
    "fused_layer_norm_cuda": _KERNELS + "use torch.nn.functional.layer_norm / rms_norm",
    "fused_adam_cuda": _KERNELS + "use torch.optim.AdamW(fused=True)",
    "fused_lamb_cuda": _KERNELS + "PyTorch has no LAMB; use torch.optim.AdamW(fused=True)",
    "mlp_cuda": _KERNELS + "use torch.nn.Linear layers",
    "fused_dense_cuda": _KERNELS + "use torch.nn.Linear",
    "xentropy_cuda": _KERNELS + "use torch.nn.functional.cross_entropy(label_smoothing=...)",
    "scaled_masked_softmax_cuda": _KERNELS + "use torch.nn.functional.scaled_dot_product_attention",
    "scaled_upper_triang_masked_softmax_cuda": _KERNELS + "use torch.nn.functional.scaled_dot_product_attention",
}


class NotProvidedError(ImportError):
    """An Apex module ampatch does not provide. An `ImportError`, deliberately not a
    `ModuleNotFoundError`: `from apex import contrib` would swallow that one and replace
    the message by a bare "cannot import name"."""


def not_provided_class(name: str, module: str, message: str, base: type = object) -> type:
    """A stand-in for an Apex class ampatch does not provide: it imports fine (scripts import
    Apex's names unconditionally) and constructing it raises NotImplementedError(message)."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(message)
    return type(name, (base,), {"__init__": __init__, "__module__": module, "__doc__": f"Not provided: {message}"})


def not_provided_message(fullname: str) -> str:
    """Why `fullname` cannot be imported under the alias, with the PyTorch replacement."""
    if fullname in EXTENSIONS:
        return (f"ampatch does not provide {fullname!r} ('apex' here is ampatch's alias, "
                f"ampatch.compat.install_apex_alias): {EXTENSIONS[fullname]}.")
    prefix = max((p for p in NOT_PROVIDED if fullname == p or fullname.startswith(p + ".")), key=len)
    return (f"ampatch does not provide {fullname!r} ('apex' here is ampatch's alias for Apex, "
            f"ampatch.compat.install_apex_alias): {NOT_PROVIDED[prefix]}.")


class _ApexFinder(importlib.abc.MetaPathFinder):
    """Answers imports of the Apex modules ampatch does not provide with a clear error."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.startswith("apex."):
            raise NotProvidedError(not_provided_message(fullname), name=fullname)
        if fullname in EXTENSIONS and importlib.machinery.PathFinder.find_spec(fullname) is None:
            raise NotProvidedError(not_provided_message(fullname), name=fullname)
        return None


_finder = _ApexFinder()


def _alias_getattr(name: str) -> Any:
    """`apex.<name>` for a subpackage ampatch does not provide: AttributeError with the hint."""
    if name.startswith("__"):
        raise AttributeError(f"module 'apex' has no attribute {name!r}")
    raise AttributeError(not_provided_message(f"apex.{name}"))


def apex_alias_installed() -> bool:
    """Whether `apex` currently resolves to ampatch's alias."""
    return getattr(sys.modules.get("apex"), _ALIAS_FLAG, False) is True


def install_apex_alias() -> bool:
    """Make `import apex.amp` / `from apex import amp` load ampatch, and `apex.parallel`,
    `apex.optimizers`, ... ampatch's adapters.

    Returns True when the alias is in place (idempotent), False when a real `apex` is
    importable: then nothing changes and a warning says that the real one will be used.
    """
    if apex_alias_installed():
        return True
    real = sys.modules.get("apex")  # already imported, so importable
    try:
        spec = importlib.util.find_spec("apex") if real is None else (real.__spec__ or True)
    except (ImportError, ValueError):  # a broken apex on the path: still not ours to shadow
        spec = True
    if spec is not None:
        where = getattr(spec, "origin", None) or getattr(real, "__file__", None) or "on sys.path"
        message = (f"ampatch: a real 'apex' package is importable ({where}); not aliasing apex.amp to "
                   "ampatch, so `from apex import amp` loads Apex. Uninstall apex, or import ampatch "
                   "directly (`import ampatch as amp`).")
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False

    apex = types.ModuleType("apex", "ampatch's alias for NVIDIA Apex: apex.amp is ampatch, apex.parallel, "
                                    "apex.optimizers, ... are ampatch.compat's adapters over PyTorch.")
    apex.__path__ = []  # a package, so `import apex.amp` is a submodule import
    apex.__getattr__ = _alias_getattr
    setattr(apex, _ALIAS_FLAG, True)
    modules = {"apex": apex}
    for name, target in PROVIDED.items():  # parents first: the dict lists them first
        module = modules[name] = importlib.import_module(target)
        parent, _, child = name.rpartition(".")
        if parent == "apex":
            setattr(apex, child, module)
        elif not hasattr(modules[parent], child):  # `apex.testing.common_utils` as an attribute too
            setattr(modules[parent], child, module)
    for name, module in modules.items():
        sys.modules[name] = module
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    logger.info("ampatch: `apex.amp` now loads ampatch")
    return True


def uninstall_apex_alias() -> bool:
    """Remove the alias; returns whether there was one. A real apex is never touched."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    if not apex_alias_installed():
        return False
    del sys.modules["apex"]
    for name, target in PROVIDED.items():
        if sys.modules.get(name) is sys.modules.get(target):
            del sys.modules[name]
    return True
