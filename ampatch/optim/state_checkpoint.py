"""The kept optimizer state (`states.StateStore`) in checkpoints.

Each parameter whose state is kept carries it in its entry of `optimizer.state_dict()["state"]`,
beside torch's own entries (the step count, state too small to keep), aliased (a save copies
nothing)::

    {"step": tensor(12.), "ampatch_states": {"seed": int, "rounds": int, "tensors": {
        "exp_avg": {"codes": int8 tensor, "absmax": FP32 tensor, "signed": True},  # int8: a scale per block
        "exp_avg_sq": {"values": bfloat16 tensor of the param's shape}}}}  # bfloat16

Only tensors, dicts, ints and bools (torch's load mangles strings): a plain torch optimizer
that loads the checkpoint (before `initialize`) keeps the entry, with its tensors cast to
FP32 (exactly: codes are small integers, bfloat16 values FP32 numbers), and `initialize`
takes it back from there (`take_from_state`); loaded after `initialize`, `take` takes it out before torch's own load
sees it. Either way every entry is checked before anything is kept, and a malformed one
(another model's shapes, codes out of range, NaN scales) is refused with an error naming it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError
from .quant import BLOCK, blocks, code_dtype
from .states import STATES_KEY, Packed, StateStore

__all__ = ["add_entries", "take", "take_from_state", "take_kept", "apply", "NOTHING"]

F32, BF16 = torch.float32, torch.bfloat16
Taken = tuple[dict[int, dict[str, Packed]], tuple[int, int] | None]  # by param index; (seed, rounds)
NOTHING: Taken = ({}, None)


def add_entries(store: StateStore, params: Sequence[torch.Tensor], state: dict) -> None:
    """`optimizer.state_dict()["state"]` (by param index): each kept state joins its param's entry."""
    for i, p in enumerate(params):
        entry = store.entry_of(p)
        if entry is not None:
            state[i] = {**state.get(i, {}), STATES_KEY: entry}  # a dict of its own: torch's are the live ones


def take(state: dict, params: Sequence[torch.Tensor]) -> Taken:
    """The kept state out of a checkpoint's `state` (by param index, copied: the caller's
    checkpoint stays as it was), checked; nothing is changed if one is malformed (ValueError)."""
    found: dict[int, dict[str, Packed]] = {}
    counts = None
    for k, entry in list(state.items()):
        if not isinstance(entry, dict) or STATES_KEY not in entry:
            continue
        i = k if isinstance(k, int) and not isinstance(k, bool) else -1
        if not 0 <= i < len(params):
            raise ConfigError(f"optimizer checkpoint: kept optimizer state for state entry {k!r}, which no param of "
                              "this optimizer has; it was saved from another model. Nothing was loaded.")
        found[i], counts = _parse(entry[STATES_KEY], params[i], f"param {i}")
    for i in found:
        state[i] = {key: v for key, v in state[i].items() if key != STATES_KEY}
    return found, counts


