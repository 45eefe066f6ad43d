"""The chunked step of the low-memory master modes, shared by plain (`lowmem`) and
FSDP2-sharded (`lowmem_sharded`) models.

Each parameter with a gradient is a `Target`: its bfloat16 values (the model's weight, or
a rank's local shard), its gradient, its kahan compensation, and the tensor its optimizer
state is keyed by. The targets are cut into pieces and chunks (`chunks.plan_pieces`,
`plan_chunks`); for each chunk the pieces' values (+ compensation) and grads are lifted into
the FP32 `Workspace`, the optimizer's own step() runs on stand-in parameters that are views
of it (each with its view of the target's state, `_PieceState`), and the new values are
rounded back into the bfloat16 weights, stochastically or to nearest with the remainder in
the compensation. A `direct` target (an FP32 weight: a master, or a param at O0/O1) is not
lifted: its stand-ins are views of the weight itself. With a `states.StateStore`, the kept
(bfloat16 / int8) optimizer state of each chunk is lifted into FP32 beside it and kept again
after the call (`step_kept` steps any optimizer so). docs/lowmem.md and
docs/optimizer_states.md tell the whole story.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import NotSupportedError
from .chunks import (
    Workspace,
    chunk_numel,
    has_step_hooks,
    is_elementwise,
    narrowed,
    plan_chunks,
    plan_pieces,
    step_hooks_once,
)
from .dtensors import as_param, local
from .rounding import round_with_, stream, thresholds_
from .states import Piece, StateStore

__all__ = ["Target", "Layout", "SHARDS", "Rounding", "step_in_chunks", "step_kept"]

F32 = torch.float32


class Target(NamedTuple):
    """One tensor the optimizer steps, as the chunked step sees it."""

    key: torch.Tensor          # what `optimizer.state` is keyed by (a master, or the sharded param)
    group: int                 # the index of its param group
    weight: torch.Tensor       # its bfloat16 values (the model param, or the local shard), updated in place
    grad: torch.Tensor         # its gradient, weight's shape (dense, or sparse: stepped whole)
    comp: torch.Tensor | None  # its kahan compensation (weight's shape), or None
    ordinal: int               # its place among the params the masters were made for
    offset: int                # the index, in the whole flattened parameter, of weight's first element
    split: bool                # may step in slices (the optimizer is elementwise; weight and grad dense, contiguous)
    direct: bool = False       # FP32 weight and grad, stepped in place: nothing lifted or rounded


class Layout:
    """How a target's optimizer state relates to its values: plain tensors here; the sharded
    masters' layout turns DTensor state into its local shard and back."""

    def local(self, value: Any) -> Any:
        """The part of a state value that lines up with `Target.weight`."""
        return value

    def adopt(self, target: Target, local: torch.Tensor) -> torch.Tensor:
        """What the state stores for a per-element tensor the optimizer made (`local`: weight's shape)."""
        return local


class ShardLayout(Layout):
    """DTensor state (FSDP2): its local shard lines up with the local shard of the weight."""

    def local(self, value: Any) -> Any:
        return local(value)

    def adopt(self, target: Target, values: torch.Tensor) -> torch.Tensor:
        return as_param(target.key, values)


PLAIN = Layout()  # plain tensor state: the default layout
SHARDS = ShardLayout()  # FSDP2-sharded params: the rank steps its local shards


class Rounding(NamedTuple):
    """How the new FP32 values go back into bfloat16 (or a param's own half dtype)."""

    stochastic: bool  # else to nearest, the remainder into the compensation (kahan) where there is one
    seed: int = 0
    shift: int = 0    # rounding.rotation(step)


