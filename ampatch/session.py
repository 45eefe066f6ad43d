"""One object holding everything an `initialize` call set up, and undoing all of it.

The module-level API in `ampatch/__init__.py` delegates to the current `Session`; there is
at most one, and a new `initialize` closes the previous one first (Apex's once-only
`initialize` and global `_amp_state` are what this replaces).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from . import env, fsdp, hardware, policy, tips
from .cache import CastCache
from .dtypes import LOW
from .levels import Properties
from .master import OptimizerHandle
from .model import ModelHandle, params_to_cast, wrap_outputs
from .notices import warn
from .o1 import O1Patches
from .patching import Patcher, WrapContext
from .policy import user as user_policy
from .scaler import LossScaler, StateDictKeyError, overflowed
from .telemetry import Report, Telemetry, peak_memory_bytes

logger = logging.getLogger("ampatch")

SKIP_WARNING_AFTER = 50  # consecutive skipped steps before the first warning


def _check_one_master_each(optimizers: list[torch.optim.Optimizer], cast_ids: set[int]) -> None:
    """A param cast to half gets one FP32 master, stepped by one optimizer: a param in two
    optimizers would get two masters, and each step would overwrite the other's update."""
    owner: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in cast_ids and owner.setdefault(id(p), i) != i:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in optimizers[{owner[id(p)]}] and "
                        f"optimizers[{i}]; with FP32 master weights (O2/O5) each half parameter must belong to "
                        "one optimizer (give it to one of them, or use O1).")


class _Current:
    """Holds the one live session: a single reference, not scattered globals."""

    session: "Session | None" = None


def current() -> "Session | None":
    """The live session, or None before `initialize` and after `deinitialize`."""
    return _Current.session


def set_current(session: "Session | None") -> "Session | None":
    """Make `session` the live one; returns the one it replaces (the caller closes it)."""
    previous, _Current.session = _Current.session, session
    return previous


