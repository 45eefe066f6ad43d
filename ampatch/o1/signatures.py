"""How an op takes its arguments, read once per op: what its O1 function (`o1.generate`) checks.

- A Python function (`F.softmax`, `F.layer_norm`, the losses): its own signature, copied, so
  keyword calls bind as they would on the original; the parameters checked are those whose
  annotation can hold a tensor (no annotation, `Tensor`, `Optional[Tensor]`, a sequence of
  them, anything unknown); `int`, `float`, `bool`, `str`, `list[int]`, dtypes are not.
- A builtin (`torch.mm`, `F.linear`, `Tensor.softmax`): its positional arguments, as many as
  its longest overload takes, checked where some overload takes a `Tensor`, `Tensor?` or
  `Tensor[]`. The overloads are torch's operator schemas and the Python signatures torch's
  type stubs list (`torch/_C/*.pyi`): those add the deprecated ones, such as
  `torch.addmm(beta, input, mat1, mat2)` (without the stubs, every position is checked).
  Keyword arguments and extra positional ones take the general path, which walks everything.
- Anything else (a builtin neither lists, a Python function whose signature cannot be read or
  whose parameter names would shadow the generated code's own): a generic layout, every
  positional argument up to `FALLBACK_POSITIONS` checked.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
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
# torch's type stubs of its builtins: their Python signatures, the deprecated ones too
_STUBS = ("_C/_VariableFunctions.pyi", "_C/_nn.pyi", "_C/__init__.pyi")
_STUB_DEF = re.compile(r"^[ \t]*def (\w+)\((.*?)\)\s*->", re.S | re.M)

logger = logging.getLogger("ampatch")


@dataclass(frozen=True)
class Layout:
    """The arguments an op's O1 function names and checks.

    `signature` is the Python function's own signature (None for a builtin, whose function
    takes `positions` positional-only arguments, `*rest` and `**kw`); `checked` holds the
    names of the parameters, or the indices of the positions, that can hold a tensor."""

    signature: inspect.Signature | None = None
    positions: int = FALLBACK_POSITIONS
    checked: frozenset[Any] = frozenset(range(FALLBACK_POSITIONS))



def layout_of(original: Any, reserved: frozenset[str]) -> Layout:
    """The layout of `original`'s O1 function; `reserved` are the names the generated code
    uses itself (a Python signature that uses one of them gets the generic layout). Read
    once per op and process."""
    try:
        return _cached_layout(original, reserved)
    except TypeError:  # an unhashable callable
        return _layout(original, reserved)


@functools.lru_cache(maxsize=4096)
def _cached_layout(original: Any, reserved: frozenset[str]) -> Layout:
    return _layout(original, reserved)


def _layout(original: Any, reserved: frozenset[str]) -> Layout:
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
    """A builtin's positions from torch's operator schemas and type stubs, found by its `__name__`."""
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
    table = _stub_signatures()
    stubs = table.get(name)
    if not schemas and not stubs:
        return Layout()
    positions, checked = 0, set[int]()
    for schema in schemas:
        positional = [a for a in schema.arguments if not a.kwarg_only]
        positions = max(positions, len(positional))
        checked.update(i for i, a in enumerate(positional) if _TENSOR_TYPE.search(str(a.type)))
    for count, tensors in stubs or ():
        positions = max(positions, count)
        checked.update(tensors)
    if not table:  # no stubs installed: a deprecated signature may hold a tensor anywhere
        checked = set(range(positions))
    return Layout(positions=positions, checked=frozenset(checked))


@functools.cache
def _stub_signatures() -> dict[str, list[tuple[int, frozenset[int]]]]:
    """name -> [(positional parameters, which of them can hold a tensor)] of every builtin
    torch's type stubs list, each overload once; {} when the stubs are not installed."""
    table: dict[str, set[tuple[int, frozenset[int]]]] = {}
    root = os.path.dirname(torch.__file__)
    for stub in _STUBS:
        try:
            with open(os.path.join(root, stub), encoding="utf-8") as f:
                text = f.read()
        except OSError:
            logger.debug("ampatch: no %s in this torch; O1 checks every positional argument of its builtins", stub)
            return {}
        for match in _STUB_DEF.finditer(text):
            table.setdefault(match.group(1), set()).add(_stub_positions(match.group(2)))
    return {name: sorted(overloads, key=lambda o: (o[0], sorted(o[1]))) for name, overloads in table.items()}


def _stub_positions(params: str) -> tuple[int, frozenset[int]]:
    """(positional parameters, which can hold a tensor) of a stub's parameter list."""
    parts: list[str] = []
    for piece in params.split(","):  # commas inside brackets join their pieces again
        if parts and parts[-1].count("[") + parts[-1].count("(") > parts[-1].count("]") + parts[-1].count(")"):
            parts[-1] += "," + piece
        else:
            parts.append(piece)
    count, tensors = 0, set()
    for part in (p.strip() for p in parts):
        if not part or part == "/":
            continue
        if part.startswith("*"):
            break
        name, colon, annotation = part.partition("=")[0].partition(":")
        if not colon or "Tensor" in annotation:  # a method's `self`, or a tensor type
            tensors.add(count)
        count += 1
    return count, frozenset(tensors)
