"""What of Apex ampatch does not provide, and the PyTorch (or ampatch) way instead.

Policy only: the messages (`NOT_PROVIDED` by module prefix, `EXTENSIONS` for Apex's compiled
modules), the error an import of such a module raises, and stand-ins for single Apex names
that import fine but raise at call time (scripts import Apex's names unconditionally, and
only some of them call what they imported).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ampatch.errors import NotProvidedError, NotSupportedError

__all__ = ["NotProvidedError", "NOT_PROVIDED", "EXTENSIONS", "not_provided_message", "not_provided_class",
           "not_provided_function"]

_DOCS = "see docs/apex.md in ampatch"

# What ampatch does not provide, and what replaces it in PyTorch (most specific prefix wins).
NOT_PROVIDED = {
    "apex.amp": "this part of Apex's amp internals is not provided; `from apex import amp` gives ampatch's public "
                f"API (initialize, scale_loss, _amp_state, init, ...), {_DOCS}",
    "apex.contrib": "use PyTorch's own: torch.nn.functional.scaled_dot_product_attention (fmha, multihead_attn), "
                    "torch.optim with fused=True (contrib optimizers), "
                    "torch.distributed.optim.ZeroRedundancyOptimizer (DistributedFusedAdam/LAMB), "
                    "torch.nn.functional.cross_entropy(label_smoothing=...) (xentropy), "
                    "torch.nn.GroupNorm / torch.nn.SyncBatchNorm (group_norm, groupbn)",
    "apex.transformer": "use torch.distributed.tensor (tensor parallelism) or Megatron-Core",
    "apex.mlp": "use torch.nn.Sequential of torch.nn.Linear layers",
    "apex.fused_dense": "use torch.nn.Linear (torch.compile fuses the bias and activation)",
    "apex.extensions": "of Apex's compiled extensions only amp_C and apex_C are provided; use torch._foreach_* ops and "
                       "torch.optim's fused=True / foreach=True",
    "apex": f"only apex.amp, apex.parallel, apex.optimizers, apex.normalization, apex.fp16_utils, "
            f"apex.multi_tensor_apply and the amp_C/apex_C kernels are provided, {_DOCS}",
}
_KERNELS = "Apex's compiled CUDA kernels are not provided (amp_C and apex_C are); "
EXTENSIONS = {
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


def not_provided_message(fullname: str) -> str:
    """Why `fullname` cannot be imported under the alias, with the PyTorch replacement."""
    if fullname in EXTENSIONS:
        return (f"ampatch does not provide {fullname!r} ('apex' here is ampatch's alias, "
                f"ampatch.compat.install_apex_alias): {EXTENSIONS[fullname]}.")
    prefix = max((p for p in NOT_PROVIDED if fullname == p or fullname.startswith(p + ".")), key=len)
    return (f"ampatch does not provide {fullname!r} ('apex' here is ampatch's alias for Apex, "
            f"ampatch.compat.install_apex_alias): {NOT_PROVIDED[prefix]}.")


def not_provided_class(name: str, module: str, message: str, base: type = object) -> type:
    """A stand-in for an Apex class ampatch does not provide: it imports fine and
    constructing it (or calling its `apply`, for an autograd Function) raises
    NotImplementedError(message)."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(message)

    def apply(*args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(message)
    return type(name, (base,), {"__init__": __init__, "apply": staticmethod(apply), "__module__": module,
                                "__doc__": f"Not provided: {message}"})


def not_provided_function(name: str, module: str, message: str) -> Callable[..., Any]:
    """A stand-in for an Apex function ampatch does not provide: importable, and calling it
    raises NotImplementedError(message)."""
    def function(*args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(message)
    function.__name__ = function.__qualname__ = name
    function.__module__ = module
    function.__doc__ = f"Not provided: {message}"
    return function
