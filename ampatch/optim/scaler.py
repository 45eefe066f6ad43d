"""Loss scalers and the fused unscale + inf/NaN check.

A `LossScaler` is one scale (per `loss_id`): static, or dynamic (start 2**16, halve on
overflow down to `min_loss_scale`, double after `growth_interval` clean steps up to
`max_loss_scale`; Apex's FP16_Optimizer changes the start, the interval and the factor).
State, in Apex's checkpoint format: `loss_scale` and `unskipped`.

Every scale stays in a usable range: `1/scale` and `loss * scale` are finite FP32 numbers
for any sane loss. A dynamic scale has a floor even when `min_loss_scale` is None
(`DEFAULT_MIN_LOSS_SCALE`): a loss that is NaN on every step halves the scale down to it
and stops there (Apex halved on into denormals, then failed).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config.values import DEFAULT_MAX_LOSS_SCALE, DEFAULT_MIN_LOSS_SCALE, INITIAL_LOSS_SCALE
from ..errors import BadLossId, ConfigError, ConfigTypeError, StateDictKeyError

logger = logging.getLogger("ampatch")

_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_

HISTORY_POINTS = 1000  # a scale history longer than this is thinned (a long run stays bounded)


def downsample(history: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Every other change point of a long history, keeping the first and the last."""
    return history[:-1:2] + [history[-1]]


def check_loss_id(loss_id: object, count: int, what: str = "scale_loss") -> None:
    """`loss_id` names one of `count` loss scalers (`initialize(num_losses=count)`): the one
    check of `scale_loss` and `amp.loss_scale`."""
    if not isinstance(loss_id, int) or isinstance(loss_id, bool):
        raise BadLossId(f"{what}: loss_id must be an int from 0 to num_losses-1 ({count - 1} here), got "
                        f"{loss_id!r}.")
    if not 0 <= loss_id < count:
        raise ConfigError(f"{what}: loss_id={loss_id} is out of range: initialize(num_losses={count}) gives loss ids "
                          f"0..{count - 1}.")


class LossScaler:
    """One loss scale and its update rule."""

    def __init__(self, loss_scale: float | str, min_loss_scale: float | None = None,
                 max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE, growth_interval: int = 2000,
                 init_scale: float = INITIAL_LOSS_SCALE, growth_factor: float = 2.0) -> None:
        if isinstance(growth_factor, bool) or not isinstance(growth_factor, (int, float)) or not growth_factor > 1:
            raise ConfigError(f"growth_factor must be a number above 1 (the scale is divided by it on overflow and "
                              f"multiplied by it after growth_interval clean steps), got {growth_factor!r}.")
        self.dynamic = loss_scale == "dynamic"
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.floor = DEFAULT_MIN_LOSS_SCALE if min_loss_scale is None else min_loss_scale
        self.growth_interval = growth_interval
        self.growth_factor = float(growth_factor)
        self.scale = self.clamp(init_scale) if self.dynamic else float(loss_scale)
        self.unskipped = 0
        self.last_overflow = False  # the outcome of the latest update (Apex's `_has_overflow`)
        self.history: list[tuple[int, float]] = [(0, self.scale)]  # (iteration, scale) change points

    @property
    def growth_interval(self) -> int:
        """Clean steps before a dynamic scale grows (Apex: `scale_window`, `_scale_seq_len`)."""
        return self._growth_interval

    @growth_interval.setter
    def growth_interval(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"the growth interval (growth_interval; Apex's scale_window, _scale_seq_len) is the "
                              f"number of clean steps before a dynamic scale grows: a positive int, got {value!r}.")
        self._growth_interval = value

    def clamp(self, scale: float) -> float:
        """`scale` within this dynamic scaler's [floor, max_loss_scale] (the ceiling wins)."""
        return min(max(scale, self.floor), self.max_loss_scale)

    @property
    def is_identity(self) -> bool:
        """A static scale of 1.0: scaling and unscaling are no-ops."""
        return not self.dynamic and self.scale == 1.0

    def update(self, overflow: bool, iteration: int) -> None:
        """Apply one unscale's outcome (Apex's rule); static scales never change."""
        self.last_overflow = overflow
        if overflow:
            self.unskipped = 0
            if self.dynamic:
                self._set(min(self.clamp(self.scale / self.growth_factor), self.scale), iteration)  # never up
            return
        self.unskipped += 1
        if self.dynamic and self.unskipped >= self.growth_interval:
            self.unskipped = 0
            self._set(min(self.scale * self.growth_factor, self.max_loss_scale), iteration)

    def _set(self, scale: float, iteration: int) -> None:
        if scale != self.scale:
            self.scale = scale
            self.history.append((iteration, scale))
            if len(self.history) > HISTORY_POINTS:
                self.history = downsample(self.history)

    def state_dict(self) -> dict[str, float | int]:
        return {"loss_scale": float(self.scale), "unskipped": int(self.unskipped)}

    @staticmethod
    def check_state(state: object) -> tuple[float, int]:
        """Validate one saved scaler state; returns (loss_scale, unskipped). Raises before
        anything is loaded, so a bad checkpoint leaves every scaler as it was."""
        if not isinstance(state, dict):
            raise ConfigTypeError(f"a loss scaler state is a dict with 'loss_scale' and 'unskipped', got "
                                  f"{type(state).__name__}.")
        keys = {"loss_scale", "unskipped"}
        if set(state) != keys:
            unknown, missing = sorted(set(state) - keys), sorted(keys - set(state))
            raise StateDictKeyError(f"loss scaler state: unknown keys {unknown}, missing keys {missing}; expected "
                           "exactly 'loss_scale' and 'unskipped' (the format of amp.state_dict()).")
        scale, unskipped = float(state["loss_scale"]), int(state["unskipped"])
        if not (0.0 < scale < float("inf")) or unskipped < 0:
            raise ConfigError(f"loss scaler state {state!r}: loss_scale must be a finite positive number and "
                              "unskipped a non-negative int.")
        return scale, unskipped

    def load_state_dict(self, state: dict) -> float | None:
        """Load a checked state. A dynamic scale outside [floor, max_loss_scale] is clamped
        into it; a static scale never changes (a checkpoint of a dynamic run loaded at a
        static level keeps the level's scale). Returns the saved scale when it was not taken
        as it is (the caller warns), else None."""
        scale, self.unskipped = self.check_state(state)
        taken = self.clamp(scale) if self.dynamic else self.scale
        self.scale = taken
        return scale if taken != scale else None


