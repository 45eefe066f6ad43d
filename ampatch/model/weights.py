"""One truth for the weights of a cast model (O2/O3/O5): one record per tensor the cast turned
half (`Weight`), owning both copies of it, the half tensor the forward uses and, where one is
kept, its exact value (the FP32 master an optimizer steps, the FP32 value of a frozen
parameter or buffer, or a kahan compensation). A model's records are a `weight_table.Weights`.

Whatever the user writes last wins, exactly. Every write ampatch makes is followed by `note`
(the tensors' version counters, read then); a write by anyone else moves a counter (or, for
`.data`, is noted by `DataWatch`), and the next sync point (the model's forward, the
optimizer's step, `state_dict`, `deinitialize`) re-syncs the other copy from the one written,
widening or rounding as a fresh `initialize` would. A record's state (`Sync`):

    IN_SYNC      both copies as ampatch left them: the half tensor is the exact value rounded
    HALF_AHEAD   the half tensor was written since  --settle-->  exact = half, widened, wherever
                 the write changed the half value (an element it left keeps its exact value);
                 a kahan compensation is zeroed (where the weight changed, when that is known)
    EXACT_AHEAD  the exact value was written since  --settle-->  half = exact, rounded
    BOTH_AHEAD   both were written                 --settle-->  as EXACT_AHEAD (the FP32 write)
    RETIRED      the tensor is gone or no longer half (model.float(), a replaced buffer of
                 another dtype): the live model refuses to run; a copy lets it go

A deep copy or pickle of a cast model is an ordinary half model with records of its own
(`Weight.copied`): FP32 masters become FP32 values of the copy, so an EMA made by
`copy.deepcopy` accumulates in the dtype the model's `state_dict()` hands it; nothing it does
reaches the original's masters.
"""
from __future__ import annotations

import copy
import enum
from collections.abc import Iterable

import torch
from torch import nn

from ..base.patcher import raw_data, set_data

__all__ = ["Keeps", "Sync", "Weight", "keep_exact", "rounds_to", "settle_all", "note_all"]

F32 = torch.float32


class Keeps(enum.Enum):
    """What a record keeps besides the half tensor."""

    HALF_ONLY = "half only"      # O3 params, "stochastic": the half tensor is the value
    MASTER = "FP32 master"       # a trained weight: an optimizer steps `exact`
    VALUE = "FP32 value"         # a frozen param, a buffer, a copy's weight: `exact` kept beside
    COMPENSATED = "kahan"        # the bfloat16 weight plus what rounding dropped (`comp`)


class Sync(enum.Enum):
    """Where a record's two copies stand (see the module docstring for the transitions)."""

    IN_SYNC = "in sync"
    HALF_AHEAD = "half written"
    EXACT_AHEAD = "exact written"
    BOTH_AHEAD = "both written"
    RETIRED = "retired"


def keep_exact(t: torch.Tensor, offload: bool = False) -> torch.Tensor:
    """`t`'s exact values, kept past the cast without a copy (its storage, under a version
    counter of its own, so a write to the half tensor is not taken for a write to this);
    with `offload`, a CUDA tensor's values wait on the CPU (frozen params: the half model's
    device memory is what O2 promises)."""
    data = raw_data(t)
    return data.to("cpu", copy=True) if offload and data.device.type == "cuda" else data


