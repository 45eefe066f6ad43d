"""master_weights "stochastic"/"kahan" on FSDP2-sharded models (`ShardedLowMem`), beside
`lowmem`'s plain ones.

The sharded bfloat16 parameters (DTensors) are the only copy of the weights, and they stay
in the optimizer's param_groups (so `torch.distributed.checkpoint`'s helpers find them by
name); the optimizer's state is sharded like them (DTensors, in FP32). `step` runs the
optimizer's own step() on FP32 views of each rank's local shard, a chunk at a time
(`stepper`), and rounds back stochastically (each threshold a function of the element's
index in the whole parameter: the same on every rank that holds it) or to nearest, the
remainder kept in a compensation sharded like its parameter. The compensation (a state
entry) and the rounding's seed and step count (param group entries, one-element int64
tensors: what `torch.distributed.checkpoint`'s full-state-dict load into a plain optimizer
keeps; plain ints from older checkpoints are read too) travel in `optimizer.state_dict()`;
a plain optimizer that loaded them before `initialize` hands them over. docs/fsdp.md tells
the whole story.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from ..config.values import MasterMode
from ..errors import ConfigError, NotSupportedError
from .chunks import Workspace, chunk_numel, is_elementwise, refuse_lbfgs
from .dtensors import as_param, dtensor_class, local, local_part, shard_offset
from .lowmem import (
    COMP_KEY,
    SUM_BLOCK,
    WeightPlusCompensation,
    bad_compensation,
    compensation_of,
    rounding_seed,
)
from .masters import Masters, cast_state
from .rounding import rotation
from .scaler import distributed, first_problem
from .states import StateStore
from .stepper import SHARDS, Rounding, Target, step_in_chunks

logger = logging.getLogger("ampatch")

__all__ = ["ShardedLowMem", "COMP_KEY", "SEED_KEY", "ROUNDS_KEY", "local", "local_footprint"]

F32, BF16 = torch.float32, torch.bfloat16
SEED_KEY, ROUNDS_KEY = "ampatch_seed", "ampatch_rounds"  # stochastic: param group entries


def local_footprint(params: Iterable[Any]) -> tuple[int, int]:
    """(elements, bytes) of this rank's local shards of `params`."""
    count = size = 0
    for p in params:
        mine = local(p)
        count += mine.numel()
        size += mine.numel() * mine.element_size()
    return count, size


