"""What an O1 wrapper does to one op's arguments, decided once per op: the `OpPlan`.

`plan(kind, op, half_dtype, allow_banned)` turns a policy kind (the lists of
`ampatch.o1.lists`, a registration, a decorator) into a plan, and both builders read it: the
eager wrapper (`wrappers.make_wrapper`) and its `torch.compile` twin (`twins.make_traceable`).
So bfloat16-as-half, banned ops and `allow_banned`, in-place promotion and the CPU-only
kinds are each decided here, once. The rules a plan leaves to call time are here too:
`OUT` (a call with `out=` is never cast), `promote_dtype` and `off_cpu`.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..base.dtypes import CASTABLE, LOW, short_name
from ..base.tree import Leaf, map_tensors
from ..errors import ConfigError, ConfigTypeError, NotSupportedError


class Kind(str, enum.Enum):
    """The cast kinds the policy lists, registrations and decorators name."""

    HALF = "half"  # floating tensors to the session's half dtype
    BFLOAT16 = "bfloat16"  # floating tensors to bfloat16, whatever the session's half dtype
    FLOAT = "float"  # float16/bfloat16 tensors to float32
    CPU_FLOAT = "cpu_float"  # FLOAT when the op runs on the CPU; left alone elsewhere
    PROMOTE = "promote"  # floating tensors to the call's widest dtype (in place: self's)
    SEQUENCE_PROMOTE = "sequence_promote"  # PROMOTE for an op taking a list of tensors
    BANNED = "banned"  # a half input raises; with allow_banned, FLOAT


HALF, BFLOAT16, FLOAT, CPU_FLOAT = Kind.HALF, Kind.BFLOAT16, Kind.FLOAT, Kind.CPU_FLOAT
PROMOTE, SEQUENCE_PROMOTE, BANNED = Kind.PROMOTE, Kind.SEQUENCE_PROMOTE, Kind.BANNED


class Action(enum.Enum):
    """What a wrapper does with the tensors it finds."""

    CAST = "cast"  # a tensor whose dtype is in `needs` becomes `target`
    PROMOTE = "promote"  # every floating tensor becomes the dtype `promote_dtype` picks per call
    REFUSE = "refuse"  # a tensor whose dtype is in `needs` raises NotImplementedError(message)


@dataclass(frozen=True)
class OpPlan:
    """One op's wrapper, as data (see `plan`)."""

    kind: Kind
    op: str
    action: Action
    target: torch.dtype | None = None  # CAST: the dtype tensors go to
    needs: frozenset[torch.dtype] = frozenset()  # CAST/REFUSE: the dtypes that get cast / refused
    in_place: bool = False  # PROMOTE: the others follow self's dtype
    cpu_only: bool = False  # CAST only when the op's first tensor is on the CPU (`off_cpu`)
    message: str = ""  # REFUSE: names the safe alternative

    @property
    def label(self) -> str | None:
        """The dtype the telemetry counts this op's calls under (PROMOTE: chosen per call)."""
        return short_name(self.target)

    def leaf(self, cast: Callable[[torch.Tensor], torch.Tensor] | None = None,
             dtype: torch.dtype | None = None) -> Leaf:
        """The `map_tensors` leaf of this plan: CAST, a tensor whose dtype is in `needs` goes
        through `cast`; PROMOTE, a floating tensor not of the call's `dtype` (from
        `promote_dtype`) does; REFUSE, a tensor whose dtype is in `needs` raises, with
        `message`. Any other tensor comes back as it is."""
        needs = self.needs
        if self.action is Action.REFUSE:
            message = self.message

            def refuse(t: torch.Tensor) -> torch.Tensor:
                if t.dtype in needs:
                    raise NotSupportedError(message)
                return t
            return refuse
        if cast is None or (self.action is Action.PROMOTE) != (dtype is not None):
            raise ConfigTypeError(f"the leaf of a {self.action.value} plan takes the cast it applies"
                                  + (" and the call's dtype" if self.action is Action.PROMOTE else ""))
        if self.action is Action.PROMOTE:
            def promote(t: torch.Tensor) -> torch.Tensor:
                return cast(t) if t.dtype is not dtype and t.is_floating_point() else t
            return promote

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return cast(t) if t.dtype in needs else t
        return leaf


def plan(kind: str, op: str, half_dtype: torch.dtype, allow_banned: bool = False, message: str = "") -> OpPlan:
    """The plan of the `kind` wrapper of `op` in a session whose half dtype is `half_dtype`.

    float64 and non-floating tensors are never cast; a HALF cast starts from any of
    `CASTABLE`, a FLOAT cast from the half dtypes. An op named `name_` (not a dunder) is
    in place: promotion leaves `self` alone and casts the others to its dtype.
    """
    try:
        kind = Kind(kind)
    except ValueError:
        raise ConfigError(f"unknown cast kind {kind!r}; one of {', '.join(k.value for k in Kind)}") from None
    if kind in (HALF, BFLOAT16):
        target = torch.bfloat16 if kind is BFLOAT16 else half_dtype
        return OpPlan(kind, op, Action.CAST, target, frozenset(CASTABLE) - {target})
    if kind in (FLOAT, CPU_FLOAT) or (kind is BANNED and allow_banned):
        return OpPlan(kind, op, Action.CAST, torch.float32, frozenset(LOW), cpu_only=kind is CPU_FLOAT)
    if kind in (PROMOTE, SEQUENCE_PROMOTE):
        return OpPlan(kind, op, Action.PROMOTE, in_place=op.endswith("_") and not op.endswith("__"))
    # BANNED: FP32 inputs are safe (nothing to protect, as in Apex); half ones are refused
    return OpPlan(kind, op, Action.REFUSE, needs=frozenset(LOW), message=message)


# A call with an explicit `out=` tensor is never cast (as under torch.autocast, where such
# calls are not eligible): a cast `out` would be a temporary copy, the result would land in
# it and the caller's tensor would stay as it was (torch.compile's inductor code calls
# `torch.bmm(a, b, out=buf)` on FP32 buffers while a session patches torch, and read
# uninitialized memory back). The op runs as the caller wrote it, mixed dtypes included.
OUT = "out"


def promote_dtype(in_place: bool, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a PROMOTE call casts to: an in-place op's `self` dtype (floating or not),
    else the promoted dtype of every floating tensor in args and kwargs, nested ones too
    (None: no floating tensor, nothing to promote)."""
    if in_place and args and isinstance(args[0], torch.Tensor):
        return args[0].dtype
    floating: list[torch.dtype] = []

    def see(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            floating.append(t.dtype)
        return t

    map_tensors(args, see)
    if kwargs:
        map_tensors(kwargs, see)
    widest = None
    for d in floating:
        widest = d if widest is None or widest is d else torch.promote_types(widest, d)
    return widest


def off_cpu(first: Any) -> bool:
    """Whether a `cpu_only` plan leaves a call alone: its first argument is a tensor that is
    not on the CPU (the kinds it covers have half kernels there)."""
    return isinstance(first, torch.Tensor) and first.device.type != "cpu"
