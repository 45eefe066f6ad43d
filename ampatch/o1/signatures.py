"""How an op takes its arguments, read once per op: what its O1 function (`o1.generate`) checks.

- A Python function (`F.softmax`, `F.layer_norm`, the losses): its own signature, copied, so
  keyword calls bind as they would on the original; the parameters checked are those whose
  annotation can hold a tensor (no annotation, `Tensor`, `Optional[Tensor]`, a sequence of
  them, anything unknown); `int`, `float`, `bool`, `str`, `list[int]`, dtypes are not.
- A builtin (`torch.mm`, `F.linear`, `Tensor.softmax`): its positional arguments, as many as
  its longest overload in torch's operator schemas takes, checked where some overload takes a
  `Tensor`, `Tensor?` or `Tensor[]`. Keyword arguments and extra positional ones (Python's
  deprecated signatures) take the general path, which walks everything.
- Anything else (a builtin without a schema, a Python function whose signature cannot be read
  or whose parameter names would shadow the generated code's own): a generic layout, every
  positional argument up to `FALLBACK_POSITIONS` checked.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Layout", "layout_of", "FALLBACK_POSITIONS"]

FALLBACK_POSITIONS = 4  # positional arguments checked when an op's schema is unknown

# Names an annotation may use without ever meaning a tensor.
_SCALAR_WORDS = frozenset({
    "int", "float", "bool", "str", "complex", "bytes", "None", "NoneType", "Optional", "Union", "list", "List",
    "tuple", "Tuple", "Sequence", "typing", "builtins", "dtype", "DType", "torch.dtype", "typing.Optional",
    "typing.Union", "typing.List", "typing.Tuple", "typing.Sequence", "_int", "_float", "_bool", "_size",
    "_dtype", "number", "BroadcastingList1", "BroadcastingList2", "BroadcastingList3", "Literal",
    "typing.Literal"})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_TENSOR_TYPE = re.compile(r"\bTensor\b")


@dataclass(frozen=True)
class Layout:
    """The arguments an op's O1 function names and checks.

    `signature` is the Python function's own signature (None for a builtin, whose function
    takes `positions` positional-only arguments, `*rest` and `**kw`); `checked` holds the
    names of the parameters, or the indices of the positions, that can hold a tensor."""

    signature: inspect.Signature | None = None
    positions: int = FALLBACK_POSITIONS
    checked: frozenset[Any] = frozenset(range(FALLBACK_POSITIONS))

    @property
    def generic(self) -> bool:
        """The fallback layout of a builtin (no schema known)."""
        return self.signature is None and self.checked == frozenset(range(self.positions)) \
            and self.positions == FALLBACK_POSITIONS


def layout_of(original: Any, reserved: frozenset[str]) -> Layout:
    """The layout of `original`'s O1 function; `reserved` are the names the generated code
    uses itself (a Python signature that uses one of them gets the generic layout)."""
    if inspect.isfunction(original):
        try:
            sig = inspect.signature(original, follow_wrapped=False)
        except (TypeError, ValueError):
            return Layout()
        names = set(sig.parameters)
        if names & reserved or any(n.startswith("_d") and n[2:].isdigit() for n in names):
            return Layout()
        checked = frozenset(n for n, prm in sig.parameters.items() if _may_hold_tensor(prm))
        return Layout(signature=sig, positions=0, checked=checked)
    return _builtin_layout(original)


def _may_hold_tensor(prm: inspect.Parameter) -> bool:
    """Whether a Python parameter can receive a tensor, judged from its annotation."""
    if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD) or prm.annotation is prm.empty:
        return True
    text = prm.annotation if isinstance(prm.annotation, str) else inspect.formatannotation(prm.annotation)
    return bool(_TENSOR_TYPE.search(text)) or not set(_WORD.findall(text)) <= _SCALAR_WORDS


def _builtin_layout(original: Any) -> Layout:
    """A builtin's positions from torch's operator schemas, found by its `__name__`."""
    name = getattr(original, "__name__", "")
    schemas = []
    for candidate in dict.fromkeys((name, name.strip("_"))):
        if candidate:
            try:
                schemas = torch._C._jit_get_schemas_for_operator(f"aten::{candidate}")
            except RuntimeError:
                schemas = []
            if schemas:
                break
    if not schemas:
        return Layout()
    positions, checked = 0, set()
    for schema in schemas:
        positional = [a for a in schema.arguments if not a.kwarg_only]
        positions = max(positions, len(positional))
        checked.update(i for i, a in enumerate(positional) if _TENSOR_TYPE.search(str(a.type)))
    return Layout(positions=positions, checked=frozenset(checked))