class Session:
    """The state of one `initialize`: properties, patches, cache, scalers, handles, telemetry."""

    def __init__(self, properties: Properties, *, num_losses: int = 1, min_loss_scale: float | None = None,
                 max_loss_scale: float = 2.0 ** 24, allow_banned: bool = False, verbosity: int = 1,
                 process_group: Any = None) -> None:
        self.properties = properties
        self.verbosity = verbosity
        self.allow_banned = allow_banned
        self.process_group = process_group
        self.patcher = Patcher()
        self.cache = CastCache()
        self.telemetry = Telemetry(record=env.get(env.REPORT) is not None,
                                   time_wrappers=env.flag(env.TIME_WRAPPERS))
        self.scalers = [LossScaler(properties.loss_scale, min_loss_scale, max_loss_scale)
                        for _ in range(num_losses)]
        self.models: list[ModelHandle] = []
        self.optimizers: list[OptimizerHandle] = []
        self.closed = False
        self.guard: fsdp.ParamGuard | None = None  # fsdp hook: parameters swapped after initialize
        self._last_loss: torch.Tensor | None = None
        self.device: dict[str, Any] = {}  # hardware.check_half: the device and its half-precision paths

    # ------------------------------------------------------------------ set-up
    def setup(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Cast models, make masters, patch optimizers and (O1/O4) torch itself."""
        props = self.properties
        self.device = hardware.check_half(models, props, self.verbosity)
        if not props.enabled:
            return
        tips.log_dims_tip(models, self.verbosity, props.opt_level)
        if fsdp.is_sharded(models):  # fsdp hook: FSDP2 (fully_shard) models, see fsdp.py
            fsdp.setup(self, models, optimizers)
        else:
            keep_bn = props.keep_batchnorm_fp32
            cast_ids = {id(p) for m in models for p in params_to_cast(m, keep_bn)} if props.casts_model else set()
            master_ids = [self._master_ids(opt, cast_ids) for opt in optimizers]
            if props.master_weights:
                _check_one_master_each(optimizers, set().union(*master_ids) if master_ids else set())
            for i, opt in enumerate(optimizers):  # masters from the FP32 weights, before the cast
                self.optimizers.append(OptimizerHandle(opt, i, self, master_ids[i]))
            if props.casts_model:
                mastered = {pid for h in self.optimizers for pid in h.master_of} if props.master_weights else None
                seen: dict[int, torch.dtype] = {}  # params cast so far, over all the models
                for m in models:
                    handle = ModelHandle(m, props.cast_model_type, keep_bn, props.cast_model_outputs, self.patcher,
                                         mastered, seen)
                    handle.on_load(self._resync_masters)
                    self.models.append(handle)
                for h in self.optimizers:
                    h.recast_state()
            elif props.cast_model_outputs is not None:  # O0/O1/O4: only the outputs are cast (Apex)
                for m in models:
                    wrap_outputs(m, props.cast_model_outputs, self.patcher)
        self.guard = fsdp.ParamGuard(models, self.optimizers)  # fsdp hook
        for h in self.optimizers:
            h.install(self.patcher)
        lost = tips.eps_lost_in_float16(optimizers)
        if lost:
            self.warn(f"ampatch: {'; '.join(lost)}: float16 rounds that eps to 0, and at {props.opt_level} these "
                      "float16 parameters are stepped in float16 (no FP32 master weights), so every weight whose "
                      "gradient is 0 (an embedding row missing from the batch) becomes 0/0 = NaN at the first "
                      "step. Use O2 (FP32 master weights), bfloat16, or an eps float16 can hold (1e-4 is usual "
                      "for float16 Adam).")
        if props.patch_torch_functions:
            self._patch_torch()
        if self.telemetry.record:
            _ExitReport.track(self, env.get(env.REPORT))
        logger.info("ampatch: %s (%s), %s", props.opt_level, props.half_dtype, props)

    def _master_ids(self, optimizer: torch.optim.Optimizer, cast_ids: set[int]) -> set[int] | None:
        """With master weights: the params that get an FP32 master, those the model cast turns
        half and those already half (passed in with Apex's `allow_incoming_model_not_fp32`)."""
        if not self.properties.master_weights:
            return None
        return cast_ids | {id(p) for g in optimizer.param_groups for p in g["params"]
                           if p.dtype in LOW}

    def add_optimizer(self, optimizer: torch.optim.Optimizer, num_losses: int = 1) -> OptimizerHandle:
        """Bring an optimizer into the live session, with at least `num_losses` loss scalers
        (Apex's old `amp.init()` handle takes its optimizers after the session started)."""
        for h in self.optimizers:
            if h.optimizer is optimizer:
                break
        else:
            h = OptimizerHandle(optimizer, len(self.optimizers), self, self._master_ids(optimizer, set()))
            h.install(self.patcher)
            self.optimizers.append(h)
        first = self.scalers[0]
        while len(self.scalers) < num_losses:
            self.scalers.append(LossScaler(self.properties.loss_scale, first.min_loss_scale, first.max_loss_scale))
        return h

    @functools.cached_property
    def o1(self) -> O1Patches:
        """This session's O1 patches (made on first use: O1/O4 patch torch, decorators wrap)."""
        timer = self.telemetry.add_wrapper_time if self.telemetry.time_wrappers else None
        ctx = WrapContext(self.cache.caster, self.properties.half_dtype, self.telemetry.counters, self.allow_banned,
                          timer)
        return O1Patches(self.patcher, self.cache, ctx)

    def _patch_torch(self) -> None:
        self.o1.install(user_policy.REGISTERED, policy.NAMESPACES)

    def decorated(self, kind: str, fn: Any) -> Any:
        """The cast wrapper of a function decorated with `amp.half_function` & co."""
        return self.o1.decorated(kind, fn)

    def register_now(self, owner: Any, name: str, kind: str) -> None:
        """A registration made while this session patches torch takes effect at once."""
        if self.properties.enabled and self.properties.patch_torch_functions and not self.closed:
            self.o1.register(owner, name, kind)

    # ------------------------------------------------------------------ training loop
    def handle(self, optimizer: torch.optim.Optimizer) -> OptimizerHandle:
        for h in self.optimizers:
            if h.optimizer is optimizer:
                return h
        raise RuntimeError("scale_loss got an optimizer that was not passed to amp.initialize; pass every "
                           "optimizer to initialize (they come back patched). A later amp.initialize ends the "
                           "earlier session: its optimizers are plain torch optimizers again.")

    def scaling_active(self, handle: OptimizerHandle, scaler: LossScaler | None = None) -> bool:
        """Whether scale_loss must unscale/check: a non-identity scale, or master weights."""
        if handle.use_masters:
            return True
        scalers = [scaler] if scaler is not None else self.scalers
        return any(not s.is_identity for s in scalers)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizers: Any, loss_id: int = 0, model: Any = None,
                   delay_unscale: bool = False, delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"scale_loss expects the loss tensor, got {type(loss).__name__}.")
        if not isinstance(loss_id, int) or isinstance(loss_id, bool) or not 0 <= loss_id < len(self.scalers):
            raise ValueError(f"loss_id={loss_id!r} is out of range: initialize(num_losses={len(self.scalers)}) "
                             f"gives loss ids 0..{len(self.scalers) - 1}.")
        opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if not opts:
            raise ValueError("scale_loss got no optimizer: pass the optimizer(s) whose params this loss's "
                             "backward reaches (they unscale the grads and skip the step on overflow).")
        for i, o in enumerate(opts):
            if any(o is other for other in opts[:i]):
                raise ValueError(f"scale_loss got the same optimizer twice (optimizers[{i}]); pass each once, or "
                                 "its grads would be unscaled twice.")
        if not self.properties.enabled:
            yield loss
            return
        handles = [self.handle(o) for o in opts]
        if loss_id == 0:
            self.telemetry.on_loss(loss)
        self._last_loss = loss.detach()  # only read when steps keep being skipped
        scaler = self.scalers[loss_id]
        if not any(self.scaling_active(h, scaler) for h in handles):
            try:
                yield loss if loss.dtype == torch.float32 else loss.float()
            finally:
                self.cache.clear()
            return
        start = time.perf_counter()
        for h in handles:
            h.resolve()  # a deferred verdict may still change the scale
        scale = scaler.scale
        for h in handles:
            h.before_backward(scale)
        self.telemetry.scale_loss_time += time.perf_counter() - start
        try:
            yield loss.float() * scale
        except BaseException:
            try:
                self._abort(handles, scale)
            finally:
                self.cache.clear()
            raise
        start = time.perf_counter()
        try:
            found_inf = None
            for h in handles:
                found_inf = h.after_backward(scale, found_inf, delay_unscale)
            if not delay_unscale and not any(h.pending_scaled for h in handles):  # fsdp hook: grads kept scaled
                verdict = _Verdict(self, scaler, loss_id, handles, found_inf)
                if delay_overflow_check:
                    for h in handles:
                        h.defer(verdict)
                else:
                    verdict()
        finally:
            self.cache.clear()
            self.telemetry.scale_loss_time += time.perf_counter() - start

    def _abort(self, handles: Sequence[OptimizerHandle], scale: float) -> None:
        """The `scale_loss` block raised (a KeyboardInterrupt from a backward hook included):
        whatever its backward wrote is unscaled like on a normal exit, so the grads hold what
        they held before the block plus the new part unscaled, as in plain PyTorch; never
        scaled grads that a later step applies. A non-finite new part makes the next step
        skip. The verdict is local (no collective on an exception path: the other ranks are
        not in this block) and the scale is left alone (it must stay equal on every rank)."""
        found_inf = None
        for h in handles:
            found_inf = h.after_backward(scale, found_inf, delay_unscale=False)
        if found_inf is not None and bool(found_inf.item()):
            for h in handles:
                h.skip_next = True
            logger.warning("ampatch: the scale_loss block raised after writing non-finite gradients; the next "
                           "optimizer.step() is skipped.")

    def on_step(self, handle: OptimizerHandle, skipped: bool) -> None:
        """Called by every patched optimizer.step(): the params changed, so the casts are stale."""
        self.cache.clear()
        iteration = handle.steps - 1
        if skipped:
            handle.consecutive_skips += 1
            threshold = handle.next_skip_warning or SKIP_WARNING_AFTER
            if handle.consecutive_skips >= threshold:
                handle.next_skip_warning = 2 * threshold  # repeated with back-off: 50, 100, 200, ... in a row
                self._warn_skipping(handle)
        else:
            handle.consecutive_skips = handle.next_skip_warning = 0
        if handle.index == 0:
            self.telemetry.on_step(iteration, skipped)
        elif skipped and iteration not in self.telemetry.skipped[-len(self.optimizers):]:
            self.telemetry.skipped.append(iteration)  # an iteration is listed once, however many skipped

    def _warn_skipping(self, handle: OptimizerHandle) -> None:
        loss = self._last_loss
        finite = None if loss is None else torch.isfinite(loss)
        if finite is not None and not bool(finite.all()):
            bad = float(loss[~finite].flatten()[0])
            cause = (f"the loss itself is {bad}: no loss scale can fix that. Look "
                     "for inf/NaN in the data or the labels, a log/sqrt/division of zero in the loss, or a "
                     "learning rate that made the weights diverge")
        else:
            cause = ("the gradients hold inf/NaN at every scale tried. Look for a learning rate that is too "
                     "high, an op that overflows in half precision (amp.register_float_function runs it in "
                     "FP32), or inf/NaN in the data")
        scales = ", ".join(f"loss scaler {i}: {s.scale:g}" + (" (its floor)" if s.dynamic and s.scale <= s.floor
                                                            else "")
                           for i, s in enumerate(self.scalers))
        which = f"optimizer {handle.index}: " if len(self.optimizers) > 1 else ""
        self.warn(f"ampatch: {which}{handle.consecutive_skips} optimizer steps in a row were skipped because the "
                  f"gradients were not finite ({scales}); {cause}.", RuntimeWarning)

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        warn(message, self.verbosity, category)

    def _resync_masters(self, incoming: dict[int, torch.Tensor], params: list[torch.Tensor]) -> None:
        for h in self.optimizers:
            h.resync_from_model(incoming, params)

    @property
    def iteration(self) -> int:
        return self.optimizers[0].steps if self.optimizers else 0

    # ------------------------------------------------------------------ state
    def resolve_pending(self) -> None:
        for h in self.optimizers:
            h.resolve()

    def state_dict(self) -> dict[str, dict[str, float | int]]:
        self.resolve_pending()
        return {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.scalers)}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict expects the dict from amp.state_dict(), got {type(state_dict).__name__}.")
        names = {f"loss_scaler{i}": s for i, s in enumerate(self.scalers)}
        unknown = [k for k in state_dict if not (isinstance(k, str) and k.startswith("loss_scaler")
                                                 and k[11:].isdigit())]
        if unknown:
            raise StateDictKeyError(f"unknown keys {unknown} in the amp state dict; expected 'loss_scaler0', ...")
        for key, value in state_dict.items():  # all checked before any is loaded
            LossScaler.check_state(value)
        matching = [k for k in state_dict if k in names]
        extra = sorted(k for k in state_dict if k not in names)
        if not matching:
            raise StateDictKeyError(
                f"the amp state dict has {sorted(state_dict) or 'no loss scalers'}, none of the loss scalers of this "
                f"session ({', '.join(names)}; num_losses={len(self.scalers)}): nothing would be loaded. Pass "
                "initialize the num_losses the checkpoint was saved with.")
        if len(state_dict) != len(self.scalers) or extra:
            missing = sorted(k for k in names if k not in state_dict)
            self.warn(f"ampatch: the state dict has {len(state_dict)} loss scalers, this session uses "
                      f"{len(self.scalers)} (num_losses); loading the ones that match"
                      + (f"; not loaded: {extra}" if extra else "")
                      + (f"; left as they are: {missing}" if missing else "") + ".")
        for key in matching:
            saved = names[key].load_state_dict(state_dict[key])
            if saved is None:
                continue
            s = names[key]
            if s.dynamic:
                self.warn(f"ampatch: {key} saved a loss scale of {saved:g}, outside this session's range "
                          f"[{s.floor:g}, {s.max_loss_scale:g}] (min_loss_scale, max_loss_scale); it starts at "
                          f"{s.scale:g}.")
            else:
                self.warn(f"ampatch: {key} saved a loss scale of {saved:g}, but this session's scale is static "
                          f"({s.scale:g}, opt level {self.properties.opt_level}) and stays; pass "
                          "loss_scale='dynamic' to initialize to continue the saved dynamic scale.")

    def report(self) -> Report:
        self.resolve_pending()
        props, t = self.properties, self.telemetry
        return Report(
            opt_level=props.opt_level,
            half_dtype=str(props.half_dtype).removeprefix("torch.") if props.opt_level != "O0" else None,
            enabled=props.enabled,
            casts=t.counters.snapshot(),
            cache={"hits": self.cache.hits, "misses": self.cache.misses},
            steps=t.steps,
            skipped_steps=list(t.skipped),
            loss_scale={f"loss_scaler{i}": s.scale for i, s in enumerate(self.scalers)},
            loss_scale_history={f"loss_scaler{i}": [list(h) for h in s.history] for i, s in enumerate(self.scalers)},
            time_s={"wrappers": t.wrapper_time if t.time_wrappers else None, "scale_loss": t.scale_loss_time},
            step_times_s=list(t.step_times),
            losses=list(t.losses),
            losses_every=t.losses.stride,
            step_times_every=t.step_times.stride,
            peak_memory_bytes=peak_memory_bytes(),
            device=dict(self.device),
        )

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Undo everything: masters back out of optimizers, models to their dtypes, torch restored."""
        if self.closed:
            return
        _ExitReport.release(self)
        self.closed = True
        self._last_loss = None
        try:
            masters: dict[int, torch.Tensor] = {}
            for h in self.optimizers:
                masters.update(h.unswap())
            for m in self.models:
                m.restore(masters)
            if self.models:
                for h in self.optimizers:
                    h.recast_state()
        finally:  # whatever failed above, torch itself is restored
            self.patcher.restore_all()
            self.cache.clear()


class _Verdict:
    """The host-side overflow decision for one unscale; runs once even if deferred twice."""

    def __init__(self, session: Session, scaler: LossScaler, loss_id: int,
                 handles: Sequence[OptimizerHandle], found_inf: torch.Tensor | None) -> None:
        self.session, self.scaler, self.loss_id = session, scaler, loss_id
        self.handles, self.found_inf = handles, found_inf
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        if self.found_inf is None:
            overflow = False
        else:
            overflow = overflowed(self.found_inf, self.session.process_group)
        before = self.scaler.scale
        self.scaler.update(overflow, self.session.iteration)
        if overflow:
            for h in self.handles:
                h.skip_next = True
            if self.session.verbosity >= 1:  # the session's choice, whatever the logger's level
                logger.info("ampatch: gradient overflow, skipping step; loss scaler %d scale %g -> %g",
                            self.loss_id, before, self.scaler.scale)


class _ExitReport:
    """Writes the report of the newest recording session at interpreter exit.

    One hook per process: a script that calls `initialize` several times reports its last
    session (one exit hook per session would run newest-first and leave the oldest report).
    Under torchrun every rank inherits the same path: only rank 0 writes it.
    """

    session: Session | None = None
    final: Report | None = None  # the report of a tracked session that was closed
    path = ""
    registered = False

    @classmethod
    def track(cls, session: Session, path: str) -> None:
        cls.session, cls.final, cls.path = session, None, path
        if not cls.registered:
            atexit.register(cls.write)
            cls.registered = True

    @classmethod
    def release(cls, session: Session) -> None:
        """`session` is closing: keep its report (small, bounded), not the session with its
        models and optimizers."""
        if cls.session is session:
            try:
                cls.final = session.report()
            except Exception:
                logger.exception("ampatch: could not take the report of the closing session")
            cls.session = None

    @classmethod
    def write(cls) -> None:
        if _rank() != 0:  # fsdp hook: under torchrun every rank shares the path
            return
        try:
            report = cls.session.report() if cls.session is not None else cls.final
            if report is not None:
                report.to_json(cls.path)
        except Exception:  # at interpreter exit: say why, never raise
            logger.exception("ampatch: could not write the report to %s", cls.path)


def _rank() -> int:
    """This process's rank: torchrun's RANK, else torch.distributed's (0 outside distributed runs).
    Read at exit, when the process group may be gone already."""
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