class ShardedLowMem(Masters):
    """The low-memory mode of one optimizer over sharded params (see the module docstring).
    `ids`: the params the model cast turns bfloat16 (their compensations are made now, from
    their FP32 values); `seed`: of the stochastic rounding (default: from `torch.initial_seed()`)."""

    steps_itself = True

    def __init__(self, optimizer: torch.optim.Optimizer, ids: set[int], mode: MasterMode,
                 seed: int | None = None) -> None:
        refuse_lbfgs(optimizer, mode)
        if not is_elementwise(optimizer):
            raise ConfigError(
                f"master_weights={mode.value!r} on an FSDP2-sharded model steps each rank's shard on its own, so the "
                f"optimizer's update of an element must depend on that element alone; {type(optimizer).__name__} "
                "is not one of torch.optim's elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, "
                "NAdam, RAdam) and does not declare `ampatch_elementwise = True` (a trust ratio or a factored "
                "moment needs the whole tensor). Use master_weights=True (FSDP2's sharded FP32 masters).")
        self.mode = mode
        self.ids = ids
        self.chunk_numel: int | None = None
        self.comp: dict[int, torch.Tensor] = {}   # id(param) -> its local shard's compensation (kahan)
        self.ordinal: dict[int, int] = {}
        self.offset: dict[int, int] = {}
        self.seed = rounding_seed(seed)
        self.rounds = 0
        self._adopt_counts(optimizer)
        self.loaded: set[int] = set()  # params whose compensation an optimizer checkpoint set (until a step)
        self.names: dict[int, str] = {}  # id(param) -> its name in the model, for messages (`build` fills it)
        self.workspace = Workspace()
        super().__init__(optimizer, None)
        self.enabled = True
        for p in self.params():
            self.make(p)
        self._hook = optimizer.register_state_dict_post_hook(self._add_entries)

    def _adopt_counts(self, optimizer: torch.optim.Optimizer) -> None:
        """The seed and step count a checkpoint put in the param groups of the plain optimizer
        before `initialize` (checked, then taken out); a malformed one raises."""
        counts, problem = _counts(optimizer.param_groups)
        if problem is not None:
            raise ConfigError(f"optimizer checkpoint: {problem}; amp.initialize changed nothing.")
        _drop_counts(optimizer.param_groups)
        if counts is not None and self.mode is MasterMode.STOCHASTIC:
            self.seed, rounds = counts
            self.rounds = rounds or 0

    # ------------------------------------------------------------------ params
    def make(self, p: torch.Tensor) -> torch.Tensor:
        """Note `p` (its place, its shard's offset; for kahan, the compensation of a weight
        about to be cast); the param itself is what the optimizer steps."""
        if id(p) in self.ordinal:
            return p
        offset = shard_offset(p)
        self.ordinal[id(p)] = len(self.ordinal)
        self.offset[id(p)] = offset
        if self.mode is MasterMode.KAHAN and (id(p) in self.ids or p.dtype == BF16):
            with torch.no_grad():
                mine = local(p).detach()
                self.comp[id(p)], _ = compensation_of(mine, self._scratch(mine))
        return p

    def _scratch(self, t: torch.Tensor) -> torch.Tensor:
        """The workspace's FP32 values, for what is done to `t` a block at a time (at least
        `SUM_BLOCK` elements, or all of `t`'s, as `compensation_of` needs)."""
        budget = self.chunk_numel or chunk_numel(t.device)
        return self.workspace.take(t.device, max(1, min(max(budget, SUM_BLOCK), t.numel())), budget)[0]

    def model_params(self) -> list[torch.Tensor]:
        return list(self.params())

    def recast_state(self) -> None:
        """The optimizer computes in FP32: floating state stays FP32, whatever the params' dtype."""
        state = self.optimizer.state
        for p in list(state):
            if isinstance(p, torch.Tensor):
                state[p] = cast_state(state[p], F32)

    def follow_model(self) -> None:
        pass

    # ------------------------------------------------------------------ the step
    def step(self, call: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
             states: StateStore | None = None) -> Any:
        """One optimizer step over the local shards, a chunk at a time (`stepper.step_in_chunks`);
        FP32 params (units kept FP32) step as they are, in a call of their own, or, where
        `states` keeps the optimizer's state (optimizer_states), in place with the chunks."""
        kwargs = kwargs or {}
        if args and callable(args[0]) or kwargs.get("closure") is not None:
            raise NotSupportedError(f"optimizer.step(closure) is not supported with master_weights="
                                    f"{self.mode.value!r}: the step runs a chunk of parameters at a time.")
        kept = states is not None and states.active
        targets, own = [], []
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                direct = kept and p.dtype == F32 == p.grad.dtype  # FP32, its state kept: stepped in place
                if p.dtype != BF16 and not direct:
                    own.append((gi, p))
                    continue
                w, g = local(p).detach(), local(p.grad)
                split = not g.is_sparse and g.is_contiguous() and w.is_contiguous()
                targets.append(Target(p, gi, w, g, self.comp.get(id(p)), self.ordinal[id(p)], self.offset[id(p)],
                                      split, direct))
        device = targets[0].weight.device if targets else torch.device("cpu")
        budget = self.chunk_numel or chunk_numel(device)
        rounding = Rounding(self.mode is MasterMode.STOCHASTIC, self.seed, rotation(self.rounds))
        self.loaded.clear()
        out = step_in_chunks(self.optimizer, call, args, kwargs, targets, own, budget, self.workspace, rounding,
                             SHARDS, own_apart=True, store=states)
        # torch.distributed.checkpoint makes an optimizer's state with a step at lr 0 (nothing moves):
        # that is not a step of the rounding's
        if any(float(g.get("lr", 1.0)) != 0.0 for g in self.optimizer.param_groups):
            self.rounds += 1
        return out

    # ------------------------------------------------------------------ ranks
    def agree(self, process_group: Any) -> None:
        """At the first scale_loss, under torch.distributed: every rank takes rank 0's rounding
        seed and step count (the ranks holding an element must round it alike)."""
        if self.mode is not MasterMode.STOCHASTIC or not distributed(process_group):
            return
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        device = next((p.device for p in self.params()), torch.device("cpu"))
        agreed = torch.tensor([self.seed, self.rounds], dtype=torch.int64, device=device)
        dist.broadcast(agreed, src=src, group=process_group)
        self.seed, self.rounds = (int(v) for v in agreed.tolist())

    # ------------------------------------------------------------------ checkpoints
    def _add_entries(self, optimizer: torch.optim.Optimizer, sd: dict) -> dict:
        """`optimizer.state_dict()`'s post-hook: a copy of each compensation as its param's
        state entry (`COMP_KEY`, placed like the param), or the rounding's seed and step count
        in every param group (`SEED_KEY`, `ROUNDS_KEY`). A copy: torch.distributed.checkpoint
        loads into the tensors of a state dict in place, before `load_state_dict` checks them."""
        if self.mode is MasterMode.KAHAN:
            for i, p in enumerate(self.params()):
                c = self.comp.get(id(p))
                if c is not None:  # a dict of its own: torch's entries are the live state's dicts
                    sd["state"][i] = {**sd["state"].get(i, {}), COMP_KEY: as_param(p, c.detach().clone())}
        else:
            # one-element tensors, not 0-d ones: torch's full-state-dict load keeps those only
            counts = {SEED_KEY: torch.tensor([self.seed], dtype=torch.int64),
                      ROUNDS_KEY: torch.tensor([self.rounds], dtype=torch.int64)}
            sd["param_groups"] = [{**g, **counts} for g in sd["param_groups"]]
        return sd

    def load(self, state_dict: dict, inner: Callable, process_group: Any = None) -> None:
        """`optimizer.load_state_dict` (see `take_entries`): the entries checked on every rank
        before anything loads; torch's own load of the param groups; the state put back as it
        was saved (FP32: torch would cast it to the params' bfloat16); then the entries."""
        apply = self.take_entries(state_dict, process_group)
        saved = state_dict.get("state", {})
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        inner(dict(state_dict, state={}))  # torch checks the groups before it changes anything
        groups = self.optimizer.param_groups
        by_id = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in groups)))
        fused = {id(p) for g in groups if g.get("fused") or g.get("capturable") for p in g["params"]}
        for k, entry in saved.items():
            p = by_id.get(k)
            if p is None or not entry:
                continue
            self.optimizer.state[p] = {key: _state_value(p, key, v, id(p) in fused, self.offset[id(p)])
                                       for key, v in entry.items()}
        apply()

    def take_entries(self, state_dict: dict, process_group: Any = None) -> Callable[[], None]:
        """Take ampatch's entries out of `state_dict` and check them (a compensation: a bfloat16
        tensor of its param's shape, finite; a seed and step count: ints >= 0); a malformed one
        on any rank raises on every rank before anything loads. Returns what applies them."""
        params = list(self.params())
        # the caller's checkpoint stays as it was: its state and groups are copied before entries leave them
        state_dict["state"] = dict(state_dict.get("state", {}))
        state_dict["param_groups"] = [dict(g) for g in state_dict.get("param_groups", [])]
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        index = {k: i for i, k in enumerate(saved_ids)}
        comps, problem = {}, None
        for k, entry in list(state_dict["state"].items()):
            if isinstance(entry, dict) and COMP_KEY in entry:
                entry = state_dict["state"][k] = dict(entry)
                c = entry.pop(COMP_KEY)
                i = index.get(k)
                if i is None or i >= len(params):
                    problem = problem or f"a compensation for state entry {k!r}, which no param of the optimizer has"
                    continue
                name = self.names.get(id(params[i]), f"param {i}")
                problem = problem or bad_compensation(c, params[i], name, exact_dtype=True)
                comps[i] = c
        counts, bad = _counts(state_dict["param_groups"])
        _drop_counts(state_dict["param_groups"])  # (the caller's groups were copied above)
        problem = first_problem(problem or bad, process_group, params[0].device if params else "cpu")
        if problem is not None:
            raise ConfigError(f"optimizer checkpoint: {problem}; nothing was loaded.")

        def apply() -> None:
            kahan = self.mode is MasterMode.KAHAN
            if comps and kahan:
                with torch.no_grad():
                    for i, c in comps.items():
                        p = params[i]
                        if id(p) in self.comp:
                            self.comp[id(p)].copy_(local_part(c, p, self.offset[id(p)]))
                            self.loaded.add(id(p))
            if (comps and not kahan) or (counts and kahan):
                logger.info("ampatch: the optimizer checkpoint was saved with master_weights=%r, this session uses "
                            "%r: its %s not loaded.", "kahan" if comps else "stochastic", self.mode.value,
                            "compensation is" if comps else "rounding seed is")
            if counts and not kahan:
                self.seed, rounds = counts
                self.rounds = rounds or 0
                if rounds is None:
                    logger.info("ampatch: the optimizer checkpoint has no stochastic rounding step count: rounding "
                                "goes on from step 0, unbiased as before, but not bit for bit.")
        return apply

    def resync_from_model(self, incoming: dict[int, torch.Tensor] | None = None,
                          params: list[torch.Tensor] | None = None) -> None:
        """After the model's `load_state_dict`: a compensation takes what the loaded tensor has
        beyond its bfloat16 rounding (zero for a bfloat16 checkpoint), except one an optimizer
        checkpoint has just set where the loaded tensor has nothing beyond bfloat16: that is
        the compensation of the weight just loaded (torch.distributed.checkpoint's
        `set_state_dict` loads the optimizer before the model)."""
        if self.mode is not MasterMode.KAHAN or not incoming:
            return
        with torch.no_grad():
            for p in (params if params is not None else list(self.params())):
                src, c = incoming.get(id(p)), self.comp.get(id(p))
                if src is None or c is None:
                    continue
                values = local_part(src, p, self.offset[id(p)]).reshape(-1)
                if id(p) in self.loaded and not self._remainder(values, p, None):
                    continue
                self._remainder(values, p, c.view(-1))

    def _remainder(self, values: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None) -> bool:
        """`values` minus `p`'s local weight, into `out` (bfloat16) if given, a block at a time
        through the workspace; whether any is not zero."""
        weight, step = local(p).detach().reshape(-1), self._scratch(local(p)).numel()
        buf, rounded = self.workspace.take(weight.device, step)
        nonzero = False
        for a in range(0, values.numel(), step):
            n = min(step, values.numel() - a)
            diff = buf[:n].copy_(values[a:a + n]).sub_(rounded[:n].copy_(weight[a:a + n]))
            if out is not None:
                out[a:a + n].copy_(diff)
            else:
                nonzero = nonzero or bool(diff.any())
        return nonzero

    # ------------------------------------------------------------------ undo, report
    def unswap(self) -> Mapping[int, torch.Tensor]:
        """Nothing was swapped; returns, by param id, the FP32 values to restore the model from:
        weight + compensation, placed like the param, each made when asked for (kahan)."""
        self._hook.remove()
        if self.mode is not MasterMode.KAHAN:
            return {}
        return _PlacedSum({id(p): (p, self.comp[id(p)]) for p in self.params() if id(p) in self.comp})

    def footprint(self) -> tuple[int, int]:
        """(params, bytes) of this rank: its local shards of the weights, plus the compensations."""
        count, size = local_footprint(self.params())
        return count, size + sum(c.numel() * c.element_size() for c in self.comp.values())


