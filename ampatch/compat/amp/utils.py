"""`apex.amp.utils`: Apex's small helpers. Those with an honest torch equivalent behave as in
Apex (type checks, casts of nested arguments, the cast cache of a leaf FP32 param); those that
patched torch through Apex's handle raise at call time with ampatch's way."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...base.tree import map_tensors
from ...errors import PlatformError
from ..missing import not_provided_function

logger = logging.getLogger("ampatch")

__all__ = ["is_cuda_enabled", "get_cuda_version", "is_fp_tensor", "is_nested", "should_cache",
           "collect_fp_tensor_types", "type_string", "maybe_half", "maybe_bfloat16", "maybe_float", "casted_args",
           "cached_cast", "verbose_print", "as_inplace", "has_func", "get_func", "set_func", "set_func_save",
           "synthesize_flattened_rnn_weights", "new_synthesize_flattened_rnn_weights"]


def is_cuda_enabled() -> bool:
    """Whether this PyTorch was built with CUDA."""
    return torch.version.cuda is not None


def get_cuda_version() -> tuple[int, ...]:
    """The CUDA version PyTorch was built with, as a tuple of ints."""
    if torch.version.cuda is None:
        raise PlatformError("get_cuda_version(): this PyTorch was built without CUDA (torch.version.cuda is None).")
    return tuple(int(x) for x in torch.version.cuda.split("."))


def is_nested(x: Any) -> bool:
    return isinstance(x, (tuple, list))


def is_fp_tensor(x: Any) -> bool:
    """A floating tensor, or a list/tuple of them only."""
    if is_nested(x):
        return all(is_fp_tensor(y) for y in x)
    return torch.is_tensor(x) and x.is_floating_point()


def should_cache(x: Any) -> bool:
    """Whether a cast of `x` may be cached: an FP32 leaf that requires grad (a parameter)."""
    if is_nested(x):
        return all(should_cache(y) for y in x)
    return torch.is_tensor(x) and x.is_leaf and x.requires_grad and x.dtype == torch.float32


def type_string(x: torch.Tensor) -> str:
    """`x.type()` without its module: 'FloatTensor', 'HalfTensor', ..."""
    return x.type().split(".")[-1]


def collect_fp_tensor_types(args: Iterable[Any], kwargs: dict[str, Any]) -> set[str]:
    """The type strings of the floating tensors among `args` and `kwargs` (nested too)."""
    found: set[str] = set()

    def note(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            found.add(type_string(t))
        return t
    map_tensors((list(args), kwargs), note)
    return found


def _caster(dtype: torch.dtype) -> Callable[..., Any]:
    def cast(x: Any, name: str = "", verbose: bool = False) -> Any:
        def leaf(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point() or t.dtype in (dtype, torch.float64):
                return t
            if verbose:
                logger.info("Float->%s (%s)", dtype, name)
            return t.to(dtype)
        return map_tensors(x, leaf)
    cast.__doc__ = f"Floating tensors (nested too; not float64) of `x` cast to {dtype}."
    return cast


maybe_half = _caster(torch.float16)
maybe_bfloat16 = _caster(torch.bfloat16)
maybe_float = _caster(torch.float32)
maybe_half.__name__, maybe_bfloat16.__name__, maybe_float.__name__ = "maybe_half", "maybe_bfloat16", "maybe_float"


def casted_args(cast_fn: Callable[[Any], Any], args: Iterable[Any], kwargs: dict[str, Any]) -> list[Any]:
    """`args` with `cast_fn` applied to each floating tensor, and `kwargs` cast in place (Apex's contract)."""
    out = [cast_fn(x) if is_fp_tensor(x) else x for x in args]
    for k, v in kwargs.items():
        if is_fp_tensor(v):
            kwargs[k] = cast_fn(v)
    return out


def cached_cast(cast_fn: Callable[[Any], Any], x: Any, cache: dict[Any, Any]) -> Any:
    """`cast_fn(x)`, kept in `cache` for an FP32 parameter (a changed parameter is cast again)."""
    if is_nested(x):
        return type(x)(cached_cast(cast_fn, y, cache) for y in x)
    hit = cache.get(x)
    if hit is not None and hit[0] == x._version:  # an in-place update since: cast again
        return hit[1]
    cast = cast_fn(x)
    if should_cache(x):
        cache[x] = (x._version, cast)
    return cast


def verbose_print(msg: str) -> None:
    logger.info("%s", msg)


def as_inplace(fns: Iterable[str]) -> list[str]:
    """The in-place names (`add_` for `add`)."""
    return [fn + "_" for fn in fns]


def has_func(mod: Any, fn: str) -> bool:
    return fn in mod if isinstance(mod, dict) else hasattr(mod, fn)


def get_func(mod: Any, fn: str) -> Any:
    return mod[fn] if isinstance(mod, dict) else getattr(mod, fn)


def set_func(mod: Any, fn: str, new_fn: Any) -> None:
    if isinstance(mod, dict):
        mod[fn] = new_fn
    else:
        setattr(mod, fn, new_fn)


_PATCHING = ("ampatch patches torch itself (restored by amp.deinitialize); to cast a function of your own use "
             "amp.register_half_function / register_float_function / register_promote_function(module, name) "
             "before amp.initialize")
set_func_save = not_provided_function("set_func_save", __name__,
                                      f"apex.amp.utils.set_func_save is not provided: {_PATCHING}.")
synthesize_flattened_rnn_weights = not_provided_function(
    "synthesize_flattened_rnn_weights", __name__,
    "apex.amp.utils.synthesize_flattened_rnn_weights is not provided: ampatch casts torch's RNNs itself at O1/O4.")
new_synthesize_flattened_rnn_weights = not_provided_function(
    "new_synthesize_flattened_rnn_weights", __name__,
    "apex.amp.utils.new_synthesize_flattened_rnn_weights is not provided: ampatch casts torch's RNNs itself at O1/O4.")
