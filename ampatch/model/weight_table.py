"""A cast model's records (`weights.Weight`) as one table (`Weights`): found by (module, name),
settled together before each forward, copied with the model (deepcopy, pickle), and the
`.data` watch (`DataWatch`) that notes writes no version counter shows.
"""
from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

import torch
from torch import nn

from ..base.patcher import watch_data
from .weights import Keeps, Sync, Weight, rounds_to

__all__ = ["Weights", "DataWatch"]


class Weights:
    """One model's records (`Weight`), by (module, name) and by tensor; `settle` is the sync
    point the model's forward, the optimizer's step and `state_dict` call.

    `live`: the table of a model in a session (a record that no longer holds a half tensor
    is an error to run); a table made by deep copy or pickle is standalone (such a record
    lets its tensor go)."""

    def __init__(self, live: bool = True) -> None:
        self.records: list[Weight] = []
        self.by_name: dict[tuple[int, str], Weight] = {}
        self.ties: list[tuple[nn.Module, str, Weight]] = []  # a tied param's other names
        self.live = live
        self.watch: DataWatch | None = None
        self.unwatched = False  # a copy's records are watched from its first settle (its model is whole then)
        self._lock = threading.Lock()  # nn.DataParallel replicas settle from their threads

    def add(self, record: Weight, note: bool = True) -> Weight:
        self.records.append(record)
        self.by_name[(id(record.module), record.name)] = record
        if note:
            record.note()
            if self.watch is not None:
                self.watch.register(record)
        return record

    def tie(self, module: nn.Module, name: str, record: Weight) -> None:
        """`module.name` is the tensor of `record` (a tied or shared param) under another name."""
        self.ties.append((module, name, record))
        self.by_name[(id(module), name)] = record

    def get(self, module: nn.Module, name: str) -> Weight | None:
        return self.by_name.get((id(module), name))

    def take(self, module: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
        """`load_state_dict` loaded these tensors into `module`'s cast tensors: their records take
        them (`Weight.take`)."""
        for name, src in loaded.items():
            record = self.get(module, name)
            if record is not None:
                record.take(src)

    def by_tensor(self) -> dict[int, Weight]:
        """id(half tensor) -> record, for the tensors held now."""
        out = {}
        for r in self.records:
            t = r.half()
            if t is not None:
                out[id(t)] = r
        return out

    def settle(self) -> None:
        """Every record re-synced where someone wrote since (`Weight.settle`); the live model
        refuses to run with a tensor that is no longer half, naming the fix."""
        with self._lock:
            if self.watch is not None and self.unwatched:
                self.unwatched = False
                self.watch.watch(self)
            for r in list(self.records):
                if r.touched():
                    self._settle(r)

    def settle_one(self, record: Weight) -> Weight | None:
        """`settle` for one record (a `state_dict` hook's sync point): the record, or None where
        it went (a copy's tensor left the half dtype, `ema.to(torch.float32)` as timm's
        `ModelEmaV3(dtype=...)` does: the tensor took the exact value and is the truth from now
        on, so an EMA written through `state_dict()` reaches the weights its forward uses)."""
        with self._lock:
            return self._settle(record)

    def _settle(self, r: Weight) -> Weight | None:
        """`r` re-synced (the lock held); a retired one handled: None where it went."""
        if r.settle() is not Sync.RETIRED:
            return r
        self._retired(r)
        return self.get(r.module, r.name)

    def _retired(self, r: Weight) -> None:
        """A live model's record whose tensor went or left the half dtype: nothing to sync (the
        forward then fails on the dtypes, and `changes` says why); a copy's lets it go."""
        if not self.live:
            self._let_go(r, r.half())

    def changes(self, model: nn.Module) -> list[str]:
        """What was done to `model` since `initialize` that breaks its half forward: tensors no
        longer half (model.float(), .to(dtype)), modules replaced (for a note on the error)."""
        inside = {id(m) for m in model.modules()}
        out = []
        for r in self.records:
            t = r.half()
            if id(r.module) not in inside:
                out.append(f"{r.label.rpartition('.')[0] or r.label!r} was replaced")
            elif t is not None and t.dtype != r.half_dtype:
                out.append(f"{r.label!r} is {str(t.dtype).removeprefix('torch.')}")
        return list(dict.fromkeys(out))

    def _let_go(self, r: Weight, t: torch.Tensor | None) -> None:
        """A copy's tensor left the half dtype (`ema.float()`): back in its original dtype it
        takes the exact value where the copy keeps one; the record goes."""
        if t is not None and r.exact is not None and t.dtype == r.dtype and rounds_to(r.exact, t.to(r.half_dtype)):
            with torch.no_grad():
                t.copy_(r.exact.to(t.device))
        self.records.remove(r)
        self.by_name.pop((id(r.module), r.name), None)

    def note(self) -> None:
        for r in self.records:
            r.note()

    def retired(self) -> bool:
        """A standalone table whose records all went (the copy is an FP32 model again)."""
        return not self.live and not self.records

    def standalone(self, memo: dict) -> "Weights":
        """This table in a deep copy of its model (see the module docstring)."""
        twin = Weights(live=False)
        memo[id(self)] = twin
        for r in self.records:
            copied = r.copied(memo)
            memo[id(r)] = copied
            twin.add(copied, note=False)  # the copy's modules may not be whole yet
        for module, name, r in self.ties:
            twin.tie(copy.deepcopy(module, memo), name, memo[id(r)])
        watch = self.watch
        if watch is not None and watch.active:
            watch.adopt(twin)
        return twin

    def __deepcopy__(self, memo: dict) -> "Weights":
        return self.standalone(memo)

    def __reduce__(self) -> tuple:
        kept = (Keeps.MASTER, Keeps.VALUE)
        entries = [(r.module, r.name, r.is_param, r.dtype, r.half_dtype, r.label,
                    r.exact.detach().clone() if r.exact is not None and r.keeps in kept else None)
                   for r in self.records]
        ties = [(module, name, self.records.index(r)) for module, name, r in self.ties]
        return (_unpickled, (entries, ties))


def _unpickled(entries: list, ties: list) -> Weights:
    """A pickled cast model's table, rebuilt standalone."""
    table = Weights(live=False)
    for module, name, is_param, dtype, half_dtype, label, exact in entries:
        table.add(Weight(module, name, is_param, dtype, half_dtype, Keeps.HALF_ONLY if exact is None else Keeps.VALUE,
                         exact, label), note=False)  # the modules are rebuilt after this table
    for module, name, i in ties:
        table.tie(module, name, table.records[i])
    return table


class DataWatch:
    """Writes through `.data` move no version counter (`p.data.clamp_(-c, c)`, the classic
    WGAN clip): while a session holds cast models, `torch.Tensor.data` notes which records'
    tensors it handed out, and their values are compared at the next settle. Installed
    through the session's `Patcher`, so `deinitialize` puts torch's own getter back."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[Weight, bool]] = {}
        self.tables: list[Any] = []  # weak references to standalone tables made while active
        self.active = False

    def install(self, patcher: Any) -> None:
        by_id = self.by_id

        def touched(tensor: torch.Tensor) -> None:
            hit = by_id.get(id(tensor))
            if hit is not None:
                hit[0].mark(hit[1])

        watch_data(patcher, touched)
        patcher.on_restore(self._stop)
        self.active = True

    def register(self, record: Weight) -> None:
        t = record.half()
        if t is not None:
            self.by_id[id(t)] = (record, False)
        if record.exact is not None:
            self.by_id[id(record.exact)] = (record, True)

    def watch(self, table: Weights) -> None:
        table.watch = self
        for r in table.records:
            self.register(r)

    def adopt(self, table: Weights) -> None:
        """A copy made while the session lives: its tensors are watched too, from its first
        settle (the copy's modules are whole then)."""
        self.tables.append(weakref.ref(table))
        table.watch = self
        table.unwatched = True

    def _stop(self) -> None:
        self.active = False
        self.by_id.clear()
        for ref in self.tables:
            table = ref()
            if table is not None:
                table.watch = None
        self.tables.clear()


