"""optimizer_states "bfloat16" / "int8" on FSDP2-sharded models: the kept state of each
parameter is its rank's local shard (`states.StateStore`, int8 blocks per local shard), and
checkpoints carry it the way a plain FSDP2 optimizer's state travels.

`optimizer.state_dict()` gives each kept tensor as FP32, a DTensor placed like its parameter
(made as it is asked for: a save copies what a plain FSDP2 optimizer holds all along), under
the optimizer's own names (`exp_avg`, ...), so `torch.distributed.checkpoint` saves, loads
and reshards it as any optimizer state; the bfloat16 rounding's seed and step count go into
every param group (`COUNTS_KEY`: a tensor of two int64, which the full-state-dict load of
torch.distributed.checkpoint carries into a plain optimizer, where a plain int would raise
a KeyError). A load, before `initialize` (into the plain optimizer) or after, keeps the
loaded FP32 values again: bfloat16 values and int8 codes decoded are kept again bit for bit
(`quant`), so a run resumes exactly. docs/fsdp.md.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from ..config.values import StatePrecision
from ..errors import ConfigError
from . import state_checkpoint
from .chunks import is_elementwise
from .dtensors import shard_offset
from .scaler import distributed, first_problem
from .states import StateStore

logger = logging.getLogger("ampatch")

__all__ = ["COUNTS_KEY", "check_shardable", "kept_store", "add_entries", "take"]

COUNTS_KEY = "ampatch_states_rounding"  # a param group entry: tensor([seed, rounds]) of the bfloat16 rounding
Counts = tuple[int, int] | None  # (seed, rounds), from a checkpoint


def check_shardable(optimizer: torch.optim.Optimizer, precision: StatePrecision) -> None:
    """Refuse, before anything changes, what cannot keep its state shard by shard: an
    optimizer that is not elementwise (each rank steps its own shard: a trust ratio or a
    factored moment needs the whole tensor), a parameter not sharded in whole rows."""
    if not precision.stored:
        return
    if not is_elementwise(optimizer):
        raise ConfigError(
            f"optimizer_states={precision.value!r} on an FSDP2-sharded model keeps and steps each rank's shard of the "
            f"state on its own, so the optimizer's update of an element must depend on that element alone; "
            f"{type(optimizer).__name__} is not one of torch.optim's elementwise optimizers (SGD, Adam, AdamW, "
            "Adagrad, RMSprop, Adamax, NAdam, RAdam) and does not declare `ampatch_elementwise = True`. Use "
            "optimizer_states='float32' with it.")
    for group in optimizer.param_groups:
        for p in group["params"]:
            shard_offset(p)  # raises for a placement other than whole rows, naming the fix


def kept_store(optimizer: torch.optim.Optimizer, precision: StatePrecision, process_group: Any = None) -> StateStore:
    """The store of a sharded optimizer's state, at `initialize`: the bfloat16 rounding's seed
    and step count agreed by every rank (rank 0's: replicas round their elements alike), or
    those of a checkpoint the plain optimizer loaded; then its FP32 state kept (a checkpoint's,
    or what it made), a part at a time. A malformed count raises before anything changes."""
    counts, problem = _counts(optimizer.param_groups)
    if problem is not None:
        raise ConfigError(f"{problem}; amp.initialize changed nothing.")
    store = StateStore(optimizer, precision)
    for group in optimizer.param_groups:
        group.pop(COUNTS_KEY, None)
    if counts is not None:
        store.seed, store.rounds = counts
    if store.active and distributed(process_group):
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        agreed = torch.tensor([store.seed, store.rounds], dtype=torch.int64,
                              device=params[0].device if params else "cpu")
        dist.broadcast(agreed, src=src, group=process_group)
        store.seed, store.rounds = (int(v) for v in agreed.tolist())
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state_checkpoint.take_kept(store, params)
    return store


def add_entries(store: StateStore, params: Sequence[torch.Tensor], sd: dict) -> None:
    """`optimizer.state_dict()`: each kept tensor joins its param's entry as FP32, placed like
    the param (a new tensor: torch.distributed.checkpoint loads into a state dict's tensors in
    place); the rounding's seed and step count join every param group."""
    if not store.active or not isinstance(sd.get("state"), dict):
        return
    for i, p in enumerate(params):
        for name, packed in store.kept.get(id(p), {}).items():
            sd["state"][i] = {**sd["state"].get(i, {}), name: store.as_float(p, packed)}  # a dict of its own
    sd["param_groups"] = [{**g, COUNTS_KEY: torch.tensor([store.seed, store.rounds], dtype=torch.int64)}
                          for g in sd.get("param_groups", [])]


def take(store: StateStore, state_dict: dict, params: Sequence[torch.Tensor],
         process_group: Any = None) -> Callable[[], None]:
    """`optimizer.load_state_dict` after `initialize`: the state this store keeps taken out of
    `state_dict` (a copy: the caller's checkpoint stays as it was) before torch's own load
    sees it (at O3 it would cast it to the params' bfloat16), and the counts checked on every
    rank; returns what keeps it after torch's load (which replaced the whole state)."""
    state_dict["param_groups"] = [dict(g) for g in state_dict.get("param_groups", [])]
    counts, problem = _counts(state_dict["param_groups"])
    problem = first_problem(problem, process_group, params[0].device if params else "cpu")
    if problem is not None:
        raise ConfigError(f"{problem}; nothing was loaded.")
    for g in state_dict["param_groups"]:
        g.pop(COUNTS_KEY, None)
    if not store.active or not isinstance(state_dict.get("state"), dict):
        return lambda: None
    state = state_dict["state"] = dict(state_dict["state"])
    packed = state_checkpoint.take(state, params)  # an unsharded run's kept entries (read back by parts)
    index = {k: i for i, k in enumerate(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))}
    taken: dict[int, dict[str, torch.Tensor]] = {}
    for k, entry in state.items():
        i = index.get(k, k if isinstance(k, int) else -1)
        if not isinstance(entry, dict) or not 0 <= i < len(params):
            continue
        p = params[i]
        mine = {n: v for n, v in entry.items() if n != "step" and torch.is_tensor(v) and v.is_floating_point()
                and v.shape == p.shape and store.keeps(p, n)}
        if mine:
            taken[i] = mine
            state[k] = {n: v for n, v in entry.items() if n not in mine}

    def apply() -> None:
        state_checkpoint.apply(store, packed, params, replaced=True)
        if counts is not None:
            store.seed, store.rounds = counts
        for i, values in taken.items():
            for name, value in values.items():
                store.keep(params[i], name, value, i)
    return apply


def _counts(groups: Sequence[dict]) -> tuple[Counts, str | None]:
    """The rounding's (seed, rounds) in `groups` (the first group's entry), and what is wrong with them."""
    found = [g[COUNTS_KEY] for g in groups if COUNTS_KEY in g]
    if not found:
        return None, None
    value = found[0]
    counts = (value.tolist() if isinstance(value, torch.Tensor) and not value.is_floating_point()
              and value.shape == (2,) else None)
    if counts is None or any(c < 0 for c in counts):
        return None, (f"optimizer checkpoint: the optimizer state's rounding (the param groups' {COUNTS_KEY!r}) must "
                      f"be an integer tensor of its seed and step count, both >= 0, got {value!r}: it was not saved "
                      "by ampatch's optimizer.state_dict(), or was changed since")
    return (int(counts[0]), int(counts[1])), None
