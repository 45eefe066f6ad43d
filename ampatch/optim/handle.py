"""One optimizer under mixed precision (`OptimizerHandle`): gradient unscaling into the
masters, skip-on-overflow, the patched `step()` that copies masters back with foreach ops.

A handle needs no session: what it asks of its surroundings is a `HandleContext`, and the
overflow verdict that skips its step comes from outside (`skip_next_step`). The gradient
flow per iteration, closures, and what changes under torch.distributed: docs/internals.md.
"""
from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..base.dtypes import LOW
from ..base.patcher import Patcher, disable_casts
from ..config.values import MasterMode, StatePrecision
from ..errors import ConfigError, ConfigTypeError, NotSupportedError, OrderError
from . import calls, context, state_checkpoint
from .context import BACK, ON_ITS_OWN, GradStage, HandleContext, StageCall, StepGuard, expect_stage
from .lowmem import LowMemMasters, take_state_entries
from .masters import LOWMEM_KEY, MASTERS_KEY, Masters, Pair, add_grads, check_lowmem_entry, check_masters
from .scaler import distributed, unscale_
from .states import STATES_KEY, StateStore
from .stepper import step_kept

logger = logging.getLogger("ampatch")

SKIP_WARNING_AFTER = 50  # skipped steps in a row before the first warning (then 100, 200, ...)
PATCHED = ("step", "zero_grad", "add_param_group", "state_dict", "load_state_dict")