def take_from_state(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> Taken:
    """The kept state a plain optimizer loaded with a checkpoint (before `initialize`), out of
    its state, checked, by param index."""
    state = optimizer.state
    by_index = {i: state[p] for i, p in enumerate(params) if isinstance(state.get(p), dict) and STATES_KEY in state[p]}
    found, counts = take(by_index, params)
    for i, entry in by_index.items():
        state[params[i]] = entry
    return found, counts


def take_kept(store: StateStore, params: Sequence[torch.Tensor]) -> None:
    """At `initialize`: the optimizer's state as `store` keeps it, from a checkpoint's kept state
    that a plain optimizer loaded, and from its own FP32 state."""
    apply(store, take_from_state(store.optimizer, params), params)


def apply(store: StateStore, taken: Taken, params: Sequence[torch.Tensor], replaced: bool = False) -> None:
    """A checkpoint's checked kept state into `store` (its rounding's seed and count too), then
    whatever FP32 state the checkpoint gave torch's own load, kept (`StateStore.take_state`).
    `replaced`: torch's load replaced the whole state (what was kept before is gone)."""
    found, counts = taken
    if replaced:
        store.kept.clear()
    if counts is not None:
        store.seed, store.rounds = counts
    ordinals = {id(p): i for i, p in enumerate(params)}
    for i, kept in found.items():
        store.adopt(params[i], {name: _placed(packed, params[i]) for name, packed in kept.items()}, i)
    store.take_state(params, ordinals)


def _placed(packed: Packed, p: torch.Tensor) -> Packed:
    """`packed` on `p`'s device (what torch's load does to the rest of the state)."""
    absmax = None if packed.absmax is None else packed.absmax.to(p.device)
    return Packed(packed.values.to(p.device), absmax)


def _parse(entry: Any, p: torch.Tensor, name: str) -> tuple[dict[str, Packed], tuple[int, int]]:
    """A param's checked entry as `Packed` tensors (in their own dtypes again), and (seed, rounds)."""
    bad = "it was not saved by ampatch's optimizer.state_dict(), or from another model. Nothing was loaded."
    where = f"optimizer checkpoint: the kept state of {name} (shape {tuple(p.shape)})"
    if not isinstance(entry, dict) or not isinstance(entry.get("tensors"), dict):
        raise ConfigError(f"{where} must be a dict with 'seed', 'rounds' and 'tensors'; {bad}")
    counts = []
    for key in ("seed", "rounds"):
        value = entry.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}: its {key!r} must be an int >= 0, got {value!r}; {bad}")
        counts.append(value)
    out = {}
    for state_name, t in entry["tensors"].items():
        what = f"{where}, {state_name!r},"
        if not isinstance(t, dict) or not (set(t) == {"values"} or set(t) == {"codes", "absmax", "signed"}):
            raise ConfigError(f"{what} must hold 'values' (bfloat16) or 'codes', 'absmax' and 'signed' (int8); {bad}")
        if "values" in t:
            out[state_name] = Packed(_values(t["values"], p, what, bad))
        elif not isinstance(t["signed"], bool):
            raise ConfigError(f"{what} has 'signed' {t['signed']!r}, not True or False; {bad}")
        else:
            out[state_name] = _codes(t["codes"], t["absmax"], t["signed"], p, what, bad)
    return out, (counts[0], counts[1])


def _values(v: Any, p: torch.Tensor, what: str, bad: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.shape != p.shape:
        raise ConfigError(f"{what} is {_describe(v)}, not a bfloat16 tensor of its param's shape; {bad}")
    if not bool(torch.isfinite(v).all()):
        raise ConfigError(f"{what} holds NaN or inf: the next step would turn its weights into NaN. The checkpoint is "
                          "corrupted; nothing was loaded.")
    return v.detach().to(BF16)  # exact for what ampatch saved (a plain optimizer's load made it FP32)


def _codes(codes: Any, absmax: Any, signed: bool, p: torch.Tensor, what: str, bad: str) -> Packed:
    n, dtype = p.numel(), code_dtype(signed)
    if not isinstance(codes, torch.Tensor) or codes.shape != (n,) or codes.dtype not in (dtype, F32):
        raise ConfigError(f"{what} has codes of {_describe(codes)}, not {dtype} codes of its {n} elements; {bad}")
    if not isinstance(absmax, torch.Tensor) or absmax.shape != (blocks(n),) or not absmax.is_floating_point():
        raise ConfigError(f"{what} has scales of {_describe(absmax)}, not FP32 scales of its {blocks(n)} blocks of "
                          f"{BLOCK}; {bad}")
    if not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
        raise ConfigError(f"{what} has a scale that is negative, NaN or inf: the checkpoint is corrupted; nothing was "
                          "loaded.")
    if codes.dtype == F32:  # a plain optimizer's load made them FP32: small integers, exactly
        low, high = torch.iinfo(dtype).min, torch.iinfo(dtype).max
        if not bool(((codes == codes.round()) & (codes >= low) & (codes <= high)).all()):
            raise ConfigError(f"{what} has codes that are not {dtype} values: the checkpoint is corrupted; nothing "
                              "was loaded.")
    return Packed(codes.detach().to(dtype), absmax.detach().to(F32))


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"dtype {t.dtype}, shape {tuple(t.shape)}"
