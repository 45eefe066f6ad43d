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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.values import MasterMode
from .masters import LOWMEM_KEY, Masters, Pair, cast_state, scale_into
from .chunks import chunk_numel, has_step_hooks, narrowed, plan_chunks, step_hooks_once
from .rounding import rotation, stochastic_round_
from .scaler import distributed, overflowed

logger = logging.getLogger("ampatch")

__all__ = ["LowMemMasters"]

F32, BF16 = torch.float32, torch.bfloat16
SEED_SALT = 0x5EED_A3C7  # the rounding stream differs from the script's own draws of the same seed
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9)  # odd 64-bit constants: a chunk's seed from (seed, ordinal)


def chunk_seed(seed: int, ordinal: int, part: int) -> int:
    """The rounding generator's seed for the chunk whose first master is the `ordinal`-th made,
    its `part`-th device: the same at every step and on every rank."""
    return (seed * _MIX[0] + ordinal * _MIX[1] + part) % (1 << 63)


class LowMemMasters(Masters):
    """The masters of one optimizer under "stochastic" or "kahan" (see the module docstring).
    `ids`: the params that get one (bfloat16 model params, or FP32 ones about to be cast);
    `seed`: of the stochastic rounding (default: from `torch.initial_seed()`)."""

    steps_itself = True

    def __init__(self, optimizer: torch.optim.Optimizer, ids: set[int], mode: MasterMode,
                 seed: int | None = None) -> None:
        if not mode.low_memory:
            raise ValueError(f"LowMemMasters is for master_weights 'stochastic' or 'kahan', not {mode.value!r}.")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(f"master_weights={mode.value!r} steps the parameters a chunk at a time, and LBFGS needs "
                             "all of them at once (it re-evaluates a closure over the whole model); use "
                             "master_weights=True (FP32 masters) with LBFGS.")
        self.mode = mode
        self.chunk_numel: int | None = None  # elements per chunk; None: by device (chunks.chunk_numel)
        self.comp: dict[int, torch.Tensor] = {}     # id(master) -> bfloat16 compensation (kahan)
        self.baseline: dict[int, float] = {}        # id(master) -> sum of the weight it was made for (kahan)
        self.seed = (torch.initial_seed() ^ SEED_SALT) % (1 << 63) if seed is None else int(seed)
        self.rounds = 0  # optimizer steps taken: the stochastic rounding's shift (`rounding.rotation`)
        self.ordinal: dict[int, int] = {}  # id(master) -> its place in the order masters were made
        self.generators: dict[torch.device, torch.Generator] = {}  # scratch, reseeded per chunk
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
            master = nn.Parameter(p.detach(), requires_grad=p.requires_grad)  # an alias until the step
            if self.mode is MasterMode.KAHAN:
                w = p.detach().to(BF16)
                self.comp[id(master)] = ((p.detach() - w.float()).to(BF16) if p.dtype == F32
                                         else torch.zeros_like(w))
                self.baseline[id(master)] = float(w.double().sum())
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
        """One optimizer step, a chunk at a time (see the module docstring); `call(*args,
        **kwargs)` is the optimizer's own step(), called once per chunk; returns what the
        last call returned. A step that raises leaves the chunks before it stepped and the
        raising chunk's values (as far as the optimizer got) in the model."""
        kwargs = kwargs or {}
        if args and callable(args[0]) or kwargs.get("closure") is not None:
            raise NotImplementedError(f"optimizer.step(closure) is not supported with master_weights="
                                      f"{self.mode.value!r}: the step runs a chunk of parameters at a time.")
        self.follow_model()
        own, work = [], []  # params that are their own masters; (model param, master) with a grad
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                mp = self.model_of.get(id(p))
                if mp is None:
                    own.append(p)
                elif p.grad is not None:
                    work.append((mp, p))
        budget = self.chunk_numel or (chunk_numel(work[0][0].device) if work else 1)
        chunks = plan_chunks([m.numel() for _, m in work], budget) or [[]]
        hooks = (step_hooks_once(self.optimizer, args, kwargs) if has_step_hooks(self.optimizer)
                 else contextlib.nullcontext(lambda: (args, kwargs)))
        out = None
        with hooks as arguments:
            for k, indices in enumerate(chunks):
                chunk = [work[i] for i in indices]
                members = {id(m) for _, m in chunk} | ({id(p) for p in own} if k == 0 else set())
                lifted = self._lift(chunk)
                try:
                    with narrowed(self.optimizer, members):
                        a, kw = arguments()
                        out = call(*a, **kw)
                finally:
                    self._lower(lifted, self.ordinal[id(chunk[0][1])] if chunk else 0)
        self.rounds += 1
        return out

    def _lift(self, chunk: list[Pair]) -> list[tuple[list[Pair], torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
        """The chunk's masters on FP32 views (values: weight [+ compensation]; grads: FP32),
        one flat buffer per device for each. Returns what `_lower` needs."""
        by_device: dict[torch.device, list[Pair]] = {}
        for mp, m in chunk:
            by_device.setdefault(mp.device, []).append((mp, m))
        lifted = []
        with torch.no_grad():
            for device, items in by_device.items():
                sizes = [m.numel() for _, m in items]
                flat = torch.empty(sum(sizes), dtype=F32, device=device)
                gflat = torch.empty(sum(sizes), dtype=F32, device=device)
                views = [v.view(m.shape) for v, (_, m) in zip(flat.split(sizes), items)]
                gviews = [v.view(m.shape) for v, (_, m) in zip(gflat.split(sizes), items)]
                torch._foreach_copy_(views, [mp for mp, _ in items])
                if self.comp:
                    torch._foreach_add_(views, [self.comp[id(m)] for _, m in items])
                dense = [i for i, (_, m) in enumerate(items) if not m.grad.is_sparse]
                if dense:
                    torch._foreach_copy_([gviews[i] for i in dense], [items[i][1].grad for i in dense])
                for (_, m), v, gv in zip(items, views, gviews):
                    g = m.grad
                    m.grad = None
                    m.data = v
                    m.grad = g.to(F32) if g.is_sparse else gv
                lifted.append((items, flat, gflat, views))
        return lifted

    def _lower(self, lifted: list[tuple[list[Pair], torch.Tensor, torch.Tensor, list[torch.Tensor]]],
               ordinal: int) -> None:
        """The chunk's new FP32 values back into the bfloat16 weights (and compensations); the
        masters alias the model again, without grads. `ordinal`: of the chunk's first master
        (the stochastic rounding's draws depend on it, not on the step)."""
        with torch.no_grad():
            for part, (items, flat, gflat, views) in enumerate(lifted):
                model = [mp for mp, _ in items]
                if self.mode is MasterMode.STOCHASTIC:
                    g = self.generator(flat.device).manual_seed(chunk_seed(self.seed, ordinal, part))
                    stochastic_round_(flat, gflat, g, rotation(self.rounds))
                    torch._foreach_copy_(model, views)  # exact: the low bits are zero
                else:
                    torch._foreach_copy_(model, views)  # to nearest
                    torch._foreach_sub_(views, model)   # what rounding dropped (exact in FP32)
                    torch._foreach_copy_([self.comp[id(m)] for _, m in items], views)
                for mp, m in items:
                    m.grad = None
                    m.data = mp.data

    def generator(self, device: torch.device) -> torch.Generator:
        """A scratch generator on `device` for the stochastic rounding (reseeded per chunk)."""
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device=device)
        return g

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
            stale = any(abs(float(mp.detach().double().sum()) - self.baseline[id(m)]) > 1e-6 * (1 + abs(self.baseline[id(m)]))
                        for mp, m in pairs if id(m) in self.baseline)
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
                self.baseline[id(m)] = float(self.model_of[id(m)].detach().double().sum())

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

    def unswap(self) -> dict[int, torch.Tensor]:
        """Model params back into param_groups; returns, by model param id, the values the
        model is restored from: weight + compensation in FP32 (kahan), nothing (stochastic:
        the weight is the value)."""
        values = {}
        if self.mode is MasterMode.KAHAN:
            with torch.no_grad():
                values = {id(mp): mp.float() + self.comp[id(m)].float() for mp, m in self.pairs()}
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

