"""The user's own cast rules for O1/O4, public as `amp.register_*_function`, the decorators
`amp.half_function` & co. and `amp.disable_casts`.

A registration is remembered for every later session (`o1.lists.user`, the newest wins) and
applied at once to a live one that patches torch; a decorated function asks the live session
for its cast wrapper at each call, so it can be decorated before any `initialize`. Outside
O1/O4 (or with no session) both leave the function as it is.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from ..base.patcher import disable_casts as patcher_disable_casts
from ..o1.lists import user as user_policy
from ..o1.plans import BFLOAT16, FLOAT, HALF, PROMOTE
from .session import current

__all__ = ["register_half_function", "register_float_function", "register_promote_function",
           "register_bfloat16_function", "half_function", "float_function", "promote_function", "bfloat16_function",
           "disable_casts"]

F = TypeVar("F", bound=Callable[..., Any])

# The sections the four registrations (and the four decorators) share, written once and put
# before each one's Example by `_sections`, so that help() shows every function whole.
REGISTER_SECTIONS = """
    Args:
        module: what holds the function: `torch`, `torch.nn.functional`, a module, a class.
        name: the function's attribute name there.

    Raises:
        ValueError: `module` has no attribute `name`.
"""
DECORATOR_SECTIONS = """
    Args:
        fn: the function (or method) to wrap.

    Returns:
        `fn` wrapped; outside O1/O4 (or with no session) it calls `fn` as it is.
"""


def _sections(sections: str) -> Callable[[F], F]:
    def add(fn: F) -> F:
        head, example = (fn.__doc__ or "").split("\n    Example::", 1)
        fn.__doc__ = f"{head.rstrip()}\n{sections}\n    Example::{example}"
        return fn
    return add


def _register(owner: Any, name: str, kind: str) -> None:
    user_policy.register(owner, name, kind)
    s = current()
    if s is not None:
        s.register_now(owner, name, kind)


@_sections(REGISTER_SECTIONS)
def register_half_function(module: Any, name: str) -> None:
    """Under O1/O4, `module.name`'s floating args are cast to the half dtype (Apex's name).

    Example::

        >>> amp.register_half_function(torch, "einsum")  # before or after amp.initialize
    """
    _register(module, name, HALF)


@_sections(REGISTER_SECTIONS)
def register_float_function(module: Any, name: str) -> None:
    """Under O1/O4, `module.name` runs in FP32 (its floating args cast to float32).

    Example::

        >>> amp.register_float_function(torch.nn.functional, "softplus")
    """
    _register(module, name, FLOAT)


@_sections(REGISTER_SECTIONS)
def register_promote_function(module: Any, name: str) -> None:
    """Under O1/O4, `module.name`'s floating args are cast to the widest floating dtype among
    them (as torch's `cat` and `add` are).

    Example::

        >>> amp.register_promote_function(torch, "lerp")
    """
    _register(module, name, PROMOTE)


@_sections(REGISTER_SECTIONS)
def register_bfloat16_function(module: Any, name: str) -> None:
    """Under O1/O4, `module.name`'s floating args are cast to bfloat16, whatever the half
    dtype (new in ampatch).

    Example::

        >>> amp.register_bfloat16_function(torch, "bmm")
    """
    _register(module, name, BFLOAT16)


def _cast_with(kind: str, fn: F) -> F:
    """`fn` with the live session's cast wrapper of `kind` around each call (none outside O1/O4)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        s = current()
        if s is None or not s.properties.patches_torch:
            return fn(*args, **kwargs)
        return s.decorated(kind, fn)(*args, **kwargs)
    return cast(F, wrapper)  # functools.wraps keeps fn's name and signature; the type is fn's


@_sections(DECORATOR_SECTIONS)
def half_function(fn: F) -> F:
    """Decorator: under O1/O4 the function's floating args are cast to the half dtype.

    Example::

        >>> @amp.half_function
        ... def fused_gelu(x, w): ...
    """
    return _cast_with(HALF, fn)


@_sections(DECORATOR_SECTIONS)
def float_function(fn: F) -> F:
    """Decorator: under O1/O4 the function runs in FP32 (its floating args cast to float32).

    Example::

        >>> @amp.float_function
        ... def log_partition(scores): ...
    """
    return _cast_with(FLOAT, fn)


@_sections(DECORATOR_SECTIONS)
def promote_function(fn: F) -> F:
    """Decorator: under O1/O4 the function's floating args are cast to the widest floating
    dtype among them.

    Example::

        >>> @amp.promote_function
        ... def blend(a, b, t): ...
    """
    return _cast_with(PROMOTE, fn)


@_sections(DECORATOR_SECTIONS)
def bfloat16_function(fn: F) -> F:
    """Decorator: under O1/O4 the function's floating args are cast to bfloat16, whatever the
    half dtype (new in ampatch).

    Example::

        >>> @amp.bfloat16_function
        ... def attention(q, k, v): ...
    """
    return _cast_with(BFLOAT16, fn)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Context manager: no ampatch casting inside the block, in the calling thread only (the
    O1/O4 patches pass each call through as it is; a cast model stays cast).

    Returns:
        A context manager (its value is None); nestable, and safe without a session.

    Example::

        >>> with amp.disable_casts():
        ...     y = custom_kernel(x.float())  # runs in the dtypes it is given
    """
    with patcher_disable_casts():
        yield