class _PlacedSum(WeightPlusCompensation):
    """id(param) -> weight + compensation in FP32, placed like the (sharded) param."""

    def __getitem__(self, key: int) -> torch.Tensor:
        p, comp = self.parts[key]
        with torch.no_grad():
            return as_param(p, local(p).detach().float().add_(comp))


def _state_value(p: torch.Tensor, key: Any, value: Any, fused: bool, offset: int) -> Any:
    """A saved state value of `p`'s, as the optimizer keeps it here: on p's device, floating
    tensors in FP32 (the step count as saved, FP32 for fused/capturable optimizers), a whole
    per-element tensor placed like `p`."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        return value.to(dtype=F32, device=p.device) if fused else value
    cls = dtensor_class()
    if cls is not None and isinstance(p, cls) and not isinstance(value, cls) and value.shape == p.shape:
        value = as_param(p, local_part(value, p, offset).clone())
    return value.to(device=p.device, dtype=F32) if value.is_floating_point() else value.to(device=p.device)


def _count(value: Any) -> int | None:
    """A seed or step count as saved: an integer tensor of one element, or (older
    checkpoints) a plain int; None for anything else."""
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool \
            and value.numel() == 1:
        return int(value.item())
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _counts(groups: Sequence[dict]) -> tuple[tuple[int, int | None] | None, str | None]:
    """The stochastic rounding's (seed, step count) that param `groups` carry (the first
    group's; the count None where it was not saved) and what is wrong with any group's:
    (None, None) where no group carries them."""
    found = [(g.get(SEED_KEY), g.get(ROUNDS_KEY)) for g in groups if SEED_KEY in g or ROUNDS_KEY in g]
    problem = next((p for seed, rounds in found
                    if (p := _bad_count("seed", seed) or _bad_count("rounds", rounds, missing_ok=True))), None)
    if not found or problem is not None:
        return None, problem
    seed, rounds = found[0]
    return (_count(seed) or 0, _count(rounds)), None


def _drop_counts(groups: Sequence[dict]) -> None:
    for g in groups:
        g.pop(SEED_KEY, None)
        g.pop(ROUNDS_KEY, None)


def _bad_count(key: str, value: Any, missing_ok: bool = False) -> str | None:
    if value is None and missing_ok:
        return None
    count = _count(value)
    if count is None or count < 0:
        return f"the stochastic rounding's {key!r} must be an integer >= 0, got {value!r}"
    return None
