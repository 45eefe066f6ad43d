"""One object holding everything an `initialize` call set up, and undoing all of it.

The module-level API in `ampatch/__init__.py` delegates to the current `Session`; there is
at most one, and a new `initialize` closes the previous one first (Apex's once-only
`initialize` and global `_amp_state` are what this replaces).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from . import env, fsdp, hardware, keep, policy, tips
from .cache import CastCache
from .levels import Properties
from .master import check_one_master_each, master_ids
from .forwards import keep_in_fp32, wrap_outputs
from .model import ModelHandle, params_to_cast
from .notices import warn
from .o1 import O1Patches
from .optimizer import HandleContext, OptimizerHandle, OptState
from .param_guard import ParamGuard
from .patching import Patcher, WrapContext
from .policy import user as user_policy
from .scaler import LossScaler, Verdict, load_scalers_state_dict, scalers_state_dict
from .telemetry import Report, Telemetry, exit_report, peak_memory_bytes

logger = logging.getLogger("ampatch")


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
                 process_group: Any = None, keep_fp32: Any = None) -> None:
        self.properties = properties
        self.keep_fp32 = keep_fp32  # the script's specification (see keep.py); `kept` after setup
        self.kept: list[keep.Kept] = []
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
        self.guard: ParamGuard | None = None  # parameters swapped after initialize (fully_shard, ...)
        self._last_loss: torch.Tensor | None = None
        self.stop_after = env.positive_int(env.MAX_STEPS)  # AMPATCH_MAX_STEPS: end the process after N steps
        self.recorder: Any = None  # ampatch.diagnose's Recorder when AMPATCH_DIAGNOSE asks for one
        self.device: dict[str, Any] = {}  # hardware.check_half: the device and its half-precision paths

    # ------------------------------------------------------------------ set-up
    def setup(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Cast models, make masters, patch optimizers and (O1/O4) torch itself."""
        props = self.properties
        self.device = hardware.check_half(models, props, self.verbosity)
        self.kept = self._resolve_kept(models)
        if not props.enabled:
            return
        tips.log_dims_tip(models, self.verbosity, props.opt_level)
        context = self._handle_context()
        kept = self._keep_in_fp32()
        if fsdp.is_sharded(models):  # fsdp hook: FSDP2 (fully_shard) models, see fsdp.py
            self.models, self.optimizers = fsdp.setup(props, models, optimizers, self.patcher, context, kept)
        else:
            keep_bn = props.keep_batchnorm_fp32
            cast_ids = ({id(p) for m in models for p in params_to_cast(m, keep_bn, kept)} if props.casts_model
                        else set())
            ids = [self._master_ids(opt, cast_ids) for opt in optimizers]
            if props.master_weights:
                check_one_master_each(optimizers, set().union(*ids) if ids else set())
            for i, opt in enumerate(optimizers):  # masters from the FP32 weights, before the cast
                self.optimizers.append(OptimizerHandle(opt, i, ids[i], context))
            if props.casts_model:
                mastered = ({pid for h in self.optimizers for pid in h.masters.master_of} if props.master_weights
                            else None)
                seen: dict[int, torch.dtype] = {}  # params cast so far, over all the models
                for m in models:
                    handle = ModelHandle(m, props.cast_model_type, keep_bn, props.cast_model_outputs, self.patcher,
                                         mastered, seen, kept)
                    handle.on_load(self._resync_masters)
                    self.models.append(handle)
                for h in self.optimizers:
                    h.recast_state()
            elif props.cast_model_outputs is not None:  # O0/O1/O4: only the outputs are cast (Apex)
                for m in models:
                    if id(m) not in kept:  # a model kept whole: its keep wrapper casts the outputs
                        wrap_outputs(m, props.cast_model_outputs, self.patcher)
        self.guard = ParamGuard(models, self.optimizers)
        for h in self.optimizers:
            h.install(self.patcher, self.guard)
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
            exit_report.track(self, env.get(env.REPORT))
        if env.get(env.DIAGNOSE):  # per-module statistics for `ampatch diagnose` (ampatch/diagnose/)
            from .record.child import attach
            self.recorder = attach(self, models, env.get(env.DIAGNOSE), eps_lost=lost)
        logger.info("ampatch: %s (%s), %s", props.opt_level, props.half_dtype, props)

    def _resolve_kept(self, models: list[nn.Module]) -> list[keep.Kept]:
        """The modules `keep_fp32` and AMPATCH_KEEP_FP32 keep in FP32 (see keep.py); where the
        model is cast to half, with the modules that share a parameter with them."""
        forced = keep.forced_names()
        if forced and not models:  # amp.init(): a session of patches alone, nothing to keep
            logger.warning("ampatch: %s is set, but this session has no models (amp.init()): nothing kept in FP32.",
                           env.KEEP_FP32)
            forced = []
        kept = keep.resolve(models, self.keep_fp32, forced)
        if forced:
            logger.warning("ampatch: %s=%s: these modules run in FP32 too (added to the script's keep_fp32).",
                           env.KEEP_FP32, ",".join(forced))
        if self.properties.enabled and self.properties.casts_model:
            kept, tied = keep.with_tied(models, kept)
            if tied:
                self.warn(f"ampatch: keep_fp32 keeps {', '.join(repr(k.label) for k in tied)} in FP32 too: "
                          "it holds a parameter of a kept module (tied weights), and a parameter is FP32 or half "
                          "everywhere it is used. Add it to keep_fp32 to silence this, or untie the weights.")
        if kept:
            logger.info("ampatch: keep_fp32: %s run in FP32.", ", ".join(repr(k.label) for k in kept))
        return kept

    def _keep_in_fp32(self) -> frozenset[int]:
        """Wrap the forward of every kept module (see `forwards.keep_in_fp32`); returns the ids of
        the modules that stay FP32 (kept ones and everything inside them). Levels that leave
        the model FP32 and torch unpatched (O0) have nothing to wrap."""
        props = self.properties
        if props.casts_model or props.patch_torch_functions:
            half = props.cast_model_type if props.casts_model else None
            for k in self.kept:  # a model kept whole hands out what its model wrapper would
                keep_in_fp32(k.module, self.patcher, props.cast_model_outputs if k.name == "" else half,
                             props.patch_torch_functions)
        return keep.kept_module_ids(self.kept)

    def _master_ids(self, optimizer: torch.optim.Optimizer, cast_ids: set[int]) -> set[int] | None:
        """The params that get an FP32 master (None: no master weights at this level)."""
        return master_ids(optimizer, cast_ids) if self.properties.master_weights else None

    def _handle_context(self) -> HandleContext:
        """What each optimizer handle needs from this session."""
        return HandleContext(process_group=self.process_group, on_step=self.on_step, on_skips=self._warn_skipping,
                             scales_loss=lambda: any(not s.is_identity for s in self.scalers),
                             master_owner=self._master_owner, level=self.properties.opt_level)

    def _master_owner(self, p: torch.Tensor) -> OptimizerHandle | None:
        return next((h for h in self.optimizers if h.owns_master(p)), None)

    def add_optimizer(self, optimizer: torch.optim.Optimizer, num_losses: int = 1) -> OptimizerHandle:
        """Bring an optimizer into the live session, with at least `num_losses` loss scalers
        (Apex's old `amp.init()` handle takes its optimizers after the session started)."""
        for h in self.optimizers:
            if h.optimizer is optimizer:
                break
        else:
            h = OptimizerHandle(optimizer, len(self.optimizers), self._master_ids(optimizer, set()),
                                self._handle_context())
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
            if self.recorder is not None:
                self.recorder.on_loss(loss, self.scalers[0].scale)
        self._last_loss = loss.detach()  # only read when steps keep being skipped
        scaler = self.scalers[loss_id]
        if scaler.is_identity and not any(h.use_masters for h in handles):  # nothing to unscale or check
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
            if not delay_unscale and not any(h.stage is OptState.SCALED for h in handles):  # fsdp: kept scaled
                verdict = Verdict(scaler, found_inf, process_group=self.process_group,
                                  iteration=lambda: self.iteration, on_overflow=self._skipper(handles, loss_id))
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
                h.skip_next_step()
            logger.warning("ampatch: the scale_loss block raised after writing non-finite gradients; the next "
                           "optimizer.step() is skipped.")

    def _skipper(self, handles: Sequence[OptimizerHandle], loss_id: int) -> Callable[[float, float], None]:
        """What an overflow verdict does: the optimizers skip their next step, and it is logged."""
        def on_overflow(before: float, after: float) -> None:
            for h in handles:
                h.skip_next_step()
            if self.verbosity >= 1:  # the session's choice, whatever the logger's level
                logger.info("ampatch: gradient overflow, skipping step; loss scaler %d scale %g -> %g",
                            loss_id, before, after)
        return on_overflow

    def on_step(self, handle: OptimizerHandle, skipped: bool) -> None:
        """Called by every patched optimizer.step(): the params changed, so the casts are stale."""
        self.cache.clear()
        iteration = handle.steps - 1
        if handle.index == 0:
            self.telemetry.on_step(iteration, skipped)
            if self.recorder is not None:
                self.recorder.on_step(skipped)
            if self.stop_after is not None and handle.steps >= self.stop_after:
                logger.info("ampatch: %s=%d: ending the process after %d optimizer steps.", env.MAX_STEPS,
                            self.stop_after, handle.steps)
                raise SystemExit(0)
        elif skipped and iteration not in self.telemetry.skipped[-len(self.optimizers):]:
            self.telemetry.skipped.append(iteration)  # an iteration is listed once, however many skipped

    def _warn_skipping(self, handle: OptimizerHandle, count: int) -> None:
        """`count` steps of `handle` in a row were skipped: say why, as far as the loss tells."""
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
        self.warn(f"ampatch: {which}{count} optimizer steps in a row were skipped because the "
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
        return scalers_state_dict(self.scalers)

    def load_state_dict(self, state_dict: dict) -> None:
        load_scalers_state_dict(self.scalers, state_dict, self.warn, self.properties.opt_level)

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
            keep_fp32=[k.label for k in self.kept],
        )

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Undo everything: masters back out of optimizers, models to their dtypes, torch restored."""
        if self.closed:
            return
        exit_report.release(self)
        self.closed = True
        self._last_loss = None
        if self.recorder is not None:  # its hooks leave the models (what it measured is kept)
            self.recorder.close()
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