class Weight:
    """The record of one cast tensor (`module`'s param or buffer `name`): its half copy (looked
    up by name each time: torch replaces buffer objects), its original dtype, what it keeps
    beside (`keeps`, `exact`, `comp`), and the versions ampatch last saw. Every sync path is a
    method here."""

    __slots__ = ("module", "name", "is_param", "dtype", "half_dtype", "keeps", "exact", "comp", "label", "widened",
                 "_store", "_seen_half", "_seen_exact", "_half_id", "_marked_half", "_marked_exact", "_before")

    def __init__(self, module: nn.Module, name: str, is_param: bool, dtype: torch.dtype, half_dtype: torch.dtype,
                 keeps: Keeps, exact: torch.Tensor | None = None, label: str = "") -> None:
        self.module, self.name, self.is_param = module, name, is_param
        self.dtype, self.half_dtype = dtype, half_dtype
        self.keeps, self.exact = keeps, exact
        self.comp: torch.Tensor | None = None  # a kahan weight's compensation
        self.label = label or name
        self.widened = False  # settle widened the half tensor into the exact copy (masters.agree asks, under DDP)
        self._store: dict | None = None  # the module's _parameters or _buffers, found at first use
        self._seen_half = self._seen_exact = -1
        self._half_id = 0  # 0: not seen yet (a copy's record, made before its module is whole)
        self._marked_half = self._marked_exact = False
        self._before: torch.Tensor | None = None  # a kahan weight as it was when its `.data` was taken

    # ------------------------------------------------------------------ reading
    def half(self) -> torch.Tensor | None:
        """The tensor the module holds under `name` now."""
        store = self._store
        if store is None:
            store = self._store = self.module._parameters if self.is_param else self.module._buffers
        return store.get(self.name)

    def touched(self) -> bool:
        """Whether a copy may have been written since `note` (a few attribute reads: the step's
        fast path; `observe` says which)."""
        t = self.half()
        if t is None or id(t) != self._half_id or t._version != self._seen_half or t.dtype != self.half_dtype:
            return True
        exact = self.exact
        return self._marked_half or self._marked_exact or (exact is not None and exact._version != self._seen_exact)

    def observe(self) -> Sync:
        """Which copy was written since `note` (nothing changes)."""
        t = self.half()
        if t is None or t.dtype != self.half_dtype or hasattr(t, "to_local") != hasattr(self.exact, "to_local"):
            return Sync.RETIRED  # gone, no longer half, or sharded since (fully_shard after initialize)
        if not self._half_id:  # first sight (a copy's record): as its model was made
            self.note()
            return Sync.IN_SYNC
        exact = self.exact
        written = exact is not None and (exact._version != self._seen_exact or self._marked_exact)
        if id(t) != self._half_id:  # another tensor object: a buffer moved (model.to) or assigned anew
            half = exact is None or (t.device == exact.device and not rounds_to(exact, t))
        elif t._version != self._seen_half:
            half = True
        elif self._marked_half:  # `.data` was taken: a write there moves no counter
            before = self._before
            half = (not rounds_to(exact, t) if exact is not None
                    else before is not None and before.device == t.device and not torch.equal(before, t))
        else:
            half = False
        if half:
            return Sync.BOTH_AHEAD if written else Sync.HALF_AHEAD
        return Sync.EXACT_AHEAD if written else Sync.IN_SYNC

    def value(self) -> torch.Tensor | None:
        """What `state_dict()` holds for this tensor (None: the half tensor itself): the exact
        copy, aliased, on the half tensor's device (an offloaded one is copied there)."""
        exact, t = self.exact, self.half()
        if exact is None or t is None or self.keeps is Keeps.COMPENSATED:
            return None
        return exact.detach() if exact.device == t.device else exact.to(t.device)

    # ------------------------------------------------------------------ syncing
    def settle(self) -> Sync:
        """Re-sync the copy that was not written from the one that was; returns what was found."""
        state = self.observe()
        if state is Sync.IN_SYNC or state is Sync.RETIRED:
            self._marked_half = self._marked_exact = False
            self._before = None
            return state
        t = self.half()
        if t is None:  # observe() said otherwise: not reached
            return Sync.RETIRED
        with torch.no_grad():
            if state is Sync.HALF_AHEAD:
                if self.keeps is Keeps.COMPENSATED and self.comp is not None:
                    self._drop_compensation(t, self.comp)
                elif self.exact is not None:
                    self._follow_device(t)
                    self.widened = _widen_changed(t, self.exact) or self.widened
            elif self.exact is not None:  # written: there is an exact copy
                t.copy_(self.exact)
        self.note()
        return state

    def _drop_compensation(self, t: torch.Tensor, comp: torch.Tensor) -> None:
        """The kahan weight was written: its compensation goes where the weight changed (known
        against the snapshot `.data` took), everywhere when a write moved its version counter."""
        before = self._before
        if before is not None and before.shape == t.shape:
            comp.masked_fill_(before != t, 0)
        else:
            comp.zero_()
        self.widened = True

    def note(self) -> None:
        """Both copies are as ampatch (or a settle) left them."""
        t = self.half()
        if t is not None:
            self._seen_half, self._half_id = t._version, id(t)
        if self.exact is not None:
            self._seen_exact = self.exact._version
        self._marked_half = self._marked_exact = False
        self._before = None

    def mark(self, exact_side: bool) -> None:
        """`.data` of one copy was taken (`DataWatch`): compare values at the next settle (a kahan
        weight, which has no exact copy to compare with, against a snapshot taken now)."""
        if exact_side:
            self._marked_exact = True
            return
        if self.keeps is Keeps.COMPENSATED and self._before is None:
            t = self.half()
            if t is not None:
                self._before = raw_data(t).clone()
        self._marked_half = True

    def take(self, src: torch.Tensor) -> None:
        """`load_state_dict` loaded `src` into the half tensor (rounded): the exact copy takes
        `src` itself, exactly; a kahan compensation what an FP32 `src` has beyond bfloat16
        (a bfloat16 `src` carries none: the compensation is optimizer state, loaded with it)."""
        t = self.half()
        with torch.no_grad():
            if self.keeps is Keeps.COMPENSATED:
                if self.comp is not None and t is not None and src.dtype != t.dtype:
                    self.comp.copy_(src.to(t.device, F32) - t.float())
            elif self.exact is not None:
                if t is not None:
                    self._follow_device(t)
                self.exact.copy_(src)
        self.note()

    def promote(self, master: torch.Tensor) -> None:
        """The weight is trained from now on (`add_param_group`): `master` is its exact copy."""
        self.keeps, self.exact = Keeps.MASTER, master
        self.note()

    def _follow_device(self, t: torch.Tensor) -> None:
        """A copy's exact value moves with its half tensor (`ema.to("cpu")`); a master, an
        offloaded value, or a value on the CPU beside a CUDA weight stays where it is."""
        exact = self.exact
        if exact is not None and exact.device != t.device and self.keeps is Keeps.VALUE and not (
                exact.device.type == "cpu" and t.device.type == "cuda"):
            self.exact = exact.to(t.device)

    # ------------------------------------------------------------------ undoing
    def restored(self) -> torch.Tensor | None:
        """The tensor in its original dtype, from the exact copy where one is kept (kahan:
        weight + compensation), on the half tensor's device; None where the tensor is gone."""
        self.settle()
        t = self.half()
        if t is None or t.dtype != self.half_dtype:
            return None
        with torch.no_grad():
            if self.keeps is Keeps.COMPENSATED and self.comp is not None:
                return t.detach().to(self.dtype).add_(self.comp.to(t.device))
            if self.exact is not None:
                return self.exact.detach().to(t.device, self.dtype)
            return t.detach().to(self.dtype)

    def restore(self) -> None:
        """Put the original dtype back (`restored`) into the module."""
        value = self.restored()
        if value is None:
            return
        if not self.is_param:
            self.module._buffers[self.name] = value
            return
        t = self.half()
        if t is not None:
            set_data(t, value)
            t.grad = None

    def copied(self, memo: dict) -> "Weight":
        """This record in a deep copy of its model: an FP32 value of the copy's own where this
        one keeps an FP32 copy (a master included), the half tensor alone otherwise."""
        module = copy.deepcopy(self.module, memo)
        own = self.exact if self.keeps in (Keeps.MASTER, Keeps.VALUE) else None
        exact = None
        if own is not None:
            exact = memo.get(id(own))
            if exact is None:
                exact = memo[id(own)] = own.detach().clone()
        return Weight(module, self.name, self.is_param, self.dtype, self.half_dtype,
                      Keeps.VALUE if own is not None else Keeps.HALF_ONLY, exact, self.label)