def step_in_chunks(opt: torch.optim.Optimizer, call: Callable[..., Any], args: tuple, kwargs: dict,
                   targets: Sequence[Target], own: Sequence[tuple[int, torch.Tensor]], budget: int,
                   workspace: Workspace, rounding: Rounding, layout: Layout = PLAIN,
                   own_apart: bool = False, store: StateStore | None = None) -> Any:
    """One optimizer step over `targets`, a chunk of at most `budget` elements at a time
    (`call(*args, **kwargs)` is the optimizer's own step(), called once per chunk, its step
    hooks once in all); `own`: (group, param) stepped as they are (FP32 params, their own
    masters), with the first chunk, or in a call of their own (`own_apart`); `store`: where
    the targets' optimizer state is kept (an active one). Returns what the last call
    returned. A call that raises leaves the chunks before it stepped and the raising chunk's
    values, as far as the optimizer got, in the weights."""
    if store is not None and not store.active:
        store = None
    if store is not None:
        budget = store.budget(budget)
    pieces = plan_pieces([t.weight.numel() for t in targets], [t.split for t in targets], budget)
    chunks = [[pieces[i] for i in c] for c in plan_chunks([b - a for _, a, b in pieces], budget)]
    for device, n in _largest_chunks(targets, chunks).items():
        workspace.take(device, n, budget)  # sized once for the step: no chunk grows it
    calls: list[tuple[list[tuple[int, int, int]], dict[int, list[torch.Tensor]]]] = []
    if own and (own_apart or not chunks):
        calls.append(([], _by_group(own)))
        own = ()
    calls += [(chunk, _by_group(own) if k == 0 else {}) for k, chunk in enumerate(chunks)]
    if not calls:
        calls.append(([], {}))  # nothing to step: one call all the same, as a plain step() makes
    hooks = (step_hooks_once(opt, args, kwargs) if has_step_hooks(opt)
             else contextlib.nullcontext(lambda: (args, kwargs)))
    states = _PieceState(opt.state, targets, pieces, layout, store, workspace)
    if store is not None:
        store.reserve(workspace, (states.kept_pieces(chunk) for chunk in chunks))
    out = None
    with hooks as arguments, torch.no_grad():
        for chunk, members in calls:
            lifted = _lift(targets, chunk, workspace, states, members)
            try:
                with narrowed(opt, members):
                    a, kw = arguments()
                    out = call(*a, **kw)
            finally:
                states.leave(lifted)
                _lower(targets, lifted, rounding, workspace)
    if store is not None:
        store.rounds += 1
    return out


def step_kept(opt: torch.optim.Optimizer, call: Callable[..., Any], args: tuple, kwargs: dict,
              store: StateStore) -> Any:
    """One step of `opt`'s params as they are (FP32 masters, or the params of a level without
    masters) with their state kept in `store`: FP32 params step in place, a chunk at a time
    (`direct`); half ones (O3) are lifted into FP32 and rounded back to nearest; any other
    dtype steps as it is, with the first chunk. FSDP2-sharded params (DTensors) step their
    local shards, their unkept state sharded like them (`SHARDS`). Where `store` keeps
    nothing, `call` as it is."""
    if not store.active:
        return call(*args, **kwargs)
    if args and callable(args[0]) or kwargs.get("closure") is not None:
        raise NotSupportedError(f"optimizer.step(closure) is not supported with optimizer_states="
                                f"{store.precision.value!r}: the step runs a chunk of parameters at a time. Call "
                                "backward before step(), or use optimizer_states='float32'.")
    elementwise = is_elementwise(opt)
    targets, own = [], []
    ordinal, layout = 0, PLAIN
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            g = p.grad
            if g is not None and p.dtype in (F32, torch.bfloat16, torch.float16) and g.dtype == p.dtype:
                w, lg = local(p), local(g)
                if w is not p:  # a DTensor: its local shard (a view), its place in the whole parameter
                    w, layout = w.detach(), SHARDS
                split = elementwise and not lg.is_sparse and lg.is_contiguous() and w.is_contiguous()
                targets.append(Target(p, gi, w, lg, None, ordinal, store.origin(p), split, direct=p.dtype == F32))
            elif g is not None:
                own.append((gi, p))
            ordinal += 1
    budget = store.chunk_numel or chunk_numel(targets[0].weight.device if targets else torch.device("cpu"))
    return step_in_chunks(opt, call, args, kwargs, targets, own, budget, store.workspace, Rounding(False), layout,
                          store=store)


