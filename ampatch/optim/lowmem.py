"""bfloat16 training without FP32 master copies: `master_weights="stochastic"` and `"kahan"`.

The bfloat16 model weights are the only copy (plus, for "kahan", a bfloat16 compensation of
what rounding dropped). Each has a master that aliases it outside a step; `step` runs the
user's optimizer in FP32 a chunk of parameters at a time (`chunks`), then rounds the new
values back stochastically or with the compensation (`rounding`). The whole design, its
limits and the checkpoint format: docs/lowmem.md.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base.patcher import raw_data, set_data
from ..config.values import MasterMode
from ..errors import ConfigError, NotSupportedError
from ..model.weights import Keeps, Weight, note_all, settle_all
from .chunks import Workspace, chunk_numel, is_elementwise, refuse_lbfgs
from .masters import LOWMEM_KEY, Masters, Pair, cast_state, scale_into
from .rounding import rotation
from .scaler import distributed, overflowed
from .states import StateStore
from .stepper import Rounding, Target, step_in_chunks

logger = logging.getLogger("ampatch")

__all__ = ["LowMemMasters", "COMP_KEY", "bad_compensation", "take_state_entries"]

F32, BF16 = torch.float32, torch.bfloat16
COMP_KEY = "ampatch_compensation"  # kahan: a param's entry in optimizer.state_dict()["state"]
SEED_SALT = 0x5EED_A3C7  # the rounding stream differs from the script's own draws of the same seed


def rounding_seed(seed: int | None) -> int:
    """The stochastic rounding's seed: `seed`, or one from `torch.initial_seed()` (the script's)."""
    return (torch.initial_seed() ^ SEED_SALT) % (1 << 63) if seed is None else int(seed)


SUM_BLOCK = 1 << 16  # elements summed at a time by `weight_sum` (fixed: the same values give the same sum)


def compensation_of(p: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """What bfloat16 drops of `p` (zero for a bfloat16 one), in bfloat16, and `weight_sum` of `p`
    rounded to bfloat16; computed through `scratch` (FP32, 1-D, at least `SUM_BLOCK` elements or
    all of `p`'s), a block at a time, so that no temporary of the whole parameter is made."""
    comp = torch.zeros(p.shape, dtype=BF16, device=p.device)
    flat, out, total = p.detach().reshape(-1), comp.view(-1), 0.0
    for a in range(0, flat.numel(), SUM_BLOCK):
        x, c = flat[a:a + SUM_BLOCK], out[a:a + SUM_BLOCK]
        s = scratch[:x.numel()]
        c.copy_(x)  # rounded to nearest
        s.copy_(c)
        total += float(s.sum())
        if p.dtype != BF16:
            torch.sub(x, s, out=s)
            c.copy_(s)
    if p.dtype == BF16:
        comp.zero_()
    return comp, total


def bad_compensation(c: Any, p: torch.Tensor, name: str, exact_dtype: bool = False) -> str | None:
    """Why `c` cannot be the kahan compensation of `p` (called `name` in the message), or None.
    `exact_dtype`: only bfloat16 will do (a sharded checkpoint); else an FP32 tensor (what a
    plain optimizer that loaded the checkpoint saves again) is taken too."""
    local = c.to_local() if hasattr(c, "to_local") else c
    what = (type(c).__name__ if not isinstance(c, torch.Tensor)
            else f"dtype {c.dtype}" if c.dtype != BF16 and (exact_dtype or c.dtype != F32)
            else f"shape {tuple(c.shape)}" if c.shape != p.shape else None)
    if what is not None:
        return f"the compensation of {name} (shape {tuple(p.shape)}) is {what}, not a bfloat16 tensor of its shape"
    if not bool(torch.isfinite(local).all()):
        return (f"the compensation of {name} (shape {tuple(p.shape)}) holds NaN or inf (the next step would turn "
                "its weights into NaN): the checkpoint is corrupted")
    return None


def take_state_entries(state: dict, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The kahan compensations out of a checkpoint's `state` entries (`COMP_KEY`), checked and
    taken out, so torch's own load never puts them into the optimizer's state; by param index."""
    found: dict[int, torch.Tensor] = {}
    for k, entry in list(state.items()):
        if not isinstance(entry, dict) or COMP_KEY not in entry:
            continue
        c = entry[COMP_KEY]
        i = k if isinstance(k, int) else -1
        if not 0 <= i < len(params):
            raise ConfigError(f"optimizer checkpoint: a compensation for state entry {k!r}, which no param of "
                              "this optimizer has; it was saved from another model. Nothing was loaded.")
        problem = bad_compensation(c, params[i], f"param {i}")
        if problem:
            raise ConfigError(f"optimizer checkpoint: {problem}; the checkpoint is corrupted or from another model. "
                              "Nothing was loaded.")
        found[i] = c
    for k in found:
        state[k] = {key: v for key, v in state[k].items() if key != COMP_KEY}
    return found


class WeightPlusCompensation(Mapping):
    """id(model param) -> its FP32 value, weight + compensation, computed when asked for."""

    def __init__(self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.parts = parts

    def __getitem__(self, key: int) -> torch.Tensor:
        weight, comp = self.parts[key]
        with torch.no_grad():
            return weight.detach().float().add_(comp)

    def __iter__(self) -> Iterator[int]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


class LowMemMasters(Masters):
    """The masters of one optimizer under "stochastic" or "kahan" (see the module docstring).
    `ids`: the params that get one (bfloat16 model params, or FP32 ones about to be cast);
    `seed`: of the stochastic rounding (default: from `torch.initial_seed()`)."""

    steps_itself = True

    def __init__(self, optimizer: torch.optim.Optimizer, ids: set[int], mode: MasterMode,
                 seed: int | None = None) -> None:
        if not mode.low_memory:
            raise ConfigError(f"LowMemMasters is for master_weights 'stochastic' or 'kahan', not {mode.value!r}.")
        refuse_lbfgs(optimizer, mode)
        self.mode = mode
        self.chunk_numel: int | None = None  # elements per chunk; None: by device (chunks.chunk_numel)
        self.comp: dict[int, torch.Tensor] = {}     # id(master) -> bfloat16 compensation (kahan)
        self.saved_comp: dict[int, torch.Tensor] = {}  # id(master) -> one a plain optimizer loaded, until made
        self.seed = rounding_seed(seed)
        self.rounds = 0  # optimizer steps taken: the stochastic rounding's shift (`rounding.rotation`)
        self.ordinal: dict[int, int] = {}  # id(master) -> its place in the order masters were made
        self.workspace = Workspace()  # the FP32 buffers of every chunk of every step
        super().__init__(optimizer, ids)

    # ------------------------------------------------------------------ making and aliasing
    def make(self, p: torch.Tensor) -> torch.Tensor:
        """The master of `p`: an alias of its weight (see `follow_model`), with, for "kahan", the
        part of an FP32 `p` that bfloat16 drops as its compensation."""
        if id(p) in self.master_of:
            return self.master_of[id(p)]
        if p.dtype not in (F32, BF16):
            raise ConfigError(f"master_weights={self.mode.value!r} keeps bfloat16 parameters, but this one (shape "
                              f"{tuple(p.shape)}) is {p.dtype}; use master_weights=True for float16 or float64 params.")
        with torch.no_grad():
            # an alias of the weight; of an FP32 one about to be cast, a placeholder without memory
            # until the cast (`follow_model`), so that the cast frees each FP32 weight as it goes
            alias = p.detach() if p.dtype == BF16 else torch.empty((), dtype=BF16, device=p.device).expand(p.shape)
            master = nn.Parameter(alias, requires_grad=p.requires_grad)
            saved = self.optimizer.state.get(p, {}).pop(COMP_KEY, None)  # a plain optimizer loaded our checkpoint
            if isinstance(saved, torch.Tensor) and saved.shape == p.shape:
                self.saved_comp[id(master)] = saved
            if self.mode is MasterMode.KAHAN and p.dtype == BF16:  # an FP32 one's is made as it is cast (`keeps`)
                self.compensate(p, master)
        self.model_of[id(master)] = p
        self.master_of[id(p)] = master
        self.ordinal[id(master)] = len(self.ordinal)
        state = self.optimizer.state
        if p in state:
            state[master] = cast_state(state.pop(p), F32)
        return master

    def compensate(self, p: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The kahan compensation of `p` (what bfloat16 drops of its values; the one a plain
        optimizer kept from our checkpoint, where it did), made once."""
        comp = self.comp.get(id(master))
        if comp is None:  # a block's scratch, not the step's workspace: initialize makes no chunk-sized buffers
            comp, _ = compensation_of(p, torch.empty(min(SUM_BLOCK, p.numel()), dtype=F32, device=p.device))
            saved = self.saved_comp.pop(id(master), None)
            if saved is not None:
                comp.copy_(saved)
            self.comp[id(master)] = comp
        return comp

    def keeps(self, p: torch.Tensor) -> tuple[Keeps, torch.Tensor | None, torch.Tensor | None] | None:
        """What the model param `p` keeps besides its bfloat16 weight, asked just before its
        module is cast: a kahan compensation, made now (so the FP32 weights go one module at a
        time, and `initialize` peaks no higher than with FP32 masters), or nothing ("stochastic")."""
        m = self.master_of.get(id(p))
        if m is None:
            return None
        if self.mode is MasterMode.KAHAN:
            return Keeps.COMPENSATED, None, self.compensate(p, m)
        return Keeps.HALF_ONLY, None, None

    def attach(self, lookup: Callable[[torch.Tensor], Weight | None]) -> None:
        """The records of the cast model, and a compensation for every kahan master (one whose
        param was never cast gets its own now)."""
        if self.mode is MasterMode.KAHAN:
            for mp, m in self.pairs():
                self.compensate(mp, m)
        super().attach(lookup)

    def follow_model(self) -> None:
        """Every master aliases its model param's current storage again (after the model cast
        replaced the FP32 tensors, and at each step in case something else did)."""
        for mp, m in self.pairs():
            if m.data_ptr() != mp.data_ptr() or m.dtype != mp.dtype or m.shape != mp.shape:
                set_data(m, raw_data(mp))  # ampatch's own: not a user's `.data` write (`DataWatch`)

    def recast_state(self) -> None:
        """After the model was cast or restored: the masters follow it; their optimizer state
        stays FP32 (the dtype the optimizer computes in), other params' state follows the param."""
        self.follow_model()
        state = self.optimizer.state
        for p in list(state):
            if isinstance(p, torch.Tensor):
                state[p] = cast_state(state[p], F32 if id(p) in self.model_of else p.dtype)

    def copy_to_model(self, pairs: list[Pair] | None = None) -> None:
        """Nothing to copy: the masters are the model's weights (they alias them); the weights
        are as ampatch wrote them (`Weight.note`)."""
        self.follow_model()
        note_all(self.record_of.values())

    # ------------------------------------------------------------------ grads
    def move_grads(self, pairs: list[Pair], inv_scale: float = 1.0, found_inf: torch.Tensor | None = None,
                   check: bool = False) -> torch.Tensor | None:
        """Model grads -> master grads, moved (no copy: they stay bfloat16), times `inv_scale`
        in place and added to what is there; model grads -> None. With `check`, inf/NaN are
        ORed into `found_inf` (returned)."""
        masters, grads = [], []
        for mp, m in pairs:
            g = mp.grad
            if g is not None:
                mp.grad = None
                if g.is_sparse:
                    g = g.coalesce()
                masters.append(m)
                grads.append(g if g.dtype == m.dtype else g.to(m.dtype))
        if not masters:
            return found_inf
        return scale_into(masters, grads, inv_scale, found_inf, check)

    # ------------------------------------------------------------------ the step
    def step(self, call: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
             states: StateStore | None = None) -> Any:
        """One optimizer step, a chunk at a time (`stepper.step_in_chunks`; docs/lowmem.md);
        `call(*args, **kwargs)` is the optimizer's own step(), called once per chunk; returns
        what the last call returned; the masters' grads are spent. `states`: the optimizer's kept state."""
        kwargs = kwargs or {}
        if args and callable(args[0]) or kwargs.get("closure") is not None:
            raise NotSupportedError(f"optimizer.step(closure) is not supported with master_weights="
                                    f"{self.mode.value!r}: the step runs a chunk of parameters at a time.")
        self.follow_model()
        self.settle()  # a write to a weight since the last step: its compensation no longer applies
        elementwise = is_elementwise(self.optimizer)
        own, targets = [], []  # (group, param) that are their own masters; what steps in chunks
        kept, place = states is not None and states.active, len(self.ordinal)  # own params' places: after the masters'
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                mp, g = self.model_of.get(id(p)), p.grad
                place += mp is None
                direct = mp is None and kept and g is not None and p.dtype == F32 == g.dtype  # FP32, its state kept
                if mp is None and not direct:
                    own.append((gi, p))
                elif g is not None:
                    w = p if mp is None else mp  # direct: no model param, the FP32 param itself
                    split = elementwise and not g.is_sparse and g.is_contiguous() and w.is_contiguous()
                    targets.append(Target(p, gi, w, g, self.comp.get(id(p)), place if direct else self.ordinal[id(p)],
                                          0, split, direct))
        budget = self.chunk_numel or (chunk_numel(targets[0].weight.device) if targets else 1)
        rounding = Rounding(self.mode is MasterMode.STOCHASTIC, self.seed, rotation(self.rounds))
        try:
            out = step_in_chunks(self.optimizer, call, args, kwargs, targets, own, budget, self.workspace, rounding,
                                 store=states)
        finally:
            for t in targets:
                t.key.grad = None if not t.direct else t.key.grad
            note_all(self.record_of.values())
        self.rounds += 1
        return out

    def scratch(self, device: torch.device, numel: int) -> torch.Tensor:
        """An FP32 buffer on `device` (the workspace's values), for what is done to a tensor of
        `numel` elements a block at a time (`compensation_of`, `weight_sum`)."""
        budget = max(self.chunk_numel or chunk_numel(device), SUM_BLOCK)
        values = self.workspace.buffers.get(device, (None,))[0]
        return self.workspace.take(device, max(min(budget, numel), 0 if values is None else values.numel()))[0]

    # ------------------------------------------------------------------ ranks, checkpoints
    def agree(self, process_group: Any) -> None:
        """Under torch.distributed, at the first scale_loss: every rank takes rank 0's rounding
        seed and step count (the ranks' weights stay identical only if they round alike); and if on any
        rank a weight was written since its compensation was made (DDP broadcast rank 0's weights
        into the model: `Weight.settle` zeroed that rank's compensation), every rank drops its
        compensation."""
        pairs = list(self.pairs())
        if not pairs or not distributed(process_group):
            return
        device = pairs[0][0].device
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        with torch.no_grad():
            if self.mode is MasterMode.STOCHASTIC:
                agreed = torch.tensor([self.seed, self.rounds], dtype=torch.int64, device=device)
                dist.broadcast(agreed, src=src, group=process_group)
                self.seed, self.rounds = (int(v) for v in agreed.tolist())
                return
            records = self.records(pairs)
            settle_all(records)
            stale = any(r.widened for r in records)
            for r in records:
                r.widened = False
            flag = torch.full((), float(stale), dtype=torch.float32, device=device)
            if overflowed(flag, process_group):  # MAX: any rank
                for c in self.comp.values():
                    c.zero_()
                logger.info("ampatch: the kahan compensations were dropped on every rank (the ranks' weights "
                            "differed when amp.initialize made them); seed every rank alike to keep the FP32 "
                            "initial weights.")

    def checkpoint(self) -> dict[str, Any]:
        """The entry `optimizer.state_dict()` carries (`LOWMEM_KEY`, see `check_lowmem_entry`):
        the mode, and the stochastic rounding's seed and step count. A kahan compensation goes
        into its param's state entry instead (`state_entries`)."""
        self.settle()
        entry: dict[str, Any] = {"mode": self.mode.value}
        if self.mode is MasterMode.STOCHASTIC:
            entry["seed"] = self.seed
            entry["rounds"] = self.rounds
        return {LOWMEM_KEY: entry}

    def state_entries(self, state: dict[int, dict]) -> None:
        """`optimizer.state_dict()["state"]`, by param index: each kahan compensation joins its
        param's entry (`COMP_KEY`), aliased, so a plain optimizer that loads the checkpoint
        before `initialize` hands it back, and a strict load into a plain model is unaffected."""
        for i, p in enumerate(self.params()):
            c = self.comp.get(id(p))
            if c is not None:
                state[i] = {**state.get(i, {}), COMP_KEY: c.detach()}

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """While torch's `load_state_dict` runs: the masters read as FP32 (zero-stride
        placeholders, no memory), so torch loads their state in FP32 instead of casting it to
        bfloat16; then they alias the model again."""
        try:
            for _, m in self.pairs():
                m.data = torch.empty((), dtype=F32, device=m.device).expand(m.shape)
            yield
        finally:
            self.follow_model()

    def take_saved(self, params: list[torch.Tensor], saved: list[torch.Tensor | None]) -> None:
        """FP32 masters of an O2/O5 checkpoint: the weight takes each rounded to nearest, the
        compensation (kahan) the rest."""
        self.follow_model()
        with torch.no_grad():
            for p, value in zip(params, saved):
                if value is None:
                    continue
                p.copy_(value)
                if id(p) in self.comp:
                    self.comp[id(p)].copy_(value.to(p.device, F32) - p.float())
        note_all(self.record_of.values())

    def take_comps(self, comps: dict[int, torch.Tensor], params: list[torch.Tensor]) -> None:
        """Checked compensations of a checkpoint (`take_state_entries`), by param index, into
        the weights' compensations."""
        if self.mode is not MasterMode.KAHAN:
            if comps:
                logger.info("ampatch: the optimizer checkpoint was saved with master_weights='kahan', this session "
                            "uses %r: its compensations are not loaded.", self.mode.value)
            return
        with torch.no_grad():
            for i, c in comps.items():
                if id(params[i]) in self.comp:
                    self.comp[id(params[i])].copy_(c)

    def load_lowmem(self, entry: dict[str, Any], params: list[torch.Tensor]) -> None:
        """The checked `LOWMEM_KEY` entry of a checkpoint: the rounding's seed and step count
        (and the compensations of a checkpoint written before they moved into the state)."""
        if entry["mode"] != self.mode.value:
            logger.info("ampatch: the optimizer checkpoint was saved with master_weights=%r, this session uses %r: "
                        "its %s not loaded.", entry["mode"], self.mode.value,
                        "compensation is" if entry["mode"] == "kahan" else "rounding seed is")
        comp = entry.get("compensation")
        if comp is not None and self.mode is MasterMode.KAHAN:
            with torch.no_grad():
                for p, c in zip(params, comp):
                    if c is not None and id(p) in self.comp:
                        self.comp[id(p)].copy_(c)
        if self.mode is MasterMode.STOCHASTIC and entry["mode"] == self.mode.value:
            self.seed = int(entry.get("seed", self.seed))
            self.rounds = int(entry.get("rounds", 0))
            if "rounds" not in entry:
                logger.info("ampatch: the optimizer checkpoint has no stochastic rounding step count ('rounds'): "
                            "rounding goes on from step 0, unbiased as before, but the resumed run will not repeat "
                            "the uninterrupted one bit for bit.")

    def unswap(self) -> dict[int, torch.Tensor]:
        """Model params back into param_groups; the model's records restore each weight (kahan:
        weight + compensation, one at a time)."""
        super().unswap()
        return {}

    def footprint(self) -> tuple[int, int]:
        """(params, bytes) of what the optimizer steps: weights plus compensations."""
        count = size = 0
        for p in self.params():
            mp = self.model_of.get(id(p), p)  # a master aliases its weight: no bytes of its own
            count += mp.numel()
            size += mp.numel() * mp.element_size()
        return count, size + sum(c.numel() * c.element_size() for c in self.comp.values())