def _widen_changed(half: torch.Tensor, exact: torch.Tensor) -> bool:
    """Where `half` no longer holds `exact` rounded, `exact` takes `half`'s value widened: a write
    to the half tensor wins element by element, and an element it left as it was keeps its
    exact value (a WGAN clip leaves the unclipped masters exact; a write that changed no bit,
    DDP's broadcast between ranks that start alike, changes nothing). Returns whether any did."""
    rounded = exact.to(half.device, half.dtype)
    changed = rounded != half
    if not bool(changed.any()):
        return False
    widened = half.to(exact.dtype)
    exact.copy_(torch.where(changed.to(exact.device), widened.to(exact.device), exact))
    return True


def rounds_to(exact: torch.Tensor, half: torch.Tensor) -> bool:
    """`half` holds `exact` rounded (a tensor on the meta device holds whatever it is said to)."""
    if exact.shape != half.shape:
        return False
    if "meta" in (exact.device.type, half.device.type):
        return True
    return torch.equal(exact.to(half.device, half.dtype), half)


def settle_all(records: Iterable[Weight]) -> None:
    """`Weight.settle` over `records` where something may have been written (the optimizer's
    step: a user's write to a half weight reaches its master before the optimizer reads it)."""
    for r in records:
        if r.touched():
            r.settle()


def note_all(records: Iterable[Weight]) -> None:
    """`Weight.note` over `records` (after ampatch wrote both copies: the step)."""
    for r in records:
        r.note()

