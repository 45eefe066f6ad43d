"""The weights as a second witness (``AMPATCH_WITNESS``): a fixed random projection of the
weights the optimizers step, recorded at a few update counts of a run, for `ampatch tune`,
`compare` and `diagnose` to compare with O0's (`ampatch.runs.weights`).

Every run of a command starts from the same weights and draws the same batches, so how far a
candidate's weights are from O0's, relative to how far O0's moved, tells whether it learns as
O0 does without the loss's batch noise. The projection is a count sketch of a fixed random
sample of the weights: `SAMPLED` coordinates (each tensor sampled in proportion to its size, at
least `PER_TENSOR`, small tensors whole, each value weighted so that inner products are
unbiased) hashed with random signs into `DIMS` numbers. It uses its own generator (the run's
random numbers are untouched), reads the weights the optimizers step (FP32 masters where they
exist) after whole updates only (a skipped step updates nothing), and costs a gather of the
sampled values: at 0 updates (the first loss, after any checkpoint was loaded), 1, 2, 4, 8, ...
updates, and the last. It also notes the loss's dtype and the share of the sampled weights that
moved from where they started.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..base.exit_json import ExitJson
from ..errors import ConfigError

logger = logging.getLogger("ampatch")

__all__ = ["DIMS", "SAMPLED", "PER_TENSOR", "SEED", "WitnessPoint", "Witness", "WeightWitness", "latest"]

DIMS = 64          # numbers per recorded point (the sketch's buckets)
SAMPLED = 8192     # weights sampled from the whole model (about; small tensors are taken whole)
PER_TENSOR = 16    # at least this many from each tensor
SEED = 0x5EED      # the projection's own generator: the same projection in every run


@dataclass(frozen=True)
class WitnessPoint:
    """The projection after `updates` applied optimizer steps, and the share of the sampled
    weights (weighted as the projection weighs them) that differ from their start."""

    updates: int
    sketch: tuple[float, ...]
    moved: float


@dataclass(frozen=True)
class Witness:
    """What a run's weights witness: the projection at each recorded point, the loss's dtype."""

    dims: int
    sampled: int
    params: int
    loss_dtype: str
    points: tuple[WitnessPoint, ...]

    def at(self, updates: int) -> WitnessPoint | None:
        return next((p for p in self.points if p.updates == updates), None)

    def to_dict(self) -> dict[str, Any]:
        return {"dims": self.dims, "sampled": self.sampled, "params": self.params, "loss_dtype": self.loss_dtype,
                "points": [{"updates": p.updates, "sketch": list(p.sketch), "moved": p.moved} for p in self.points]}

    @classmethod
    def from_dict(cls, data: Any) -> Witness:
        """The witness `to_dict` wrote; ValueError for a document that is not one."""
        try:
            points = tuple(WitnessPoint(int(p["updates"]), tuple(float(x) for x in p["sketch"]), float(p["moved"]))
                           for p in data["points"])
            return cls(int(data["dims"]), int(data["sampled"]), int(data["params"]), str(data["loss_dtype"]), points)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a weights witness: {exc!r}") from None


class _Plan:
    """Which values of each tensor are sampled, their weights, buckets and signs (fixed by `SEED`)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(SEED)
        total = sum(t.numel() for t in tensors)
        self.total = total
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for t in tensors:
            n = t.numel()
            m = min(n, max(PER_TENSOR, round(SAMPLED * n / max(total, 1))))
            index = torch.arange(n) if m == n else torch.randint(0, n, (m,), generator=gen)
            bucket = torch.randint(0, DIMS, (m,), generator=gen)
            sign = torch.randint(0, 2, (m,), generator=gen, dtype=torch.float64) * 2 - 1
            self.parts.append((index, bucket, sign * (n / m) ** 0.5))
        self.sampled = sum(len(p[0]) for p in self.parts)

    def values(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.detach().reshape(-1)[index].double() for t, (index, _, _) in zip(tensors, self.parts)]

    def sketch(self, values: list[torch.Tensor]) -> list[float]:
        out = torch.zeros(DIMS, dtype=torch.float64)
        for v, (_, bucket, weight) in zip(values, self.parts):
            out.index_add_(0, bucket, v * weight)
        return out.tolist()

    def moved(self, values: list[torch.Tensor], start: list[torch.Tensor]) -> float:
        changed = sum(float(((v != s).double() * w * w).sum()) for v, s, (_, _, w) in zip(values, start, self.parts))
        whole = sum(float((w * w).sum()) for _, _, w in self.parts)
        return changed / whole if whole else 0.0


class WeightWitness:
    """The session observer that records the witness and writes it at exit (see the module docstring)."""

    def __init__(self, session: Any, path: str) -> None:
        self.session = session
        self.updates = 0
        self.loss_dtype = ""
        self.points: list[WitnessPoint] = []
        self.plan: _Plan | None = None
        self.start: list[torch.Tensor] = []
        self.failed = False
        self.path = path
        # a session without optimizers (evaluation after training) does not take over an earlier one's witness
        # until it steps (as `observers.ReportAtExit` does with the report)
        self.tracking = bool(getattr(session, "optimizers", True)) or not _output.holds_source()
        if self.tracking:
            _output.track(self, path)

    def _tensors(self) -> list[torch.Tensor]:
        return [p for h in self.session.optimizers for g in h.optimizer.param_groups for p in g["params"]
                if isinstance(p, torch.Tensor) and p.is_floating_point()]

    def _record(self) -> None:
        if self.failed or (self.points and self.points[-1].updates == self.updates):
            return
        try:
            tensors = self._tensors()
            with torch.no_grad():
                if self.plan is None:
                    self.plan = _Plan(tensors)
                values = self.plan.values(tensors)
                if not self.start:
                    self.start = values
                self.points.append(WitnessPoint(self.updates, tuple(self.plan.sketch(values)),
                                                self.plan.moved(values, self.start)))
        except Exception as exc:  # a witness never fails a run (sharded or unusual tensors): it says nothing
            logger.info("ampatch: no weights witness for this run: %r", exc)
            self.failed = True

    def on_loss(self, loss: torch.Tensor, scale: float) -> None:
        if not self.loss_dtype:
            self.loss_dtype = str(loss.dtype).replace("torch.", "")
        if not self.points:
            self._record()  # the start: after any checkpoint the script loaded, before the first update

    def on_step(self, skipped: bool) -> None:
        if not self.tracking:
            self.tracking = True
            _output.track(self, self.path)
        if skipped:
            return
        self.updates += 1
        if self.updates & (self.updates - 1) == 0:  # 1, 2, 4, 8, ...
            self._record()

    def close(self) -> None:
        self._record()
        _output.release(self)

    def document(self) -> dict[str, Any] | None:
        """The JSON written at exit (the last point recorded first); None when it recorded nothing."""
        if self.points:
            self._record()
        if self.failed or self.plan is None or not self.points:
            return None
        return Witness(DIMS, self.plan.sampled, self.plan.total, self.loss_dtype, tuple(self.points)).to_dict()


_output = ExitJson(lambda witness: witness.document(), "weights witness")


def latest() -> Witness | None:
    """The newest session's witness in this process, as it would be written at exit (None:
    none recorded); for runs made in-process (``scripts/tune_grid.py``)."""
    data = _output.produce(_output.source) if _output.source is not None else _output.final
    return Witness.from_dict(data) if data else None
