"""FP32 master weights of one optimizer: made, swapped into its param_groups, kept in sync.

Under O2/O5 the half parameters of the model are replaced, in the optimizer's param_groups,
by FP32 masters made from the FP32 weights before the model was cast; FP32 parameters
(batch norm, or every parameter at O1) are their own masters. `Masters` is that bookkeeping
for one optimizer (which master belongs to which model param, copying between them, moving
model grads into master grads, the checkpoint entry, undoing the swap). When and why grads
move is `optim.handle.OptimizerHandle`'s job.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..base.dtypes import LOW
from ..config.values import MasterMode
from ..errors import ConfigError, ConfigTypeError, InternalError
from ..model.weights import Keeps, Weight, keep_exact, note_all, settle_all
from .scaler import distributed, overflowed, unscale_

logger = logging.getLogger("ampatch")

MASTERS_KEY = "ampatch_masters"  # the masters' entry in an optimizer's state_dict()
LOWMEM_KEY = "ampatch_lowmem"  # master_weights "stochastic"/"kahan": their entry (see lowmem)
COPY_NUMEL = 1 << 22  # grad elements converted into FP32 master grads per foreach call (the rest waits, half)

Pair = tuple[torch.Tensor, torch.Tensor]  # (half model param, its FP32 master)


def add_grads(params: Sequence[torch.Tensor], extra: Sequence[torch.Tensor]) -> None:
    """p.grad += g for each pair (p.grad = g where p has none): dense pairs in one foreach
    call, sparse grads (nn.Embedding(sparse=True)) one by one."""
    to, frm = [], []
    for p, g in zip(params, extra):
        if p.grad is None:
            p.grad = g
        elif p.grad.is_sparse or g.is_sparse:
            p.grad = g + p.grad if p.grad.is_sparse and not g.is_sparse else p.grad + g
        else:
            to.append(p.grad)
            frm.append(g)
    if to:
        torch._foreach_add_(to, frm)


def scale_into(params: Sequence[torch.Tensor], grads: list[torch.Tensor], inv_scale: float,
               found_inf: torch.Tensor | None, check: bool) -> torch.Tensor | None:
    """`grads` (new tensors, scaled) times `inv_scale` in place, then added to `params`' grads
    (`add_grads`). With `check`, the unscale also ORs inf/NaN into `found_inf` (returned)."""
    if check:
        found_inf = unscale_(grads, inv_scale, found_inf)
    elif inv_scale != 1.0:
        torch._foreach_mul_(grads, inv_scale)
    add_grads(params, grads)
    return found_inf


def _no_record(p: torch.Tensor) -> Weight | None:
    return None


def check_masters(masters: Any, params: list[torch.Tensor]) -> None:
    """The saved masters of an optimizer checkpoint fit `params` (one entry per param, in
    param_groups order: None or a floating tensor of the param's shape)."""
    if not isinstance(masters, (list, tuple)):
        raise ConfigTypeError(f"optimizer checkpoint: '{MASTERS_KEY}' must be a list (one entry per param), got "
                              f"{type(masters).__name__}; the checkpoint was not saved by ampatch's "
                              "optimizer.state_dict().")
    if len(masters) != len(params):
        raise ConfigError(f"optimizer checkpoint has {len(masters)} master entries for {len(params)} params; "
                          "it was saved from a different model or optimizer. Nothing was loaded.")
    for i, (p, saved) in enumerate(zip(params, masters)):
        if saved is None:
            continue
        if not isinstance(saved, torch.Tensor) or not saved.is_floating_point() or saved.shape != p.shape:
            what = (f"shape {tuple(saved.shape)}" if isinstance(saved, torch.Tensor) and saved.is_floating_point()
                    else type(saved).__name__ if not isinstance(saved, torch.Tensor) else str(saved.dtype))
            raise ConfigError(f"optimizer checkpoint: master {i} has {what}, its param has shape {tuple(p.shape)}; "
                              "it was saved from a different model or optimizer. Nothing was loaded.")


def check_lowmem_entry(entry: Any, params: list[torch.Tensor]) -> None:
    """The `LOWMEM_KEY` entry of an optimizer checkpoint fits `params` (checked before anything
    is loaded): {"mode": str, "compensation": [None | tensor of the param's shape, ...] (kahan),
    "seed": int, "rounds": int >= 0 (stochastic)}."""
    bad = "it was not saved by ampatch's optimizer.state_dict(), or from another model. Nothing was loaded."
    if not isinstance(entry, dict) or entry.get("mode") not in [m.value for m in MasterMode if m.low_memory]:
        raise ConfigError(f"optimizer checkpoint: '{LOWMEM_KEY}' must be a dict with 'mode' 'stochastic' or 'kahan'; "
                          + bad)
    comp = entry.get("compensation")
    if comp is not None:
        if not isinstance(comp, (list, tuple)) or len(comp) != len(params):
            raise ConfigError(f"optimizer checkpoint: {len(comp) if isinstance(comp, (list, tuple)) else 'no list of'} "
                              f"compensation entries for {len(params)} params; " + bad)
        for i, (p, c) in enumerate(zip(params, comp)):
            if c is None:
                continue
            what = (type(c).__name__ if not isinstance(c, torch.Tensor)
                    else f"dtype {c.dtype}" if c.dtype != torch.bfloat16
                    else f"shape {tuple(c.shape)}" if c.shape != p.shape else None)
            if what is not None:
                raise ConfigError(f"optimizer checkpoint: compensation {i} (of param {i}, shape {tuple(p.shape)}) is "
                                  f"{what}, not a bfloat16 tensor of its param's shape; " + bad)
            if not bool(torch.isfinite(c).all()):
                raise ConfigError(f"optimizer checkpoint: compensation {i} (of param {i}, shape {tuple(p.shape)}) "
                                  "holds NaN or inf: the next step would turn its weights into NaN. The checkpoint is "
                                  "corrupted; nothing was loaded.")
    for key in ("seed", "rounds"):
        value = entry.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"optimizer checkpoint: the stochastic rounding's {key!r} must be an int >= 0, got "
                              f"{value!r}; " + bad)


