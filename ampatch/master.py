"""One optimizer in a session: FP32 master weights, gradient unscaling, skip-on-overflow.

Every optimizer gets an `OptimizerHandle`. Under O2/O5 the half parameters of the model
are replaced, in the optimizer's param_groups, by FP32 masters made from the FP32 weights
before the model was cast; FP32 parameters (batch norm, or every parameter at O1) are
their own masters. Gradient flow per iteration:

- `before_backward` (scale_loss entry): grads that are already unscaled are kept apart
  (own-master grads are stashed and set to None; fresh model grads of a half param are
  moved into its master), so the coming backward writes only the new, scaled part;
- `after_backward` (scale_loss exit): the new grads are unscaled into the masters with one
  fused kernel that also detects inf/NaN, then the stash is added back;
- `step`: skipped on overflow (params and state untouched, master grads dropped);
  otherwise the optimizer runs with casts disabled and masters are copied into the model
  with foreach ops.
Model grads of half params are None after they were moved into masters, so master grads
never leak across steps whichever way the user zeroes.

`optimizer.step(closure)` works where ampatch has nothing to do around the backward (no
master weights and a static loss scale of 1.0: O0, O3, O4, and O1 in bfloat16); with master
weights or loss scaling it raises `NotImplementedError`, because the closure's backward
would bypass `scale_loss`.

Under torch.distributed (world size > 1) `before_backward` does not keep grads apart: it
multiplies them by the coming scale and leaves them in `.grad` (master grads go back into
the half model grads), because a `DistributedDataParallel` backward all-reduces whatever
`.grad` holds; grads kept apart (micro-batches under `no_sync()`) would never be averaged
across ranks. The first `scale_loss` also makes every rank's masters agree with the model
that DDP's construction broadcast from rank 0.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .dtypes import LOW
from .patching import Patcher, disable_casts
from .scaler import distributed, overflowed, unscale_

logger = logging.getLogger("ampatch")

MASTERS_KEY = "ampatch_masters"
_COPY_CHUNK = 16  # model grads converted into FP32 master grads per foreach call


def _forwarding_method(func: Callable, inner: Callable, name: str, cls: type) -> Callable:
    """A plain function (so LR schedulers can take `step.__func__`) calling func(inner, ...)."""
    def method(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return func(inner, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"{cls.__name__}.{name}"
    method.__doc__ = getattr(inner, "__doc__", None)
    return method


def _add_grads(params: list[torch.Tensor], extra: list[torch.Tensor]) -> None:
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


def _check_masters(masters: Any, params: list[torch.Tensor]) -> None:
    """The saved masters of an optimizer checkpoint fit `params` (one entry per param, in
    param_groups order: None or a floating tensor of the param's shape)."""
    if not isinstance(masters, (list, tuple)):
        raise TypeError(f"optimizer checkpoint: '{MASTERS_KEY}' must be a list (one entry per param), got "
                        f"{type(masters).__name__}; the checkpoint was not saved by ampatch's optimizer.state_dict().")
    if len(masters) != len(params):
        raise ValueError(f"optimizer checkpoint has {len(masters)} master entries for {len(params)} params; "
                         "it was saved from a different model or optimizer. Nothing was loaded.")
    for i, (p, saved) in enumerate(zip(params, masters)):
        if saved is None:
            continue
        if not isinstance(saved, torch.Tensor) or not saved.is_floating_point() or saved.shape != p.shape:
            what = (f"shape {tuple(saved.shape)}" if isinstance(saved, torch.Tensor) and saved.is_floating_point()
                    else type(saved).__name__ if not isinstance(saved, torch.Tensor) else str(saved.dtype))
            raise ValueError(f"optimizer checkpoint: master {i} has {what}, its param has shape {tuple(p.shape)}; "
                             "it was saved from a different model or optimizer. Nothing was loaded.")


def _cast_state(state: dict, dtype: torch.dtype) -> dict:
    """One param's optimizer state with its floating tensors in `dtype` (`step` stays as is)."""
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
            for k, v in state.items()}