def scalers_state_dict(scalers: Sequence[LossScaler]) -> dict[str, dict[str, float | int]]:
    """Apex's checkpoint format: {"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}."""
    return {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(scalers)}


def load_scalers_state_dict(scalers: Sequence[LossScaler], state_dict: object, warn: Callable[[str], None],
                            opt_level: str) -> None:
    """Load what `scalers_state_dict` saved into `scalers`. Every entry is checked before any
    is loaded; entries that match no scaler, scalers with no entry, and saved scales that are
    not taken as they are (clamped, or a static scale that stays) are reported through `warn`."""
    if not isinstance(state_dict, dict):
        raise ConfigTypeError(f"load_state_dict expects the dict from amp.state_dict(), got "
                              f"{type(state_dict).__name__}.")
    names = {f"loss_scaler{i}": s for i, s in enumerate(scalers)}
    unknown = [k for k in state_dict if not (isinstance(k, str) and k.startswith("loss_scaler")
                                             and k[11:].isdigit())]
    if unknown:
        raise StateDictKeyError(f"unknown keys {unknown} in the amp state dict; expected 'loss_scaler0', ...")
    for value in state_dict.values():  # all checked before any is loaded
        LossScaler.check_state(value)
    matching = [k for k in state_dict if k in names]
    extra = sorted(k for k in state_dict if k not in names)
    if not matching:
        raise StateDictKeyError(
            f"the amp state dict has {sorted(state_dict) or 'no loss scalers'}, none of the loss scalers of this "
            f"session ({', '.join(names)}; num_losses={len(scalers)}): nothing would be loaded. Pass "
            "initialize the num_losses the checkpoint was saved with.")
    if len(state_dict) != len(scalers) or extra:
        missing = sorted(k for k in names if k not in state_dict)
        warn(f"ampatch: the state dict has {len(state_dict)} loss scalers, this session uses "
             f"{len(scalers)} (num_losses); loading the ones that match"
             + (f"; not loaded: {extra}" if extra else "")
             + (f"; left as they are: {missing}" if missing else "") + ".")
    for key in matching:
        s = names[key]
        saved = s.load_state_dict(state_dict[key])
        if saved is None:
            continue
        if s.dynamic:
            warn(f"ampatch: {key} saved a loss scale of {saved:g}, outside this session's range "
                 f"[{s.floor:g}, {s.max_loss_scale:g}] (min_loss_scale, max_loss_scale); it starts at "
                 f"{s.scale:g}.")
        else:
            warn(f"ampatch: {key} saved a loss scale of {saved:g}, but this session's scale is static "
                 f"({s.scale:g}, opt level {opt_level}) and stays; pass "
                 "loss_scale='dynamic' to initialize to continue the saved dynamic scale.")


