"""What the Trainer plugin and the Fabric plugin share: their state, what the running
session does to batches and step code, and the FP32 masters seen from the model's side
(grads for hooks, `requires_grad` for toggling). The level they initialize at is
`frameworks.level.LevelChoice` (the Trainer integration of transformers uses it too).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from .. import load_state_dict, state_dict
from ..errors import ConfigError
from ..frameworks.level import DEFAULT_LEVEL, LevelChoice
from ..model.default_dtype import default_dtype
from ..model.forwards import cast_tree
from ..session.report import Report
from ..session.session import current
from .framework import PrecisionName, set_compute_dtype, set_precision

logger = logging.getLogger("ampatch")

__all__ = ["DEFAULT_LEVEL", "PluginState", "LevelChoice", "Facts", "pairs_of", "HookGrads", "sync_requires_grad",
           "ScalerCheckpoint", "PluginAttributes", "start_plugin"]


class PluginState(Enum):
    """Where a plugin is: nothing done yet, an ampatch session running, undone again."""
    IDLE = "idle"
    CONNECTED = "connected"
    TORN_DOWN = "torn down"


@dataclass(frozen=True)
class Facts:
    """What the running session does, as the plugins need it: its level, whether it casts
    the models (O2/O3/O5) and to what, and the dtype its matmuls run in."""

    opt_level: str | None = None
    cast_dtype: torch.dtype | None = None       # the models' half dtype where they are cast
    compute_dtype: torch.dtype = torch.float32  # the matmuls' dtype (half at O1-O5)

    @classmethod
    def of_session(cls) -> "Facts":
        """The facts of the live session (`Facts()` where none is live or it is disabled)."""
        session = current()
        if session is None or not session.properties.enabled:
            return cls(session.properties.opt_level if session is not None else None)
        props = session.properties
        cast = props.cast_model_type if props.casts_model else None
        half = props.half_dtype if (props.casts_model or props.patch_torch_functions) else torch.float32
        return cls(props.opt_level, cast, half)

    @property
    def precision(self) -> PrecisionName:
        """Lightning's name for what the weights are: "bf16-true"/"16-true" where the models are
        cast, else "32-true" (what ModelSummary sizes the model by)."""
        if self.cast_dtype is None:
            return "32-true"
        return "bf16-true" if self.cast_dtype == torch.bfloat16 else "16-true"

    def convert_input(self, data: Any) -> Any:
        """The batch's floating tensors in the models' half dtype where they are cast (as
        Lightning's `bf16-true` does); untouched otherwise."""
        return data if self.cast_dtype is None else cast_tree(data, self.cast_dtype)

    def step_context(self) -> contextlib.AbstractContextManager:
        """Around a step (training_step, validation_step, ... or Fabric's forward): tensors
        made inside are in the models' half dtype where they are cast (the default dtype)."""
        return contextlib.nullcontext() if self.cast_dtype is None else default_dtype(self.cast_dtype)


def pairs_of(optimizers: Iterable[torch.optim.Optimizer]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model param, FP32 master) of every half param the optimizers step through a master
    (none without master weights, or without a live session)."""
    session = current()
    if session is None or not session.properties.enabled:
        return []
    return [pair for opt in optimizers for pair in session.handle(opt, "ampatch.lightning").pairs()]


def sync_requires_grad(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], to_model: bool) -> None:
    """Make `requires_grad` agree between each model param and its master: the model's onto the
    master (`to_model=False`: before Lightning's `toggle_optimizer` reads the masters), or the
    master's onto the model (after it set them: the backward must skip the model's half params)."""
    for model_param, master in pairs:
        if to_model:
            model_param.requires_grad_(master.requires_grad)
        else:
            master.requires_grad_(model_param.requires_grad)


class HookGrads:
    """While framework hooks run (on_after_backward, on_before_optimizer_step), the model's
    half params hold half copies of their masters' grads, so code that reads the model's
    grads (`lightning.pytorch.utilities.grad_norm(self)`, a logger) sees them rather than
    None; a copy changed in place there (or replaced) is written back into the master's grad
    when `close` runs, and the copies are dropped. Nothing is copied without masters."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.lent: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        with torch.no_grad():
            for model_param, master in pairs:
                if master.grad is None or model_param.grad is not None:
                    continue
                copy = master.grad.to(model_param.dtype)
                model_param.grad = copy
                self.lent.append((model_param, master, copy, copy._version))

    def close(self) -> None:
        """Write changed copies back into the masters' grads; the model's grads are None again."""
        lent, self.lent = self.lent, []
        with torch.no_grad():
            for model_param, master, copy, version in lent:
                grad = model_param.grad
                if grad is not copy or copy._version != version:
                    if grad is None or master.grad is None:  # dropped here, or the master's meanwhile
                        master.grad = None if grad is None else grad.to(master.dtype)
                    else:
                        master.grad.copy_(grad)
                model_param.grad = None

    @classmethod
    @contextlib.contextmanager
    def lent_for(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator["HookGrads"]:
        """A `HookGrads` closed when the block ends (whether or not it raised)."""
        grads = cls(pairs)
        try:
            yield grads
        finally:
            grads.close()


class ScalerCheckpoint:
    """A plugin's checkpoint entry: the live session's loss scalers (Apex's format) and the
    level they ran at. An entry loaded before the session exists (a resume restores the
    plugin first) waits for it: `resume` applies it once the plugin has initialized."""

    def __init__(self, plugin: str) -> None:
        self.plugin = plugin
        self.pending: dict[str, Any] | None = None

    def save(self, facts: Facts, active: bool) -> dict[str, Any]:
        """The entry; empty when no session with optimizers is running (`active` False)."""
        return {"opt_level": facts.opt_level, "loss_scalers": state_dict()} if active else {}

    def load(self, entry: dict[str, Any], facts: Facts, active: bool) -> None:
        """Restore `entry` now (`active`: a session with optimizers runs) or at `resume`."""
        if not entry:
            return
        if "loss_scalers" not in entry:
            raise ConfigError(f"{self.plugin}.load_state_dict: this checkpoint entry was not written by an ampatch "
                              f"plugin (keys {sorted(entry)}).")
        if active:
            self._apply(entry, facts)
        else:
            self.pending = entry

    def resume(self, facts: Facts, carried: dict[str, Any] | None = None) -> None:
        """After the plugin initialized: the entry loaded before it, else `carried` (the loss
        scalers of the session this one replaces)."""
        entry, self.pending = self.pending, None
        if entry is not None:
            self._apply(entry, facts)
        elif carried is not None:
            load_state_dict(carried)

    @staticmethod
    def _apply(entry: dict[str, Any], facts: Facts) -> None:
        if entry.get("opt_level") != facts.opt_level:
            logger.warning("ampatch: resuming an %s checkpoint at %s; its loss scale is loaded as it is.",
                           entry.get("opt_level"), facts.opt_level)
        load_state_dict(entry["loss_scalers"])


class PluginAttributes:
    """What `start_plugin` sets on both plugins, declared once for readers and type checkers."""

    choice: LevelChoice
    opt_level: str | None
    facts: Facts
    state: PluginState
    optimizers: list[torch.optim.Optimizer]
    checkpoint: ScalerCheckpoint
    last_report: Report | None  # the session's report(), kept when teardown ends the session


def start_plugin(plugin: PluginAttributes, who: str, opt_level: str | None, policy: Any,
                 initialize_kwargs: dict[str, Any]) -> None:
    """What both plugins' `__init__` sets (not their Lightning base's `__init__`: the dtype
    is known once the session resolved it): the level choice, the session's facts, the state,
    the optimizers, the scaler's checkpoint entry, the last report; the compute dtype FP32 until then."""
    plugin.choice = LevelChoice(who, opt_level, policy, initialize_kwargs)
    plugin.opt_level = opt_level
    plugin.facts = Facts()
    plugin.state = PluginState.IDLE
    plugin.optimizers = []
    plugin.checkpoint = ScalerCheckpoint(who)
    plugin.last_report = None
    set_precision(plugin, "32-true")  # until a session casts the model
    set_compute_dtype(plugin, torch.float32)