def cast_state(state: dict, dtype: torch.dtype) -> dict:
    """One param's optimizer state with its floating tensors in `dtype` (`step` stays as is)."""
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
            for k, v in state.items()}


def master_ids(optimizer: torch.optim.Optimizer, cast_ids: set[int]) -> set[int]:
    """The params of `optimizer` that get an FP32 master: those the model cast turns half
    (`cast_ids`) and those already half (passed in with Apex's `allow_incoming_model_not_fp32`)."""
    return cast_ids | {id(p) for g in optimizer.param_groups for p in g["params"] if p.dtype in LOW}


def check_one_master_each(optimizers: Sequence[torch.optim.Optimizer], ids: set[int]) -> None:
    """A param cast to half gets one FP32 master, stepped by one optimizer: a param in two
    optimizers would get two masters, and each step would overwrite the other's update."""
    owner: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in ids and owner.setdefault(id(p), i) != i:
                    raise ConfigError(
                        f"a parameter of shape {tuple(p.shape)} is in optimizers[{owner[id(p)]}] and "
                        f"optimizers[{i}]; with FP32 master weights (O2/O5) each half parameter must belong to "
                        "one optimizer (give it to one of them, or use O1).")


def _widened_in_chunks(masters: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """`grads` (half) as new tensors of their masters' dtype, a `COPY_NUMEL` chunk at a time, each
    chunk's half grads released as soon as it is copied: all the half grads and all their FP32
    copies never exist at once (O2's peak). Sparse grads (nn.Embedding(sparse=True)) go FP32
    and coalesced: the duplicates are summed without overflow. `grads` is emptied."""
    new: dict[int, torch.Tensor] = {}
    grads.reverse()  # popped in order: each half grad goes as soon as it is taken
    i, n = 0, len(masters)
    while i < n:
        out: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        where: list[int] = []
        total = 0
        while i < n and (total < COPY_NUMEL or not out):
            g = grads.pop()
            if g.is_sparse:
                new[i] = g.to(masters[i].dtype).coalesce()
            else:
                out.append(torch.empty_like(masters[i]))
                src.append(g)
                where.append(i)
                total += g.numel()
            i += 1
        if out:
            torch._foreach_copy_(out, src)
            for k, o in zip(where, out):
                new[k] = o
        del src
    return [new[k] for k in range(n)]


class Masters:
    """The FP32 masters of one optimizer, in its param_groups in place of their half params.

    `ids` names the params that get a master (made at once, from their current values);
    None means no masters at all (`enabled` is False: every param is its own master).
    The low-memory modes ("stochastic", "kahan") are `lowmem.LowMemMasters`, which steps the
    optimizer itself (`steps_itself`); these FP32 masters leave the step to the handle.
    """

    steps_itself = False

    def __init__(self, optimizer: torch.optim.Optimizer, ids: set[int] | None) -> None:
        self.optimizer = optimizer
        self.enabled = ids is not None
        self.model_of: dict[int, torch.Tensor] = {}   # id(master) -> half model param
        self.master_of: dict[int, torch.Tensor] = {}  # id(model param) -> master
        self.record_of: dict[int, Weight] = {}        # id(master) -> the record owning both copies
        self.lookup: Callable[[torch.Tensor], Weight | None] = _no_record  # a model param's record (`attach`)
        if ids is not None:
            for group in optimizer.param_groups:
                group["params"] = [self.make(p) if id(p) in ids else p for p in group["params"]]

    def step(self, call: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, states: Any = None) -> Any:
        """One optimizer step by the masters themselves, where `steps_itself` (the low-memory
        modes); these FP32 masters leave the step to the handle."""
        raise InternalError("ampatch: internal error: FP32 master weights do not step the optimizer "
                                  "themselves (steps_itself is False).")

    def make(self, p: torch.Tensor) -> torch.Tensor:
        """The FP32 master of `p`, made on first request (optimizer state made before
        `initialize` moves to it, in FP32): an FP32 `p` about to be cast gives its own storage
        (no copy); a half `p` brought in later (`add_param_group`, unfreezing) the exact value
        its record kept at `initialize`, else its values widened."""
        if id(p) in self.master_of:
            return self.master_of[id(p)]
        record = self.lookup(p)
        if record is not None and record.keeps is Keeps.VALUE and record.exact is not None:
            master = nn.Parameter(record.exact.to(p.device), requires_grad=p.requires_grad)
            record.promote(master)
            self.record_of[id(master)] = record
        else:
            master = nn.Parameter(keep_exact(p) if p.dtype == torch.float32 else p.detach().float(),
                                  requires_grad=p.requires_grad)
        self.model_of[id(master)] = p
        self.master_of[id(p)] = master
        state = self.optimizer.state
        if p in state:
            state[master] = cast_state(state.pop(p), torch.float32)
        return master

    def keeps(self, p: torch.Tensor) -> tuple[Keeps, torch.Tensor | None, torch.Tensor | None] | None:
        """What the model param `p` keeps besides its half copy, asked as the model is cast
        (`ModelHandle` records it): its FP32 master; None where `p` has none here."""
        m = self.master_of.get(id(p))
        return None if m is None else (Keeps.MASTER, m, None)

    def attach(self, lookup: Callable[[torch.Tensor], Weight | None]) -> None:
        """The records of the cast model (`lookup`: a model param's record): each master's
        record, through which every sync goes."""
        self.lookup = lookup
        for mp, m in self.pairs():
            record = lookup(mp)
            if record is not None:
                self.record_of[id(m)] = record

    def records(self, pairs: Iterable[Pair]) -> list[Weight]:
        """The records of `pairs`' masters."""
        record_of = self.record_of
        return [r for _, m in pairs if (r := record_of.get(id(m))) is not None]

    def settle(self) -> None:
        """A write to a half weight since the last sync reaches its master (`Weight.settle`),
        before the optimizer or a checkpoint reads it."""
        settle_all(self.record_of.values())

    def params(self) -> Iterator[torch.Tensor]:
        """What the optimizer steps: masters where they exist."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def pairs(self) -> Iterator[Pair]:
        """(model param, master) for every half param with a separate FP32 master."""
        model_of = self.model_of
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                mp = model_of.get(id(p))
                if mp is not None:
                    yield mp, p

    def split(self, params: Iterable[torch.Tensor] | None = None) -> tuple[list[Pair], list[torch.Tensor]]:
        """`params` (default: everything the optimizer steps, in param_groups order) split in
        two: (model param, master) for each master, and the params that are their own masters
        (FP32 ones, and every param without master weights). The one split of an optimizer's
        params; `ampatch.compat` takes Apex's `_amp_stash` groups from it too."""
        params = ([p for group in self.optimizer.param_groups for p in group["params"]] if params is None
                  else list(params))  # a list of our own: the caller's is never handed back
        model_of = self.model_of
        if not model_of:  # no masters (O0, O1, O3, O4): every param is its own
            return [], params
        pairs, own = [], []
        for p in params:
            mp = model_of.get(id(p))
            if mp is None:
                own.append(p)
            else:
                pairs.append((mp, p))
        return pairs, own

    def model_params(self) -> list[torch.Tensor]:
        """The model-side tensors the optimizer steps: the half param in place of each master."""
        return [self.model_of.get(id(p), p) for p in self.params()]

    def copy_to_model(self, pairs: list[Pair] | None = None) -> None:
        """Model params take their masters' values (rounded to half), with foreach ops; both
        copies are then as ampatch wrote them (`Weight.note`)."""
        if pairs is None:
            pairs = list(self.pairs())
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([mp for mp, _ in pairs], [m for _, m in pairs])
            note_all(self.record_of.values())

    def agree(self, process_group: Any) -> None:
        """Under torch.distributed: if on any rank a master no longer rounds to its model param
        (DDP broadcast rank 0's weights into the model after `initialize` made the masters
        from each rank's own weights), every rank takes its masters from the model."""
        pairs = list(self.pairs())
        if not pairs or not distributed(process_group):
            return
        with torch.no_grad():
            records = self.records(pairs)
            settle_all(records)
            stale = any(r.widened for r in records)  # DDP's broadcast wrote the half weights of this rank
            for r in records:
                r.widened = False
            flag = torch.full((), float(stale), dtype=torch.float32, device=pairs[0][1].device)
            if overflowed(flag, process_group):  # MAX: any rank
                torch._foreach_copy_([m for _, m in pairs], [mp for mp, _ in pairs])
                note_all(records)
                logger.info("ampatch: FP32 master weights taken from the model on every rank (the ranks' "
                            "weights differed when amp.initialize made them); seed every rank alike to keep "
                            "the FP32 initial weights.")

    def move_grads(self, pairs: list[Pair], inv_scale: float = 1.0, found_inf: torch.Tensor | None = None,
                   check: bool = False) -> torch.Tensor | None:
        """Model grads -> FP32 master grads, times `inv_scale` and added to what is there;
        model grads -> None. With `check`, inf/NaN are ORed into `found_inf` (returned)."""
        masters, grads, size = [], [], 0
        for mp, m in pairs:
            g = mp.grad
            if g is not None:
                mp.grad = None
                masters.append(m)
                grads.append(g)
                size += g.numel()
        if not masters:
            return found_inf
        if size <= COPY_NUMEL and not any(g.is_sparse for g in grads):  # the common case: one foreach call
            new = [torch.empty_like(m) for m in masters]
            torch._foreach_copy_(new, grads)
            del grads
            return scale_into(masters, new, inv_scale, found_inf, check)
        return scale_into(masters, _widened_in_chunks(masters, grads), inv_scale, found_inf, check)

    def checkpoint(self) -> dict[str, Any]:
        """What `optimizer.state_dict()` carries besides torch's own entries (the masters,
        aliased, after a write to a half weight reached them)."""
        self.settle()
        return {MASTERS_KEY: self.saved()}

    def state_entries(self, state: dict[int, dict]) -> None:
        """What the params' entries of `optimizer.state_dict()["state"]` carry besides torch's
        own (FP32 masters: nothing; see `lowmem.LowMemMasters.state_entries`)."""

    def take_comps(self, comps: dict[int, torch.Tensor], params: list[torch.Tensor]) -> None:
        """Kahan compensations a checkpoint carried (`lowmem.take_state_entries`): this session
        has no place for them."""
        if comps:
            logger.info("ampatch: the optimizer checkpoint was saved with master_weights='kahan'; this session keeps "
                        "%s, so its compensations are not loaded.", "FP32 masters" if self.enabled else "no masters")

    def loading(self) -> contextlib.AbstractContextManager:
        """The context torch's own `load_state_dict` runs in (nothing to arrange for FP32 masters)."""
        return contextlib.nullcontext()

    def take_saved(self, params: list[torch.Tensor], saved: list[torch.Tensor | None]) -> None:
        """The checked masters of a checkpoint (`MASTERS_KEY`) into `params` (what the optimizer
        steps, in order), then into the model."""
        with torch.no_grad():
            for p, value in zip(params, saved):
                if value is not None:
                    p.copy_(value)
        if self.enabled:
            self.copy_to_model()

    def load_lowmem(self, entry: dict[str, Any], params: list[torch.Tensor]) -> None:
        """A checkpoint of master_weights 'stochastic'/'kahan' loaded here: its compensations and
        rounding seed have no place in this session (the weights come with the model)."""
        logger.info("ampatch: the optimizer checkpoint was saved with master_weights=%r; this session keeps %s, so "
                    "its %s not loaded.", entry.get("mode"), "FP32 masters" if self.enabled else "no masters",
                    "compensation is" if entry.get("mode") == "kahan" else "rounding seed is")

    def footprint(self) -> tuple[int, int]:
        """(params, bytes) of what the optimizer steps: each model weight plus its master."""
        count = size = 0
        for p in self.params():
            mp = self.model_of.get(id(p), p)
            count += mp.numel()
            size += mp.numel() * mp.element_size() + (p.numel() * p.element_size() if mp is not p else 0)
        return count, size

    def saved(self) -> list[torch.Tensor | None]:
        """The checkpoint entry (`MASTERS_KEY`): per param in param_groups order, its master or None."""
        return [p.detach() if id(p) in self.model_of else None for p in self.params()]

    def unswap(self) -> Mapping[int, torch.Tensor]:
        """Put the model params back into param_groups (state re-keyed); returns masters by model param id."""
        if not self.model_of:
            return {}
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            new = []
            for p in group["params"]:
                mp = self.model_of.get(id(p))
                if mp is not None and p in state:
                    state[mp] = state.pop(p)
                new.append(mp if mp is not None else p)
            group["params"] = new
        return dict(self.master_of)

    def recast_state(self) -> None:
        """Floating optimizer state follows its param's dtype (after the model was cast or restored)."""
        state = self.optimizer.state
        for p in list(state):
            if isinstance(p, torch.Tensor):
                state[p] = cast_state(state[p], p.dtype)