class OptimizerHandle:
    """One optimizer under mixed precision: its masters, its grads through scale_loss, its step.

    `master_ids`: the params that get a master (None: no masters), made at once from their
    current (FP32) values; `mode`: FP32 masters (`masters.Masters`) or a low-memory mode
    ("stochastic"/"kahan": `lowmem.LowMemMasters`, which steps the optimizer in chunks); `states`:
    its state's precision (`states.StateStore`). `install` patches the optimizer's step, zero_grad,
    add_param_group, state_dict and load_state_dict. Without a session:

        handle = OptimizerHandle(opt, master_ids={id(p) for p in model.parameters()},
                                 context=HandleContext(scales_loss=lambda: not scaler.is_identity))
        model.half(); handle.install(Patcher())
        handle.run_deferred(); handle.before_backward(scaler.scale)
        (loss.float() * scaler.scale).backward()
        found_inf = handle.after_backward(scaler.scale, None, delay_unscale=False)
        Verdict(scaler, found_inf, on_overflow=lambda *_: handle.skip_next_step())()
        opt.step()  # skipped after an overflow

    Where its gradients stand is `stage` (a `GradStage`); the calls that move it, and the
    order they are allowed in, are the table in `optim.context` (`STAGE_MOVES`), checked at
    every call. From before_backward to the unscale that ends the scale_loss, the grads that
    were there before are kept apart (`_stash`). Overflow verdicts can wait (`defer`,
    delay_overflow_check) until `run_deferred`, which step() and the next scale_loss call
    first. Skipped steps in a row are counted (`consecutive_skips`) and reported to
    `HandleContext.on_skips` as they pile up.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, index: int = 0, master_ids: set[int] | None = None,
                 context: HandleContext = ON_ITS_OWN, mode: MasterMode = MasterMode.FP32,
                 states: StatePrecision = StatePrecision.FLOAT32) -> None:
        self.optimizer = optimizer
        self.index = index
        self._precision, self._keeps_state = states, states.stored
        # made where it keeps something (first: it refuses what it cannot keep), or reads a kept state back
        self._states = StateStore(optimizer, states) if states.stored else None
        self.masters = (LowMemMasters(optimizer, master_ids, mode) if mode.low_memory and master_ids is not None
                        else Masters(optimizer, master_ids))
        if states.stored or any(isinstance(s, dict) and STATES_KEY in s for s in optimizer.state.values()):
            state_checkpoint.take_kept(self.states, list(self.params()))  # a kept state a plain optimizer loaded
        self.use_masters = self.masters.enabled  # every unscale is checked, even at a static 1.0
        self._ctx = context
        self._guard: StepGuard | None = None
        self._stage = GradStage.FRESH
        self._back = GradStage.READY  # where SCALED goes back to
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._deferred: list[Callable[[], None]] = []
        self._steps, self._skips, self._warn_at = 0, 0, SKIP_WARNING_AFTER  # steps; skipped ones in a row

    @property
    def stage(self) -> GradStage:
        return self._stage

    @property
    def states(self) -> StateStore:
        """The kept state (`states.StateStore`); at "float32" made on first use (to read a checkpoint's back)."""
        self._states = self._states or StateStore(self.optimizer, self._precision)
        return self._states

    @states.setter
    def states(self, store: StateStore) -> None:  # a subclass's own store (the sharded one) steps and saves
        self._states, self._precision, self._keeps_state = store, store.precision, store.precision.stored

    def _move(self, call: StageCall) -> None:
        """The stage after `call`, as `STAGE_MOVES` says (checked first: `expect_stage`)."""
        stage = self._stage
        target = expect_stage(call, stage)
        if target is BACK:
            target = self._back
        elif target is GradStage.SCALED and stage is not GradStage.SCALED:
            self._back = stage
        self._stage = target

    @property
    def steps(self) -> int:
        """Calls of step(), skipped ones included."""
        return self._steps

    @property
    def consecutive_skips(self) -> int:
        return self._skips

    def pairs(self) -> Iterator[Pair]:
        """(model param, master) for every half param with a separate FP32 master."""
        return self.masters.pairs()

    def params(self) -> Iterator[torch.Tensor]:
        """What the optimizer steps: masters where they exist."""
        return self.masters.params()

    def model_params(self) -> list[torch.Tensor]:
        """The model-side tensors the optimizer steps (the half param for a master)."""
        return self.masters.model_params()

    def owns_master(self, p: torch.Tensor) -> bool:
        return id(p) in self.masters.master_of

    def scaling_active(self) -> bool:
        """Whether scale_loss unscales and checks this optimizer's grads."""
        return self.use_masters or self._ctx.scales_loss()

    # ------------------------------------------------------------------ scale_loss
    def before_backward(self, scale: float) -> None:
        """Keep already-unscaled grads apart from the coming scaled backward (under
        torch.distributed: scale them to `scale` in place instead, see the module docstring)."""
        first = self._stage is GradStage.FRESH
        self._move(StageCall.BEFORE_BACKWARD)
        if first and self.use_masters:
            self.masters.agree(self._ctx.process_group)
        if self._stage is GradStage.SCALED:
            return
        if distributed():
            self._rescale_in_place(scale)
            return
        pairs, own = self.masters.split()
        stash = [(p, g) for p in own if (g := p.grad) is not None]
        for p, _ in stash:
            p.grad = None
        fresh = [(mp, p) for mp, p in pairs if mp.grad is not None]  # a plain backward outside scale_loss
        if fresh:
            self.masters.move_grads(fresh)
        self._stash = stash

    def _rescale_in_place(self, scale: float) -> None:
        """Existing (unscaled) grads times `scale`, left where the coming backward accumulates."""
        pairs, params = self.masters.split()
        own = [g for p in params if (g := p.grad) is not None]
        for mp, p in pairs:
            if mp.grad is not None:  # a plain backward outside scale_loss: unscaled already
                self.masters.move_grads([(mp, p)])
            if p.grad is not None:
                mp.grad = (p.grad * scale).to(mp.dtype)  # may overflow: then this unscale skips
                p.grad = None
        if own and scale != 1.0:
            torch._foreach_mul_(own, scale)

    def after_backward(self, scale: float, found_inf: torch.Tensor | None, delay_unscale: bool) -> torch.Tensor | None:
        """Unscale the new grads (into masters), check them, add the stash back; returns the
        inf/NaN flag (ORed into `found_inf`). With `delay_unscale` (or `unscale_waits`) the
        grads stay scaled."""
        if delay_unscale or self.unscale_waits():
            self._move(StageCall.KEEP_SCALED)
            return found_inf
        self._move(StageCall.UNSCALE)  # grads a delayed unscale left are unscaled and checked with the new ones
        inv = 1.0 / scale
        pairs, params = self.masters.split()
        own = []  # the new grads of the params that are their own masters
        for p in params:
            g = p.grad
            if g is not None:
                if g.is_sparse and g.dtype == torch.float16:  # see scaler.unscale_
                    p.grad = g = g.coalesce()
                own.append(g)
        if own:
            found_inf = unscale_(own, inv, found_inf)
        found_inf = self.masters.move_grads(pairs, inv, found_inf, check=True)
        stash, self._stash = self._stash, []
        add_grads([p for p, _ in stash], [g for _, g in stash])
        if found_inf is None:
            # never the default dtype: a framework step may have made it half
            found_inf = torch.zeros((), dtype=torch.float32)
        return found_inf

    def skip_next_step(self) -> None:
        """The next step() is skipped (its grads were found non-finite)."""
        self._move(StageCall.SKIP_NEXT_STEP)
        if self._stage is GradStage.SCALED:
            self._back = GradStage.OVERFLOWED

    def defer(self, verdict: Callable[[], None]) -> None:
        """Run an overflow verdict later (delay_overflow_check): at step() or the next scale_loss."""
        self._deferred.append(verdict)

    def run_deferred(self) -> None:
        """Run the deferred verdicts now."""
        verdicts, self._deferred = self._deferred, []
        for verdict in verdicts:
            verdict()

    # ------------------------------------------------------------------ patched methods
    def install(self, patcher: Patcher, guard: StepGuard | None = None) -> None:
        """Patch step/zero_grad/add_param_group/state_dict/load_state_dict as bound methods;
        each step() first asks `guard.check(self)`."""
        self._guard = guard
        opt = self.optimizer
        for name in PATCHED:
            inner = getattr(opt, name)  # bound: the class method or an instance override
            method = calls.forwarding_method(getattr(self, "_" + name), inner, name, type(opt))
            if getattr(inner, "_wrapped_by_lr_sched", False):
                # an LR scheduler made before initialize wrapped step (to see that it is called);
                # the patched step calls that wrapper, so the scheduler must not think it was replaced
                method._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            patcher.patch(opt, name, types.MethodType(method, opt))
        for name, value in (self._ctx.attributes(self) if self._ctx.attributes else {}).items():
            if not hasattr(opt, name):
                setattr(opt, name, value)
                patcher.on_restore(functools.partial(context.drop_attribute, opt, name, value))

    def _step(self, inner: Callable, *args: Any, **kwargs: Any) -> Any:
        """step() as the user called it: the arguments go to the optimizer's own step as given
        (an Apex-era `step(None, grads=...)` keeps its positional None)."""
        if self._guard is not None:
            self._guard.check(self)
        closure = calls.closure(inner, args, kwargs)
        if closure is not None and self.scaling_active() and not self._ctx.scaled_closures:
            raise NotSupportedError(
                "optimizer.step(closure) is not supported with loss scaling or master weights: the closure's "
                "backward bypasses scale_loss. Call backward inside `with amp.scale_loss(...)` before "
                "step(), or use a level without scaling (O0, O3, O4).")
        if self._stage is GradStage.SCALED:  # the table's "raises", with the fix for the user
            raise OrderError(self.still_scaled_message())
        self.run_deferred()
        skip = self._stage is GradStage.OVERFLOWED
        self._move(StageCall.STEP)
        if skip:
            self._skipped()
            return None
        self._steps += 1
        if self.masters.steps_itself:  # stochastic/kahan: the optimizer steps a chunk at a time
            return self._chunked_step(inner, args, kwargs)
        pairs = list(self.pairs()) if self.use_masters else None  # one walk for the whole step
        if pairs:
            self.masters.settle()  # a write to a half weight since the last step reaches its master
            self.masters.move_grads(pairs)
        try:
            with disable_casts():
                if self._keeps_state:
                    out = step_kept(self.optimizer, inner, args, kwargs, self.states)
                else:  # the optimizer's own state: its own step
                    out = inner(*args, **kwargs)
        finally:  # even a step that raised half-way: the model shows what the masters hold
            if pairs:
                self.masters.copy_to_model(pairs)
        if pairs:
            for _, m in pairs:
                m.grad = None
        self._stepped(skipped=False)
        return out

    def _chunked_step(self, inner: Callable, args: tuple, kwargs: dict) -> Any:
        self.masters.move_grads(list(self.pairs()))  # grads of a plain backward outside scale_loss
        with disable_casts():
            out = self.masters.step(inner, args, kwargs, self._states)
        self._stepped(skipped=False)
        return out

    def settle_skip(self) -> bool:
        """If the next step() is to be skipped (OVERFLOWED), skip it now, as step() would: params
        and optimizer state untouched, master grads dropped, counted as a skipped step. For a
        caller that skips the step itself (Apex's `update_scale()` returning should_skip);
        returns whether a step was skipped."""
        skip = self._stage is GradStage.OVERFLOWED
        self._move(StageCall.SETTLE_SKIP)
        if skip:
            self._skipped()
        return skip

    def _skipped(self) -> None:
        """A skipped step: counted, master grads dropped, params and optimizer state untouched."""
        self._steps += 1
        for _, m in self.pairs():
            m.grad = None
        self._stepped(skipped=True)

    def _stepped(self, skipped: bool) -> None:
        """Count the skip streak (reported with back-off: 50, 100, 200, ... in a row), then tell on_step."""
        if skipped:
            self._skips += 1
            if self._skips >= self._warn_at:
                self._warn_at *= 2
                (self._ctx.on_skips or context.warn_skips)(self, self._skips)
        else:
            self._skips, self._warn_at = 0, SKIP_WARNING_AFTER
        if self._ctx.on_step is not None:
            self._ctx.on_step(self, skipped)

    def _zero_grad(self, inner: Callable, *args: Any, **kwargs: Any) -> None:
        """zero_grad() as the user called it (Apex's and DeepSpeed's fused optimizers declare
        `zero_grad(self)`), then the masters' grads and the model's the same way."""
        inner(*args, **kwargs)  # an argument it does not take raises its own TypeError
        set_to_none = calls.set_to_none(inner, args, kwargs)
        for mp, _ in self.pairs():
            if set_to_none or mp.grad is None:
                mp.grad = None
            else:
                mp.grad.detach_().zero_()
        self._stash = []
        self._move(StageCall.ZERO_GRAD)

    def _add_param_group(self, inner: Callable, *args: Any, **kwargs: Any) -> None:
        group, call = calls.first_argument(inner, args, kwargs, "param_group")
        if self.use_masters and isinstance(group, dict) and "params" in group:
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            owner_of = self._ctx.master_owner
            for p in params:
                other = owner_of(p) if owner_of is not None else None
                if other is not None and other is not self:
                    raise ConfigError(f"add_param_group: a parameter of shape {tuple(p.shape)} already has an FP32 "
                                      f"master in optimizers[{other.index}]; with master weights (O2/O5) each "
                                      "half parameter must belong to one optimizer.")
            group = dict(group, params=[self.masters.make(p) if p.dtype in LOW else p for p in params])
        return call(group)

    def _state_dict(self, inner: Callable, *args: Any, **kwargs: Any) -> dict:
        sd = inner(*args, **kwargs)
        sd.update(self.checkpoint_entries())
        self.add_state_entries(sd)
        return sd

    def _load_state_dict(self, inner: Callable, *args: Any, **kwargs: Any) -> None:
        state_dict, call = calls.first_argument(inner, args, kwargs, "state_dict")
        if state_dict is None:
            return call(None)  # the optimizer's own error for a call without a state dict
        if not isinstance(state_dict, dict):
            raise ConfigTypeError(f"optimizer.load_state_dict expects a dict, got {type(state_dict).__name__}.")
        self.load_entries(dict(state_dict), call)

    # ------------------------------------------------------------------ hooks (optim.sharded overrides them)
    def unscale_waits(self) -> bool:
        """Whether the grads of the last backward cannot be unscaled yet: they stay scaled, as
        under `delay_unscale`, until a backward that can (FSDP2 with gradient sync off keeps
        them unreduced inside FSDP). Plain: never."""
        return False

    def still_scaled_message(self) -> str:
        """Why step() refuses grads that are still scaled."""
        return ("scale_loss(..., delay_unscale=True) left scaled gradients before step(); the last scale_loss of "
                "an iteration must use delay_unscale=False.")

    def checkpoint_entries(self) -> dict[str, Any]:
        """What `optimizer.state_dict()` carries besides torch's own (the masters)."""
        return self.masters.checkpoint() if self.use_masters else {}

    def add_state_entries(self, state_dict: dict) -> None:
        """The params' entries besides torch's own: kahan compensations (`lowmem`), kept state (`state_checkpoint`)."""
        if isinstance(state_dict.get("state"), dict):
            self.masters.state_entries(state_dict["state"])  # nothing where there are no masters
            if self._states is not None:
                state_checkpoint.add_entries(self._states, list(self.params()), state_dict["state"])

    def load_entries(self, state_dict: dict, inner: Callable) -> None:
        """`optimizer.load_state_dict`: ampatch's entries taken out of `state_dict` and checked,
        torch's own `inner(state_dict)`, then the entries applied.

        Everything is checked before anything is loaded: a rejected checkpoint (another
        model's shapes, tampered masters) leaves the optimizer, its masters and the model as
        they were. Saved FP32 masters go into whatever this optimizer steps: its masters, or,
        at a level without them (an O2 checkpoint resumed at O1), the model params themselves.
        The entry of master_weights "stochastic"/"kahan" is loaded where this session uses that mode."""
        masters = state_dict.pop(MASTERS_KEY, None)
        lowmem = state_dict.pop(LOWMEM_KEY, None)
        params = list(self.params())
        if masters is not None:
            check_masters(masters, params)
        if lowmem is not None:
            check_lowmem_entry(lowmem, params)
        comps, kept = {}, state_checkpoint.NOTHING
        if isinstance(state_dict.get("state"), dict):  # kahan compensations, kept state: in the params' entries
            state_dict["state"] = dict(state_dict["state"])
            comps = take_state_entries(state_dict["state"], params)
            kept = state_checkpoint.take(state_dict["state"], params)
        with self.masters.loading():
            inner(state_dict)  # torch checks the param groups before it changes anything
        state_checkpoint.apply(self.states, kept, params, replaced=True)
        self.masters.take_comps(comps, params)
        if lowmem is not None:
            self.masters.load_lowmem(lowmem, params)
        if masters is None:
            return
        self.masters.take_saved(params, masters)
        if not self.use_masters and any(saved is not None for saved in masters):
            logger.info("ampatch: the optimizer checkpoint's FP32 master weights were loaded into the model's "
                        "params (this session, %s, has no masters).", self._ctx.level or "its level")

    # ------------------------------------------------------------------ undo
    def unswap(self) -> Mapping[int, torch.Tensor]:
        """Kept state back to FP32, model params back into param_groups; returns masters by model param id."""
        if self._states is not None:
            self._states.restore(self.params())
        return self.masters.unswap()

    def recast_state(self) -> None:
        """Floating optimizer state follows its param's dtype (after the model was cast or restored)."""
        self.masters.recast_state()

