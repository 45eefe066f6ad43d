"""`amp_C` under the alias: Apex's compiled multi-tensor extension, as Python on torch's
foreach ops (`kernels`, `optim_kernels`), with Apex's function names and calling convention:
`multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag, [ins, outs], scale)` calls
`multi_tensor_scale(chunk_size, noop_flag, [ins, outs], scale)`.

The kernels of other Apex builds that have no equivalent here are importable and raise at
call time, naming the function.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import NotSupportedError
from .kernels import (
    multi_tensor_axpby,
    multi_tensor_l2norm,
    multi_tensor_l2norm_mp,
    multi_tensor_l2norm_scale,
    multi_tensor_scale,
    multi_tensor_unscale_l2norm,
    update_scale_hysteresis,
)
from .optim_kernels import (
    multi_tensor_adagrad,
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_lamb,
    multi_tensor_lamb_mp,
    multi_tensor_lamb_stage1_cuda,
    multi_tensor_lamb_stage2_cuda,
    multi_tensor_novograd,
    multi_tensor_sgd,
)

__all__ = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp",
           "multi_tensor_l2norm_scale", "multi_tensor_unscale_l2norm", "update_scale_hysteresis",
           "multi_tensor_adam", "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master",
           "multi_tensor_sgd", "multi_tensor_adagrad", "multi_tensor_novograd", "multi_tensor_lamb",
           "multi_tensor_lamb_mp", "multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda",
           "multi_tensor_lars", "multi_tensor_lans"]


def _not_provided(name: str, replacement: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(f"amp_C.{name} is a CUDA kernel of Apex that ampatch does not provide "
                                f"('amp_C' here is ampatch's stand-in): {replacement}.")
    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"Not provided: raises NotImplementedError naming {replacement}."
    return kernel


# ROCm Apex's LARS/LANS kernels (behind its FusedLARS/FusedLANS optimizers)
multi_tensor_lars = _not_provided("multi_tensor_lars", "use apex.parallel.LARC over torch.optim.SGD")
multi_tensor_lans = _not_provided("multi_tensor_lans", "use apex.optimizers.FusedLAMB")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"ampatch's amp_C has no {name!r}; it provides {', '.join(__all__)}")