class Verdict:
    """The host-side overflow decision of one unscale: the inf/NaN flag read (all-reduced
    over `process_group` under torch.distributed), the scaler updated at `iteration()`, and on
    overflow `on_overflow(scale before, scale after)` (the optimizers then skip their next
    step). Runs once, however many optimizers it was deferred to (delay_overflow_check)."""

    def __init__(self, scaler: LossScaler, found_inf: torch.Tensor | None, *, process_group: object = None,
                 iteration: Callable[[], int] = lambda: 0,
                 on_overflow: Callable[[float, float], None] | None = None) -> None:
        self.scaler, self.found_inf, self.process_group = scaler, found_inf, process_group
        self.iteration, self.on_overflow = iteration, on_overflow
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        overflow = False if self.found_inf is None else overflowed(self.found_inf, self.process_group)
        before = self.scaler.scale
        self.scaler.update(overflow, self.iteration())
        if overflow and self.on_overflow is not None:
            self.on_overflow(before, self.scaler.scale)


def unscale_(grads: Sequence[torch.Tensor], inv_scale: float, found_inf: torch.Tensor | None) -> torch.Tensor:
    """Multiply `grads` in place by `inv_scale` and OR any inf/NaN into `found_inf`.

    One fused kernel per device (grads of mixed dtypes are fine); returns the flag. A sparse
    grad is unscaled and checked through its values (coalesce a float16 one first, as
    torch.amp.GradScaler does: summing duplicate indices may overflow).
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if type(g) is not torch.Tensor:  # fsdp hook: a DTensor grad unscales its local shard
            g = _local(g)
        by_device.setdefault(g.device, []).append(g._values() if g.is_sparse else g)
    for device, group in by_device.items():
        if found_inf is None:
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        flag = found_inf if found_inf.device == device else torch.zeros((), dtype=torch.float32, device=device)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
        _unscale_(group, flag, inv)
        if flag is not found_inf:
            found_inf = torch.maximum(found_inf, flag.to(found_inf.device))
    if found_inf is None:
        found_inf = torch.zeros((), dtype=torch.float32)
    return found_inf


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own storage: in-place ops change the DTensor): each rank
    unscales and checks what it holds, and `overflowed` all-reduces the flag."""
    return getattr(t, "_local_tensor", t)


def distributed(process_group=None) -> bool:
    """torch.distributed is initialized and `process_group` (default: the world) has several ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1


def overflowed(found_inf: torch.Tensor, process_group=None) -> bool:
    """Host-side verdict; under torch.distributed every rank gets the same answer (MAX)."""
    if distributed(process_group):
        flag = found_inf.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        return bool(flag.item())
    return bool(found_inf.item())


def first_problem(problem: str | None, process_group: Any = None, device: Any = "cpu") -> str | None:
    """One verdict for every rank on a checkpoint each rank checked on its own (a rank that
    raised alone would hang the others in their next collective): the first rank's problem,
    naming the rank, or None where no rank found one."""
    if not distributed(process_group):
        return problem
    if not overflowed(torch.tensor(float(problem is not None), device=device), process_group):
        return None
    said: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(said, problem, group=process_group)
    rank, problem = next((r, p) for r, p in enumerate(said) if p is not None)
    return f"{problem} (in rank {rank}'s part)"


def abort(handles: Sequence[Any], scale: float) -> None:
    """A `scale_loss` block raised (a KeyboardInterrupt from a backward hook included):
    whatever its backward wrote is unscaled like on a normal exit, so the grads hold what
    they held before the block plus the new part unscaled, as in plain PyTorch; never
    scaled grads that a later step applies. A non-finite new part makes the next step
    skip. The verdict is local (no collective on an exception path: the other ranks are
    not in this block) and the scale is left alone (it must stay equal on every rank).
    `handles`: the block's `optim.handle.OptimizerHandle`s."""
    found_inf = None
    for h in handles:
        found_inf = h.after_backward(scale, found_inf, delay_unscale=False)
    if found_inf is not None and bool(found_inf.item()):
        for h in handles:
            h.skip_next_step()
        logger.warning("ampatch: the scale_loss block raised after writing non-finite gradients; the next "
                       "optimizer.step() is skipped.")
