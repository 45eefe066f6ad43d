"""One object holding everything an `initialize` call set up; its one job: set up, step, close.

Made from a checked call (`options.Prepared`). The set-up proper is `setup.setup` or
`fsdp.setup` (each returns what it built); what watches from outside (report at exit,
diagnose recorder, end after N steps) is a list of `observers`; `telemetry` assembles the
report and `tips` words the warnings. The live session is held in `current`.
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

from . import fsdp, observers, setup
from ..machine import hardware, tips
from ..model import keep
from ..o1 import lists
from ..o1.cache import CastCache
from ..config import levels
from ..config.env import Overrides
from ..config.properties import Properties
from ..model.cast import ModelHandle
from ..base.notices import warn
from ..o1.install import O1Patches
from ..optim.context import HandleContext, OptState
from ..optim.handle import OptimizerHandle
from ..optim.masters import state_bytes
from ..config.options import Options, Prepared, optimizer_list
from .param_guard import ParamGuard
from ..base.patcher import Patcher
from ..o1.wrappers import WrapContext
from ..o1.lists import user as user_policy
from ..optim.scaler import LossScaler, Verdict, abort, check_loss_id, load_scalers_state_dict, scalers_state_dict
from .report import Report
from .telemetry import Telemetry

logger = logging.getLogger("ampatch")


class Session:
    """The state of one `initialize`: properties, patches, cache, scalers, handles, telemetry."""

    def __init__(self, properties: Properties, options: Options = Options(), overrides: Overrides = Overrides(),
                 attributes: Callable[[OptimizerHandle], dict[str, Any]] | None = None) -> None:
        self.properties, self.options, self.overrides = properties, options, overrides
        self.attributes = attributes  # what each patched optimizer carries besides (Apex's _amp_stash)
        self.verbosity = options.verbosity  # Apex's `_amp_state.verbosity` writes it
        self.patcher = Patcher()
        self.cache = CastCache()
        self.telemetry = Telemetry(record=overrides.report is not None, time_wrappers=overrides.time_wrappers,
                                   progress=overrides.progress)
        self.scalers = [self._scaler() for _ in range(options.num_losses)]
        self.models: list[ModelHandle | fsdp.ShardedModel] = []
        self.optimizers: list[OptimizerHandle] = []
        self.kept: list[keep.Kept] = []  # the modules kept in FP32 (keep_fp32, AMPATCH_KEEP_FP32)
        self.observers: list[observers.Observer] = []
        self.guard: ParamGuard | None = None  # parameters swapped after initialize (fully_shard, ...)
        self.device: hardware.SessionDevice | None = None  # hardware.check_half: the device, its half dtype
        self.closed = False
        self._last_loss: torch.Tensor | None = None

    @classmethod
    def open(cls, prepared: Prepared,
             attributes: Callable[[OptimizerHandle], dict[str, Any]] | None = None) -> "Session":
        """A session set up on the prepared models and optimizers; one that fails half-way is
        closed (everything it changed undone) before the error propagates. `attributes`: see
        `HandleContext.attributes`."""
        session = cls(prepared.properties, prepared.options, prepared.overrides, attributes)
        try:
            session.setup(prepared.models, prepared.optimizers)
        except BaseException:
            session.close()
            raise
        return session

    # ------------------------------------------------------------------ set-up
    def setup(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Cast models, make masters, patch optimizers and (O1/O4) torch itself."""
        props = self.properties
        self.device = hardware.check_half(models, props.half_dtype if props.enabled and props.half_name else None,
                                          self.verbosity)
        self.kept = keep.select(models, self.options.keep_fp32, self.overrides.keep_fp32,
                                props.enabled and props.casts_model, self.warn)
        if not props.enabled:
            return
        if levels.uses_half(props.opt_level):
            tips.log_dims_tip(models, self.verbosity)
        kept = setup.keep_forwards(self.kept, props, self.patcher)
        build = fsdp.setup if fsdp.is_sharded(models) else setup.setup
        self.models, self.optimizers = build(props, models, optimizers, self.patcher, self._handle_context(), kept)
        setup.wrap_model_outputs(models, props, self.patcher, kept)
        self.guard = ParamGuard(models, self.optimizers)
        for h in self.optimizers:
            h.install(self.patcher, self.guard)
        lost = tips.eps_lost_in_float16(optimizers)
        if lost:
            self.warn(tips.eps_lost_warning(lost, props.opt_level))
        if props.patch_torch_functions:
            self.o1.install(user_policy.REGISTERED, lists.NAMESPACES)
        observers.attach(self, models, self.overrides, lost)
        logger.info("ampatch: %s (%s), %s", props.opt_level, props.half_dtype, props)

    def _scaler(self) -> LossScaler:
        return LossScaler(self.properties.loss_scale, self.options.min_loss_scale, self.options.max_loss_scale)

    def _handle_context(self) -> HandleContext:
        """What each optimizer handle needs from this session."""
        return HandleContext(process_group=self.options.process_group, on_step=self.on_step,
                             on_skips=self._warn_skipping, scales_loss=lambda: any(not s.is_identity for s in self.scalers),
                             master_owner=self._master_owner, level=self.properties.opt_level,
                             attributes=self.attributes)

    def _master_owner(self, p: torch.Tensor) -> OptimizerHandle | None:
        return next((h for h in self.optimizers if h.owns_master(p)), None)

    def add_optimizer(self, optimizer: torch.optim.Optimizer, num_losses: int = 1) -> OptimizerHandle:
        """Bring an optimizer into the live session, with at least `num_losses` loss scalers
        (Apex's `amp.init()` handle takes its optimizers after the session started)."""
        h = next((h for h in self.optimizers if h.optimizer is optimizer), None)
        if h is None:
            _, (h,) = setup.setup(self.properties, [], [optimizer], self.patcher, self._handle_context(),
                                  first_index=len(self.optimizers))
            h.install(self.patcher)
            self.optimizers.append(h)
        self.scalers += [self._scaler() for _ in range(num_losses - len(self.scalers))]
        return h

    @functools.cached_property
    def o1(self) -> O1Patches:
        """This session's O1 patches (made on first use: O1/O4 patch torch, decorators wrap)."""
        timer = self.telemetry.add_wrapper_time if self.telemetry.time_wrappers else None
        ctx = WrapContext(self.cache.caster, self.properties.half_dtype, self.telemetry.counters,
                          self.options.allow_banned, timer)
        return O1Patches(self.patcher, self.cache, ctx)

    def decorated(self, kind: str, fn: Any) -> Any:
        """The cast wrapper of a function decorated with `amp.half_function` & co."""
        return self.o1.decorated(kind, fn)

    def register_now(self, owner: Any, name: str, kind: str) -> None:
        """A registration made while this session patches torch takes effect at once."""
        if self.properties.enabled and self.properties.patch_torch_functions and not self.closed:
            self.o1.register(owner, name, kind)

    # ------------------------------------------------------------------ training loop
    def handle(self, optimizer: torch.optim.Optimizer, what: str = "scale_loss") -> OptimizerHandle:
        """The handle of `optimizer`; `what` names the caller in the error for a stranger."""
        h = next((h for h in self.optimizers if h.optimizer is optimizer), None)
        if h is not None:
            return h
        raise RuntimeError(f"{what} got an optimizer that was not passed to amp.initialize; pass every "
                           "optimizer to initialize (they come back patched). A later amp.initialize ends the "
                           "earlier session: its optimizers are plain torch optimizers again.")

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizers: Any, loss_id: int = 0, model: Any = None,
                   delay_unscale: bool = False, delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"scale_loss expects the loss tensor, got {type(loss).__name__}.")
        check_loss_id(loss_id, len(self.scalers))
        opts = optimizer_list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if not self.properties.enabled:
            yield loss
            return
        handles = [self.handle(o) for o in opts]
        if loss_id == 0:
            self.telemetry.on_loss(loss)
            for o in self.observers:
                o.on_loss(loss, self.scalers[0].scale)
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
                abort(handles, scale)
            finally:
                self.cache.clear()
            raise
        start = time.perf_counter()
        try:
            found_inf = None
            for h in handles:
                found_inf = h.after_backward(scale, found_inf, delay_unscale)
            if not delay_unscale and not any(h.stage is OptState.SCALED for h in handles):  # fsdp: kept scaled
                verdict = Verdict(scaler, found_inf, process_group=self.options.process_group,
                                  iteration=lambda: self.iteration, on_overflow=self._skipper(handles, loss_id))
                if delay_overflow_check:
                    for h in handles:
                        h.defer(verdict)
                else:
                    verdict()
        finally:
            self.cache.clear()
            self.telemetry.scale_loss_time += time.perf_counter() - start

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
            for o in self.observers:
                o.on_step(skipped)
        elif skipped and iteration not in self.telemetry.skipped[-len(self.optimizers):]:
            self.telemetry.skipped.append(iteration)  # an iteration is listed once, however many skipped

    def _warn_skipping(self, handle: OptimizerHandle, count: int) -> None:
        """`count` steps of `handle` in a row were skipped: say why, as far as the loss tells."""
        which = handle.index if len(self.optimizers) > 1 else None
        self.warn(tips.skipping_warning(count, self._last_loss, self.scalers, which), RuntimeWarning)

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        warn(message, self.verbosity, category)

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
        return self.telemetry.report(self.properties, {"hits": self.cache.hits, "misses": self.cache.misses},
                                     self.scalers, self.device, [k.label for k in self.kept],
                                     [h.masters.footprint() for h in self.optimizers],
                                     sum(state_bytes(h.optimizer) for h in self.optimizers))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Undo everything: masters back out of optimizers, models to their dtypes, torch restored."""
        if self.closed:
            return
        try:
            for o in self.observers:  # the report keeps what it would write; the recorder's hooks go
                o.close()
        finally:
            self.closed = True
            self._last_loss = None
            try:
                setup.undo(self.models, self.optimizers)
            finally:  # whatever failed above, torch itself is restored
                self.patcher.restore_all()
                self.cache.clear()
