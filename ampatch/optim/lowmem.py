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
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.values import MasterMode
from .masters import LOWMEM_KEY, Masters, Pair, cast_state, scale_into
from .chunks import Workspace, chunk_numel, is_elementwise
from .rounding import rotation
from .scaler import distributed, overflowed
from .stepper import Rounding, Target, step_in_chunks

logger = logging.getLogger("ampatch")

__all__ = ["LowMemMasters"]

F32, BF16 = torch.float32, torch.bfloat16
SEED_SALT = 0x5EED_A3C7  # the rounding stream differs from the script's own draws of the same seed


def rounding_seed(seed: int | None) -> int:
    """The stochastic rounding's seed: `seed`, or one from `torch.initial_seed()` (the script's)."""
    return (torch.initial_seed() ^ SEED_SALT) % (1 << 63) if seed is None else int(seed)


def refuse_lbfgs(optimizer: torch.optim.Optimizer, mode: MasterMode) -> None:
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"master_weights={mode.value!r} steps the parameters a chunk at a time, and LBFGS needs "
                         "all of them at once (it re-evaluates a closure over the whole model); use "
                         "master_weights=True (FP32 masters) with LBFGS.")


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


def weight_sum(t: torch.Tensor, scratch: torch.Tensor) -> float:
    """The sum of `t`'s values, a `SUM_BLOCK` at a time in FP32 through `scratch` (no temporary
    of the whole tensor): the same for the same values, so a change of the weights shows."""
    flat, total = t.detach().reshape(-1), 0.0
    for a in range(0, flat.numel(), SUM_BLOCK):
        x = flat[a:a + SUM_BLOCK]
        total += float(scratch[:x.numel()].copy_(x).sum())
    return total


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
            raise ValueError(f"LowMemMasters is for master_weights 'stochastic' or 'kahan', not {mode.value!r}.")
        refuse_lbfgs(optimizer, mode)
        self.mode = mode
        self.chunk_numel: int | None = None  # elements per chunk; None: by device (chunks.chunk_numel)
        self.comp: dict[int, torch.Tensor] = {}     # id(master) -> bfloat16 compensation (kahan)
        self.baseline: dict[int, float] = {}        # id(master) -> sum of the weight it was made for (kahan)
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
            raise ValueError(f"master_weights={self.mode.value!r} keeps bfloat16 parameters, but this one (shape "
                             f"{tuple(p.shape)}) is {p.dtype}; use master_weights=True for float16 or float64 params.")
        with torch.no_grad():
            # an alias of the weight; of an FP32 one about to be cast, a placeholder without memory
            # until the cast (`follow_model`), so that the cast frees each FP32 weight as it goes
            alias = p.detach() if p.dtype == BF16 else torch.empty((), dtype=BF16, device=p.device).expand(p.shape)
            master = nn.Parameter(alias, requires_grad=p.requires_grad)
            if self.mode is MasterMode.KAHAN:
                self.comp[id(master)], self.baseline[id(master)] = compensation_of(p, self.scratch(p.device, p.numel()))
        self.model_of[id(master)] = p
        self.master_of[id(p)] = master
        self.ordinal[id(master)] = len(self.ordinal)
        state = self.optimizer.state
        if p in state:
            state[master] = cast_state(state.pop(p), F32)
        return master

    def follow_model(self) -> None:
        """Every master aliases its model param's current storage again (after the model cast
        replaced the FP32 tensors, and at each step in case something else did)."""
        for mp, m in self.pairs():
            if m.data_ptr() != mp.data_ptr() or m.dtype != mp.dtype or m.shape != mp.shape:
                m.data = mp.data

    def recast_state(self) -> None:
        """After the model was cast or restored: the masters follow it; their optimizer state
        stays FP32 (the dtype the optimizer computes in), other params' state follows the param."""
        self.follow_model()
        state = self.optimizer.state
        for p in list(state):
            if isinstance(p, torch.Tensor):
                state[p] = cast_state(state[p], F32 if id(p) in self.model_of else p.dtype)

    def copy_to_model(self, pairs: list[Pair] | None = None) -> None:
        """Nothing to copy: the masters are the model's weights (they alias them)."""
        self.follow_model()

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
    def step(self, call: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """One optimizer step, a chunk at a time (`stepper.step_in_chunks`; docs/lowmem.md);
        `call(*args, **kwargs)` is the optimizer's own step(), called once per chunk; returns
        what the last call returned. The masters' (bfloat16) grads are spent: None after."""
        kwargs = kwargs or {}
        if args and callable(args[0]) or kwargs.get("closure") is not None:
            raise NotImplementedError(f"optimizer.step(closure) is not supported with master_weights="
                                      f"{self.mode.value!r}: the step runs a chunk of parameters at a time.")
        self.follow_model()
        elementwise = is_elementwise(self.optimizer)
        own, targets = [], []  # (group, param) that are their own masters; what steps in chunks
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                mp = self.model_of.get(id(p))
                if mp is None:
                    own.append((gi, p))
                elif p.grad is not None:
                    g = p.grad
                    split = elementwise and not g.is_sparse and g.is_contiguous() and mp.is_contiguous()
                    targets.append(Target(p, gi, mp, g, self.comp.get(id(p)), self.ordinal[id(p)], 0, split))
        budget = self.chunk_numel or (chunk_numel(targets[0].weight.device) if targets else 1)
        rounding = Rounding(self.mode is MasterMode.STOCHASTIC, self.seed, rotation(self.rounds))
        try:
            out = step_in_chunks(self.optimizer, call, args, kwargs, targets, own, budget, self.workspace, rounding)
        finally:
            for t in targets:
                t.key.grad = None
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
        rank a weight changed since its compensation was made (DDP broadcast rank 0's weights
        into the model), every rank drops its compensation."""
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
            stale = any(abs(weight_sum(mp, self.scratch(mp.device, mp.numel())) - self.baseline[id(m)])
                        > 1e-6 * (1 + abs(self.baseline[id(m)])) for mp, m in pairs if id(m) in self.baseline)
            if overflowed(torch.full((), float(stale), dtype=torch.float32, device=device), process_group):  # MAX: any rank
                for c in self.comp.values():
                    c.zero_()
                logger.info("ampatch: the kahan compensations were dropped on every rank (the ranks' weights "
                            "differed when amp.initialize made them); seed every rank alike to keep the FP32 "
                            "initial weights.")
            self._note_baseline(m for _, m in pairs)

    def _note_baseline(self, masters: Iterable[torch.Tensor]) -> None:
        for m in masters:
            if id(m) in self.comp:
                mp = self.model_of[id(m)]
                self.baseline[id(m)] = weight_sum(mp, self.scratch(mp.device, mp.numel()))

    def saved_value(self, p: torch.Tensor) -> torch.Tensor | None:
        """What `model.state_dict()` saves for the bfloat16 weight `p`: under "kahan", weight +
        compensation in FP32 (`joined`), which `make` (load, then initialize) and
        `resync_from_model` (initialize, then load) split back exactly; None under
        "stochastic" (the weight is the value)."""
        m = self.master_of.get(id(p))
        c = self.comp.get(id(m)) if m is not None else None
        if c is None or c.shape != p.shape or c.device != p.device:
            return None
        return self.joined(p.detach(), c)

    @staticmethod
    def joined(weight: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
        """A bfloat16 weight and its kahan compensation as one FP32 tensor that splits back into
        both exactly (w = its bfloat16 rounding, c = the rest's): w + c, exact in FP32; where
        that is a tie bfloat16 would round away from w (c is half an ulp), one FP32 ulp toward w."""
        with torch.no_grad():
            w = weight.float()
            v = w + comp.float()
            off = v.to(BF16) != weight
            if bool(off.any()):
                v = torch.where(off, torch.nextafter(v, w), v)
        return v

    def checkpoint(self) -> dict[str, Any]:
        """The entry `optimizer.state_dict()` carries (`LOWMEM_KEY`, see `check_lowmem_entry`)."""
        entry: dict[str, Any] = {"mode": self.mode.value}
        if self.mode is MasterMode.KAHAN:
            entry["compensation"] = [self.comp[id(p)].detach().clone() if id(p) in self.comp else None
                                     for p in self.params()]
        else:
            entry["seed"] = self.seed
            entry["rounds"] = self.rounds
        return {LOWMEM_KEY: entry}

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
        self._note_baseline(p for p, v in zip(params, saved) if v is not None)

    def load_lowmem(self, entry: dict[str, Any], params: list[torch.Tensor]) -> None:
        """The checked `LOWMEM_KEY` entry of a checkpoint: compensations, or the rounding's seed
        and step count."""
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
            self._note_baseline(params)
        if self.mode is MasterMode.STOCHASTIC and entry["mode"] == self.mode.value:
            self.seed = int(entry.get("seed", self.seed))
            self.rounds = int(entry.get("rounds", 0))
            if "rounds" not in entry:
                logger.info("ampatch: the optimizer checkpoint has no stochastic rounding step count ('rounds'): "
                            "rounding goes on from step 0, unbiased as before, but the resumed run will not repeat "
                            "the uninterrupted one bit for bit.")

    def resync_from_model(self, incoming: dict[int, torch.Tensor] | None = None,
                          params: list[torch.Tensor] | None = None) -> None:
        """After `model.load_state_dict`: the masters alias the loaded weights; a compensation
        takes what the loaded tensor has beyond its bfloat16 rounding (zero for a bfloat16
        checkpoint, the exact remainder for an FP32 one)."""
        self.follow_model()
        if self.mode is not MasterMode.KAHAN or not incoming:
            return
        with torch.no_grad():
            for mp in (params if params is not None else [mp for mp, _ in self.pairs()]):
                m, src = self.master_of.get(id(mp)), incoming.get(id(mp))
                if m is not None and src is not None:
                    self.comp[id(m)].copy_(src.to(mp.device, F32) - mp.float())
                    self._note_baseline([m])

    def unswap(self) -> Mapping[int, torch.Tensor]:
        """Model params back into param_groups; returns, by model param id, the values the
        model is restored from: weight + compensation in FP32 (kahan), each made when it is
        asked for (not all at once beside the bfloat16 model), nothing (stochastic: the weight
        is the value)."""
        values: Mapping[int, torch.Tensor] = {}
        if self.mode is MasterMode.KAHAN:
            values = WeightPlusCompensation({id(mp): (mp, self.comp[id(m)]) for mp, m in self.pairs()})
        super().unswap()
        return values

    def footprint(self) -> tuple[int, int]:
        """(params, bytes) of what the optimizer steps: weights plus compensations."""
        count = size = 0
        for p in self.params():
            mp = self.model_of.get(id(p), p)  # a master aliases its weight: no bytes of its own
            count += mp.numel()
            size += mp.numel() * mp.element_size()
        return count, size + sum(c.numel() * c.element_size() for c in self.comp.values())