class OptimizerHandle:
    """The session's view of one optimizer; see the module docstring for the flow."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, session: Any,
                 cast_param_ids: set[int] | None) -> None:
        self.optimizer = optimizer
        self.index = index
        self.session = session
        self.use_masters = cast_param_ids is not None
        self.model_of: dict[int, torch.Tensor] = {}   # id(master) -> half model param
        self.master_of: dict[int, torch.Tensor] = {}  # id(model param) -> master
        self.skip_next = False
        self.pending_scaled = False  # a delay_unscale block left scaled grads
        self.steps = 0
        self.consecutive_skips = 0  # skipped steps in a row; the session warns when they pile up
        self.next_skip_warning = 0  # warn when consecutive_skips reaches this (0: the session's default)
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rescaled: tuple[float, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._masters_agreed = False
        self._pending_check: list[Callable[[], None]] = []
        if self.use_masters:
            for group in optimizer.param_groups:
                group["params"] = [self._make_master(p) if id(p) in cast_param_ids else p
                                   for p in group["params"]]

    # ------------------------------------------------------------------ masters
    def _make_master(self, p: torch.Tensor) -> torch.Tensor:
        if id(p) in self.master_of:
            return self.master_of[id(p)]
        master = nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
        self.model_of[id(master)] = p
        self.master_of[id(p)] = master
        state = self.optimizer.state
        if p in state:  # state made before initialize now belongs to the master, in FP32
            state[master] = _cast_state(state.pop(p), torch.float32)
        return master

    def pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, master) for every half param with a separate FP32 master."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                mp = self.model_of.get(id(p))
                if mp is not None:
                    yield mp, p

    def params(self) -> Iterator[torch.Tensor]:
        """What the optimizer steps: masters where they exist."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def copy_masters_to_model(self, pairs: list | None = None) -> None:
        if pairs is None:
            pairs = list(self.pairs())
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([mp for mp, _ in pairs], [m for _, m in pairs])

    def resync_from_model(self, incoming: dict[int, torch.Tensor] | None = None,
                          params: list[torch.Tensor] | None = None) -> None:
        """After `model.load_state_dict`: a master takes the loaded tensor of its param (exact FP32
        values from an FP32 checkpoint), unless that tensor only carries the model's half
        precision and the master rounds to it already (an O2 `model.state_dict()` loaded after
        the optimizer's masters: the masters are the better copy). A master that otherwise no
        longer matches the model takes the model's values.

        `params` limits this to those model params (a submodule's load); `incoming` holds only
        what torch loaded (see model._LoadHook)."""
        incoming = incoming or {}
        if params is None:
            pairs = list(self.pairs())
        else:
            pairs = [(mp, self.master_of[id(mp)]) for mp in params if id(mp) in self.master_of]
        with torch.no_grad():
            for mp, m in pairs:
                src = incoming.get(id(mp))
                if src is not None:
                    src = src.to(m.device)
                    rounded = src.to(mp.dtype)
                    if not (torch.equal(rounded.to(src.dtype), src) and torch.equal(rounded, m.to(mp.dtype))):
                        m.copy_(src)
                elif not torch.equal(mp, m.to(mp.dtype)):
                    m.copy_(mp)

    def _move_model_grads(self, pairs: list, inv_scale: float, found_inf: torch.Tensor | None,
                          check: bool) -> torch.Tensor | None:
        """Model grads -> FP32 master grads (unscaled, added to what is there); model grads -> None."""
        model_grads, masters = [], []
        for mp, m in pairs:
            if mp.grad is not None:
                model_grads.append(mp.grad)
                masters.append(m)
                mp.grad = None
        if not masters:
            return found_inf
        new: list = [None] * len(masters)
        dense = []
        for i, (m, g) in enumerate(zip(masters, model_grads)):
            if g.is_sparse:  # FP32 and coalesced: the duplicates are summed without overflow
                new[i] = g.to(m.dtype).coalesce()
            else:
                dense.append(i)
        del g
        # Dense grads convert in chunks, each chunk's half grads released as soon as it is
        # copied: all the half grads and all their FP32 copies never exist at once (O2's peak).
        for start in range(0, len(dense), _COPY_CHUNK):
            chunk = dense[start:start + _COPY_CHUNK]
            out = [torch.empty_like(masters[i]) for i in chunk]
            torch._foreach_copy_(out, [model_grads[i] for i in chunk])
            for i, o in zip(chunk, out):
                new[i] = o
                model_grads[i] = None
        if check:
            found_inf = unscale_(new, inv_scale, found_inf)
        elif inv_scale != 1.0:
            torch._foreach_mul_(new, inv_scale)
        _add_grads(masters, new)
        return found_inf

    # ------------------------------------------------------------------ scale_loss
    def before_backward(self, scale: float) -> None:
        """Keep already-unscaled grads apart from the coming scaled backward (under
        torch.distributed: scale them to `scale` in place instead, see the module docstring)."""
        if self.use_masters and not self._masters_agreed:
            self._masters_agreed = True
            self._agree_masters()
        if self.pending_scaled:
            return
        if distributed():
            self._rescale_in_place(scale)
            return
        stash, fresh = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                mp = self.model_of.get(id(p))
                if mp is None:
                    if p.grad is not None:
                        stash.append((p, p.grad))
                        p.grad = None
                elif mp.grad is not None:  # a plain backward outside scale_loss: unscaled already
                    fresh.append((mp, p))
        if fresh:
            self._move_model_grads(fresh, 1.0, None, check=False)
        self._stash = stash

    def _rescale_in_place(self, scale: float) -> None:
        """Existing (unscaled) grads times `scale`, left where the coming backward accumulates."""
        own, pairs = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                mp = self.model_of.get(id(p))
                if mp is None:
                    if p.grad is not None:
                        own.append(p)
                    continue
                if mp.grad is not None:  # a plain backward outside scale_loss: unscaled already
                    self._move_model_grads([(mp, p)], 1.0, None, check=False)
                if p.grad is not None:
                    mp.grad = (p.grad * scale).to(mp.dtype)  # may overflow: then this unscale skips
                    p.grad = None
                    pairs.append((mp, p))
        if own and scale != 1.0:
            torch._foreach_mul_([p.grad for p in own], scale)
        self._rescaled = (scale, own, pairs) if own or pairs else None

    def _agree_masters(self) -> None:
        """Under torch.distributed, once: if on any rank a master no longer rounds to its model
        param (DDP broadcast rank 0's weights into the model after `initialize` made the masters
        from each rank's own weights), every rank takes its masters from the model."""
        pairs = list(self.pairs())
        group = self.session.process_group
        if not pairs or not distributed(group):
            return
        with torch.no_grad():
            stale = any(not torch.equal(mp, m.to(mp.dtype)) for mp, m in pairs)
            if overflowed(torch.full((), float(stale), device=pairs[0][1].device), group):  # MAX: any rank
                torch._foreach_copy_([m for _, m in pairs], [mp for mp, _ in pairs])
                logger.info("ampatch: FP32 master weights taken from the model on every rank (the ranks' "
                            "weights differed when amp.initialize made them); seed every rank alike to keep "
                            "the FP32 initial weights.")

    def after_backward(self, scale: float, found_inf: torch.Tensor | None, delay_unscale: bool) -> torch.Tensor | None:
        """Unscale the new grads (into masters), check them, add the stash back."""
        if delay_unscale:
            self.pending_scaled = True
            return found_inf
        self.pending_scaled = False
        self._rescaled = None  # scaled like the new grads: unscaled and checked with them
        inv = 1.0 / scale
        own, pairs = [], []  # one pass: own-master grads, and (model param, master) pairs
        model_of = self.model_of
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                mp = model_of.get(id(p))
                if mp is None:
                    g = p.grad
                    if g is not None:
                        if g.is_sparse and g.dtype == torch.float16:  # see scaler.unscale_
                            p.grad = g = g.coalesce()
                        own.append(g)
                else:
                    pairs.append((mp, p))
        if own:
            found_inf = unscale_(own, inv, found_inf)
        found_inf = self._move_model_grads(pairs, inv, found_inf, check=True)
        self.restore_stash()
        if found_inf is None:
            found_inf = torch.zeros(())
        return found_inf

    def restore_stash(self) -> None:
        """Add the grads kept apart in before_backward back onto the params (or, under
        torch.distributed, unscale the grads it scaled in place)."""
        if self._rescaled is not None:
            scale, own, pairs = self._rescaled
            self._rescaled = None
            own_grads = [p.grad for p in own if p.grad is not None]
            if own_grads:
                torch._foreach_mul_(own_grads, 1.0 / scale)
            self._move_model_grads(pairs, 1.0 / scale, None, check=False)
        stash, self._stash = self._stash, []
        _add_grads([p for p, _ in stash], [g for _, g in stash])

    def defer(self, check: Callable[[], None]) -> None:
        """Run an overflow verdict later (delay_overflow_check): at step() or the next scale_loss."""
        self._pending_check.append(check)

    def resolve(self) -> None:
        checks, self._pending_check = self._pending_check, []
        for check in checks:
            check()

    # ------------------------------------------------------------------ patched methods
    def install(self, patcher: Patcher) -> None:
        """Patch step/zero_grad/add_param_group/state_dict/load_state_dict as bound methods."""
        opt = self.optimizer
        for name in ("step", "zero_grad", "add_param_group", "state_dict", "load_state_dict"):
            inner = getattr(opt, name)  # bound: the class method or an instance override
            method = _forwarding_method(getattr(self, "_" + name), inner, name, type(opt))
            if getattr(inner, "_wrapped_by_lr_sched", False):
                # an LR scheduler made before initialize wrapped step (to see that it is called);
                # the patched step calls that wrapper, so the scheduler must not think it was replaced
                method._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            patcher.patch(opt, name, types.MethodType(method, opt))

    def _step(self, inner: Callable, closure: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        session = self.session
        if session.guard is not None:  # fsdp hook: parameters swapped after initialize (fsdp.ParamGuard)
            session.guard.check(self)
        if closure is not None and session.scaling_active(self):
            raise NotImplementedError(
                "optimizer.step(closure) is not supported with loss scaling or master weights: the closure's "
                "backward bypasses scale_loss. Call backward inside `with amp.scale_loss(...)` before "
                "step(), or use a level without scaling (O0, O3, O4).")
        if self.pending_scaled:
            raise RuntimeError("scale_loss(..., delay_unscale=True) left scaled gradients before step(); the "
                               "last scale_loss of an iteration must use delay_unscale=False.")
        self.resolve()
        self.steps += 1
        if self.skip_next:
            self.skip_next = False
            for _, m in self.pairs():
                m.grad = None
            session.on_step(self, skipped=True)
            return None
        pairs = list(self.pairs()) if self.use_masters else None  # one walk for the whole step
        if pairs:
            self._move_model_grads(pairs, 1.0, None, check=False)
        try:
            with disable_casts():
                out = inner(closure, *args, **kwargs) if closure is not None else inner(*args, **kwargs)
        finally:  # even a step that raised half-way: the model shows what the masters hold
            if pairs:
                self.copy_masters_to_model(pairs)
        if pairs:
            for _, m in pairs:
                m.grad = None
        session.on_step(self, skipped=False)
        return out

    def _zero_grad(self, inner: Callable, set_to_none: bool = True) -> None:
        inner(set_to_none)
        for mp, _ in self.pairs():
            if set_to_none or mp.grad is None:
                mp.grad = None
            else:
                mp.grad.detach_().zero_()
        self._stash = []
        self._rescaled = None
        self.pending_scaled = False

    def _add_param_group(self, inner: Callable, group: dict) -> None:
        if self.use_masters:
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for p in params:
                for other in self.session.optimizers:
                    if other is not self and id(p) in other.master_of:
                        raise ValueError(f"add_param_group: a parameter of shape {tuple(p.shape)} already has an FP32 "
                                         f"master in optimizers[{other.index}]; with master weights (O2/O5) each "
                                         "half parameter must belong to one optimizer.")
            group = dict(group, params=[self._make_master(p) if p.dtype in LOW
                                        else p for p in params])
        return inner(group)

    def _state_dict(self, inner: Callable) -> dict:
        sd = inner()
        if self.use_masters:
            sd[MASTERS_KEY] = [p.detach() if id(p) in self.model_of else None for p in self.params()]
        return sd

    def _load_state_dict(self, inner: Callable, state_dict: dict) -> None:
        """Everything is checked before anything is loaded: a rejected checkpoint (another
        model's shapes, tampered masters) leaves the optimizer, its masters and the model as
        they were. Saved FP32 masters go into whatever this session steps: its masters, or,
        at a level without them (an O2 checkpoint resumed at O1), the model params themselves."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"optimizer.load_state_dict expects a dict, got {type(state_dict).__name__}.")
        state_dict = dict(state_dict)
        masters = state_dict.pop(MASTERS_KEY, None)
        params = list(self.params())
        if masters is not None:
            _check_masters(masters, params)
        inner(state_dict)  # torch checks the param groups before it changes anything
        if masters is None:
            return
        with torch.no_grad():
            for p, saved in zip(params, masters):
                if saved is not None:
                    p.copy_(saved)
        if self.use_masters:
            self.copy_masters_to_model()
        elif any(saved is not None for saved in masters):
            logger.info("ampatch: the optimizer checkpoint's FP32 master weights were loaded into the model's "
                        "params (this session, %s, has no masters).", self.session.properties.opt_level)

    # ------------------------------------------------------------------ undo
    def unswap(self) -> dict[int, torch.Tensor]:
        """Put the model params back into param_groups (state re-keyed); returns masters by model param id."""
        if not self.use_masters:
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
                state[p] = _cast_state(state[p], p.dtype)