def _by_group(pairs: Sequence[tuple[int, torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    out: dict[int, list[torch.Tensor]] = {}
    for g, p in pairs:
        out.setdefault(g, []).append(p)
    return out


def _largest_chunks(targets: Sequence[Target], chunks: list[list[tuple[int, int, int]]]) -> dict[torch.device, int]:
    largest: dict[torch.device, int] = {}
    for chunk in chunks:
        per: dict[torch.device, int] = {}
        for i, a, b in chunk:
            d = targets[i].weight.device
            per[d] = per.get(d, 0) + b - a
        for d, n in per.items():
            largest[d] = max(largest.get(d, 0), n)
    return largest


class _Piece(NamedTuple):
    """A piece of target `i` (elements a..b) lifted: its FP32 value and grad views in the
    workspace, the parts of its weight and compensation they come from, and its stand-in."""

    i: int
    a: int
    b: int
    value: torch.Tensor
    grad: torch.Tensor
    weight: torch.Tensor
    comp: torch.Tensor | None
    proxy: nn.Parameter


class _Lifted(NamedTuple):
    """One chunk's pieces on one device, and the workspace they are lifted into."""

    values: torch.Tensor
    grads: torch.Tensor
    pieces: list[_Piece]


def _part(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements a..b of `t`, as a flat view (the whole of `t`, as it is, when that is all of it)."""
    return t if a == 0 and b == t.numel() else t.view(-1)[a:b]


def _lift(targets: Sequence[Target], chunk: list[tuple[int, int, int]], workspace: Workspace,
          states: "_PieceState", members: dict[int, list[torch.Tensor]]) -> list[_Lifted]:
    """The chunk's values (+ compensation) and grads into the workspace, as FP32 views; a
    stand-in parameter per piece, with its state, joins `members`."""
    by_device: dict[torch.device, list[tuple[int, int, int]]] = {}
    for piece in chunk:
        by_device.setdefault(targets[piece[0]].weight.device, []).append(piece)
    lifted = []
    for device, where in by_device.items():
        values, grads = workspace.take(device, sum(b - a for i, a, b in where if not targets[i].direct))
        pieces, o = [], 0
        for i, a, b in where:
            t = targets[i]
            weight = _part(t.weight, a, b)
            if t.direct:  # the stand-in is a view of the FP32 weight itself, its grad a view of the grad
                pieces.append(_Piece(i, a, b, weight, _part(t.grad, a, b) if not t.grad.is_sparse else t.grad,
                                     weight, None, nn.Parameter(weight)))
                continue
            v, g = values[o:o + b - a].view(weight.shape), grads[o:o + b - a].view(weight.shape)
            o += b - a
            pieces.append(_Piece(i, a, b, v, g, weight, None if t.comp is None else _part(t.comp, a, b),
                                 nn.Parameter(v)))
        kept = states.lift(device, pieces)
        for p in pieces:
            if targets[p.i].direct:
                p.proxy.grad = p.grad
        pieces_all, pieces = pieces, [p for p in pieces if not targets[p.i].direct]
        # every op below is a copy or has operands of one dtype: a mixed-dtype op (FP32 += bfloat16)
        # would make an FP32 temporary of its bfloat16 operand
        if pieces:
            torch._foreach_copy_([p.value for p in pieces], [p.weight for p in pieces])
        comps = [(p, p.comp) for p in pieces if p.comp is not None]
        if comps:  # the compensation, through the grads' room (filled below)
            torch._foreach_copy_([p.grad for p, _ in comps], [c for _, c in comps])
            torch._foreach_add_([p.value for p, _ in comps], [p.grad for p, _ in comps])
        dense = [p for p in pieces if not targets[p.i].grad.is_sparse]
        if dense:
            torch._foreach_copy_([p.grad for p in dense], [_part(targets[p.i].grad, p.a, p.b) for p in dense])
        for p in pieces:
            grad = targets[p.i].grad
            p.proxy.grad = grad.to(F32) if grad.is_sparse else p.grad
        for p in pieces_all:
            states.enter(p, kept.get(id(p.proxy), {}))
            members.setdefault(targets[p.i].group, []).append(p.proxy)
        lifted.append(_Lifted(values, grads, pieces_all))
    return lifted


def _lower(targets: Sequence[Target], lifted: list[_Lifted], rounding: Rounding, workspace: Workspace) -> None:
    """The chunk's new FP32 values back into the bfloat16 weights (and compensations)."""
    for chunk in lifted:
        for p in chunk.pieces:
            p.proxy.grad = None
        pieces = [p for p in chunk.pieces if not targets[p.i].direct]
        if not pieces:
            continue
        views, weights = [p.value for p in pieces], [p.weight for p in pieces]
        if rounding.stochastic:
            n = sum(p.b - p.a for p in pieces)
            r = chunk.grads[:n].view(torch.int32)  # the grads are spent: their room holds the thresholds
            runs = [(p.b - p.a, stream(rounding.seed, targets[p.i].ordinal), targets[p.i].offset + p.a) for p in pieces]
            thresholds_(r, workspace.scratch(chunk.values.device, n), runs, rounding.shift)
            round_with_(chunk.values[:n], r)
            torch._foreach_copy_(weights, views)  # exact: the low bits are zero
        else:
            torch._foreach_copy_(weights, views)  # to nearest
            comps = [(p, p.comp) for p in pieces if p.comp is not None]  # kahan: what rounding dropped, kept
            if comps:
                views, rounded = [p.value for p, _ in comps], [p.grad for p, _ in comps]  # the grads' room, spent
                torch._foreach_copy_(rounded, [p.weight for p, _ in comps])
                torch._foreach_sub_(views, rounded)   # exact in FP32
                torch._foreach_copy_([c for _, c in comps], views)


class _PieceState:
    """Each stand-in's view of its target's optimizer state, for one call of step(), and what
    the call wrote, back into the target's state.

    A target stepped whole, with plain tensors, shares its state dict itself. A slice, or a
    sharded target (DTensor state), gets a dict of its own: per-element tensors (the weight's
    shape) as views of its part, anything else (the step count, ...) as it is for a target
    stepped whole, else as a copy of the value before the step (each slice advances it once;
    the last one's is kept). Per-element tensors the optimizer makes (at the first step) are
    adopted whole, or copied into a tensor of the weight's shape, slice by slice. With a
    `store`, the state it keeps (since before the step) is lifted into FP32 buffers for the
    call (`lift`), the stand-ins get views of them, and it is kept again after (`leave`);
    what the optimizer makes that the store keeps goes there."""

    def __init__(self, state: dict, targets: Sequence[Target], pieces: list[tuple[int, int, int]],
                 layout: Layout, store: StateStore | None = None, workspace: Workspace | None = None) -> None:
        self.state, self.targets, self.layout = state, targets, layout
        self.store, self.workspace = store, workspace
        self.count: dict[int, int] = {}
        for i, _, _ in pieces:
            self.count[i] = self.count.get(i, 0) + 1
        self.before: dict[int, dict] = {}  # the state before the step of targets stepped in slices
        self.given: dict[int, dict | None] = {}  # id(stand-in) -> the views it was given (None: shared)
        # what the store kept of each target before the step (what an earlier slice made is not lifted)
        self.kept = {i: dict(store.kept.get(id(t.key), {})) for i, t in enumerate(targets)} if store else {}
        self.lifted: list[Any] = []  # this call's chunks of kept state (`StateStore.lift`)

    def kept_pieces(self, chunk: list[tuple[int, int, int]]) -> dict[torch.device, list[Piece]]:
        """The pieces of `chunk` with kept state, by device."""
        out: dict[torch.device, list[Piece]] = {}
        for i, a, b in chunk:
            if self.kept.get(i):
                t = self.targets[i]
                out.setdefault(t.weight.device, []).append(Piece(self.kept[i], a, b, t.ordinal, t.offset))
        return out

    def lift(self, device: torch.device, pieces: list[_Piece]) -> dict[int, dict[str, torch.Tensor]]:
        """The kept state of `pieces` (one device's part of a chunk) in FP32: id(stand-in) -> name -> view."""
        with_kept = [p for p in pieces if self.kept.get(p.i)]
        store, workspace = self.store, self.workspace
        if not with_kept or store is None or workspace is None:  # kept only with a store
            return {}
        chunk, views = store.lift(device, [Piece(self.kept[p.i], p.a, p.b, self.targets[p.i].ordinal,
                                                 self.targets[p.i].offset) for p in with_kept], workspace)
        self.lifted.append(chunk)
        return {id(p.proxy): {k: v.view(p.proxy.shape) for k, v in mine.items()} for p, mine in zip(with_kept, views)}

    def _per_element(self, value: Any, t: Target) -> bool:
        return torch.is_tensor(value) and value.shape == t.weight.shape

    def enter(self, p: _Piece, kept: dict[str, torch.Tensor]) -> None:
        t, whole = self.targets[p.i], self.count[p.i] == 1
        own = self.state.get(t.key)
        if own is not None and whole and not kept and all(self.layout.local(v) is v for v in own.values()):
            self.state[p.proxy] = own  # the optimizer writes into the target's own dict
            self.given[id(p.proxy)] = None
            return
        mine, views = {}, dict(kept)
        if not whole and p.i not in self.before:  # the first slice: what the state held before the step
            self.before[p.i] = {} if own is None else dict(own)
        if own is not None:
            # a slice sees only what existed before the step (what an earlier slice made is filled in
            # for that slice alone: the optimizer makes it again for this one)
            for k in (list(own) if whole else list(self.before[p.i])):
                local = self.layout.local(own[k])
                if self._per_element(local, t):
                    if not whole and not local.is_contiguous():  # slices are views of a contiguous tensor
                        own[k] = self.layout.adopt(t, local.contiguous())
                        local = self.layout.local(own[k])
                    mine[k] = views[k] = local if whole else local.view(-1)[p.a:p.b]
                else:
                    mine[k] = own[k] if whole else _copy(self.before[p.i][k])  # each slice from the value before
        mine.update(kept)
        self.state[p.proxy] = mine
        self.given[id(p.proxy)] = views

    def leave(self, lifted: list[_Lifted]) -> None:
        for chunk in lifted:
            for p in chunk.pieces:
                mine = self.state.pop(p.proxy, None)
                views = self.given.pop(id(p.proxy), None)
                t = self.targets[p.i]
                if mine is None:
                    continue
                if views is None:  # shared: the dict is the target's
                    continue
                own = self.state.setdefault(t.key, {})
                whole = self.count[p.i] == 1
                for k, v in mine.items():
                    if views.get(k) is v:
                        continue  # updated in place
                    if k in self.kept.get(p.i, ()):  # a kept tensor the optimizer replaced: kept from its view
                        views[k].copy_(v)
                        continue
                    if torch.is_tensor(v) and v.shape == p.proxy.shape:  # per-element, made by the optimizer
                        if self.store is not None and self.store.keeps(t.key, k):
                            self.store.write(t.key, k, p.a, p.b, v.detach().reshape(-1).to(F32), t.ordinal)
                            continue
                        if whole:
                            own[k] = self.layout.adopt(t, v)
                            continue
                        if k not in own or not self._per_element(self.layout.local(own[k]), t):
                            own[k] = self.layout.adopt(t, torch.empty(t.weight.shape, dtype=v.dtype, device=v.device))
                        self.layout.local(own[k]).view(-1)[p.a:p.b].copy_(v.view(-1))
                    else:
                        own[k] = v
        if self.store is not None and self.workspace is not None:  # lifted only with a store
            for kept in self.lifted:
                self.store.lower(kept, self.workspace)
        self.lifted = []


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else copy.copy(value)
