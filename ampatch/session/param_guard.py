"""At run time, the model-side parameters the optimizers step, watched (`ParamGuard`): a
parameter replaced after `initialize` (by fully_shard, FSDP, `load_state_dict(assign=True)`)
would leave the optimizer stepping a tensor the model no longer uses.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import OrderError
from ..model import cast, sharded
from ..optim.handle import OptimizerHandle

__all__ = ["ParamGuard"]


class ParamGuard:
    """Watches the model-side parameters the optimizers step; `check(handle)`, at each
    `handle.step()`, raises when one that this optimizer steps left the model after `initialize`.

    Fast path: one identity comparison per registration of the optimizer's parameters (a
    module's `_parameters` slot; for an FSDP2-sharded parameter, FSDP2's record of it, so
    FSDP's switching between sharded and unsharded parameters in forward and backward is no
    change). When one changed, the models are searched again: a parameter that only moved (a
    parametrization registered after initialize) is watched where it is now; one that is gone
    was replaced, and this and every later check of its optimizer raise.
    """

    def __init__(self, models: Sequence[nn.Module], handles: Sequence[OptimizerHandle]) -> None:
        self.models = list(models)
        # FSDP2's parameter records of the models that were sharded at initialize
        self._units = {id(m): sharded.Units(m) for m in self.models if cast.is_sharded([m])}
        self._held = {id(h): h.model_params() for h in handles}
        where = self._registrations()
        self._watch = {hid: self._watched(hid, where) for hid in self._held}

    def check(self, handle: OptimizerHandle) -> None:
        # .get: an optimizer brought in after initialize (amp.init's wrap_optimizer) is not watched
        for slots, key, p, _ in self._watch.get(id(handle), ()):
            if slots.get(key) is not p:
                return self._search(id(handle))
        return None

    def _registrations(self) -> dict[int, list[tuple[dict, str, torch.Tensor, str]]]:
        """id(held tensor) -> where the models hold it: (dict, key, tensor, qualified name),
        `dict[key] is tensor` while it is there."""
        held = {id(t) for ts in self._held.values() for t in ts}
        where: dict[int, list[tuple[dict, str, torch.Tensor, str]]] = {}
        for model in self.models:
            named = list(model.named_modules())
            units = self._units.get(id(model))
            managed = units.managed_slots() if units else set()
            if units:
                prefixes = {id(m): prefix for prefix, m in named}
                for fp in units.params:
                    p = fp.sharded_param
                    if id(p) in held:
                        m, n = units.slots(fp)[0]
                        where.setdefault(id(p), []).append(
                            (vars(fp), "sharded_param", p, _qualified(prefixes.get(id(m), "?"), n)))
            for prefix, m in named:
                for n, p in m._parameters.items():
                    if p is not None and id(p) in held and (id(m), n) not in managed:
                        where.setdefault(id(p), []).append((m._parameters, n, p, _qualified(prefix, n)))
        return where

    def _watched(self, hid: int, where: dict[int, list]) -> list[tuple[dict, str, torch.Tensor, str]]:
        return [r for t in self._held[hid] for r in where.get(id(t), ())]

    def _search(self, hid: int) -> None:
        where = self._registrations()
        gone = [name for *_, p, name in self._watch[hid] if id(p) not in where]
        if gone:  # the watch stays as it was: the next check finds the change again
            raise OrderError(
                f"ampatch: the model's parameter {gone[0]!r} was replaced after amp.initialize (by fully_shard, "
                "FSDP, load_state_dict(assign=True) or another wrapper that swaps parameters), so the optimizer "
                f"steps a tensor the model no longer uses and training would silently do nothing. Under FSDP2: "
                f"{sharded.ORDER}. Otherwise call amp.initialize after the wrapper, or wrap with one that keeps the "
                "parameters (DistributedDataParallel) after initialize.")
        self._watch[hid] = self._watched(hid, where)


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
