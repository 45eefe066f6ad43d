"""Stalled updates: how much of each weight an optimizer step left unchanged.

A weight kept only in a half dtype (O3: no FP32 master) is stepped in that dtype: an update
smaller than half the spacing of representable numbers around the weight rounds away. In
bfloat16 a weight of 0.1 moves in steps of about 0.0005, so AdamW at lr 2e-5 (an update of
about 2e-5 per step) leaves it where it was, step after step: the run trains nothing while
its loss, computed from the same weights, looks like O0's start.

`StallCounter` compares, per parameter tensor, the tensor that holds the weight (the FP32
master where there is one, else the parameter) before and after each optimizer step: at the
first loss of a step (before backward, so before the step) it copies them; when the step
ends it counts, per tensor, the elements with a non-zero gradient whose value did not change,
and drops the copies. Numbers only, for the recorded steps only. A sharded parameter (FSDP2's
DTensor) is counted on this rank's shard.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..base.dtypes import short_name
from .records import ParamRecord
from .shadow import Masters

__all__ = ["StallCounter"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (FSDP2's DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class StallCounter:
    """Per parameter tensor of `modules` ((name, module) pairs, each parameter under the first
    module that owns it) and per optimizer step: the share of its elements the step left
    unchanged (`ParamRecord.unchanged`). `masters(param)` gives a half parameter's FP32 master."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], masters: Masters | None = None) -> None:
        self.masters = masters
        self._params: list[tuple[nn.Parameter, ParamRecord]] = []
        seen: set[int] = set()
        for module_name, m in modules:
            for local, p in m.named_parameters(recurse=False):
                if p.requires_grad and p.is_floating_point() and id(p) not in seen:
                    seen.add(id(p))
                    name = f"{module_name}.{local}" if module_name else local
                    held = self._held(p)
                    self._params.append((p, ParamRecord(name, module_name, short_name(held.dtype) or str(held.dtype),
                                                        p.numel())))
        self._before: list[torch.Tensor] | None = None

    def _held(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor that holds `p`'s weight: its FP32 master, else itself."""
        master = self.masters(p) if self.masters is not None else None
        return master if master is not None and master.shape == p.shape else p

    @property
    def records(self) -> list[ParamRecord]:
        return [r for _, r in self._params]

    def before_step(self) -> None:
        """The weights as they are before this step's update (once per step: under gradient
        accumulation, at the first of its losses)."""
        if self._before is None:
            with torch.no_grad():
                self._before = [_local(self._held(p).detach()).clone() for p, _ in self._params]

    def after_step(self, skipped: bool) -> None:
        """The step ended: record each tensor's unchanged share (None when skipped or not seen)."""
        before, self._before = self._before, None
        with torch.no_grad():
            for i, (p, record) in enumerate(self._params):
                record.unchanged.append(None if skipped or before is None else self._unchanged(p, before[i]))

    def _unchanged(self, p: torch.Tensor, before: torch.Tensor) -> float | None:
        source = self._held(p)
        held = _local(source.detach())
        if held.is_sparse or held.shape != before.shape:
            return None
        same = held == before
        grad = source.grad if source.grad is not None else p.grad
        if grad is None and source is not p:  # a master whose gradient the step released: every element
            return float(same.sum()) / same.numel() if same.numel() else None
        grad = _local(grad) if grad is not None else None
        if grad is None or grad.is_sparse or grad.shape != held.shape:
            return None           # not used this step (or a sparse gradient): no update to lose
        moved = grad != 0         # an element without a gradient has no update to lose
        count = int(moved.sum())
        return float((same & moved).sum()) / count if count else None
