"""What an optimizer handle (`optim.handle.OptimizerHandle`) and whatever drives it (a
`Session`, Apex's FP16_Optimizer, a caller of its own) say to each other: where the handle's
gradients stand (`GradStage`) and which call moves them where (`STAGE_MOVES`), what the
driver gives it (`HandleContext`: process group, callbacks, attributes to carry), and the
check it runs at each step (`StepGuard`). Kept apart from the mechanism so that a driver
reads its contract in one screen.

The stage machine (a row per call, a column per stage it is called in: the stage it leaves;
"raises": InternalError (a RuntimeError), nothing changed; "back": the stage SCALED was entered from):

    call                   FRESH       READY       SCALED      OVERFLOWED
    before_backward        READY       READY       SCALED      OVERFLOWED
    after_backward(delay)  raises      SCALED      SCALED      SCALED
    after_backward         raises      READY       back        OVERFLOWED
    skip_next_step         OVERFLOWED  OVERFLOWED  SCALED      OVERFLOWED
    step                   FRESH       READY       raises      READY
    settle_skip            FRESH       READY       SCALED      READY
    zero_grad              FRESH       READY       back        OVERFLOWED

after_backward(delay) is `delay_unscale=True`, or a handle whose unscale waits
(`unscale_waits`); skip_next_step in SCALED makes "back" OVERFLOWED; step and settle_skip
in OVERFLOWED skip the step (params and optimizer state untouched). The first
before_backward makes the masters agree across ranks; step() in SCALED would apply scaled
gradients. Every call checks its row first (`expect_stage`): a driver calling out of order
gets an error at the call, not wrong gradients later.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..base.notices import warn
from ..errors import InternalError

if TYPE_CHECKING:
    from .handle import OptimizerHandle

__all__ = ["GradStage", "StageCall", "STAGE_MOVES", "expect_stage", "StepGuard", "HandleContext", "ON_ITS_OWN",
           "drop_attribute", "warn_skips"]


class GradStage(Enum):
    """Where an optimizer's gradients stand (the module docstring has the transitions)."""

    FRESH = "fresh"            # no scale_loss yet
    READY = "ready"            # grads (if any) unscaled: step() applies them
    SCALED = "scaled"          # a delay_unscale backward left scaled grads: step() raises
    OVERFLOWED = "overflowed"  # an unscale found inf/NaN: the next step() is skipped


class StageCall(Enum):
    """The handle's calls that move its stage (the value: the call as the table names it)."""

    BEFORE_BACKWARD = "before_backward"
    KEEP_SCALED = "after_backward(delay)"
    UNSCALE = "after_backward"
    SKIP_NEXT_STEP = "skip_next_step"
    STEP = "step"
    SETTLE_SKIP = "settle_skip"
    ZERO_GRAD = "zero_grad"


FRESH, READY, SCALED, OVERFLOWED = GradStage.FRESH, GradStage.READY, GradStage.SCALED, GradStage.OVERFLOWED
BACK = None  # a move's target: the stage SCALED was entered from (READY or OVERFLOWED)

# call -> {stage it is allowed in: the stage it leaves}; a stage missing from a row: the call raises there
STAGE_MOVES: Mapping[StageCall, Mapping[GradStage, GradStage | None]] = {
    StageCall.BEFORE_BACKWARD: {FRESH: READY, READY: READY, SCALED: SCALED, OVERFLOWED: OVERFLOWED},
    StageCall.KEEP_SCALED: {READY: SCALED, SCALED: SCALED, OVERFLOWED: SCALED},
    StageCall.UNSCALE: {READY: READY, SCALED: BACK, OVERFLOWED: OVERFLOWED},
    StageCall.SKIP_NEXT_STEP: {FRESH: OVERFLOWED, READY: OVERFLOWED, SCALED: SCALED, OVERFLOWED: OVERFLOWED},
    StageCall.STEP: {FRESH: FRESH, READY: READY, OVERFLOWED: READY},
    StageCall.SETTLE_SKIP: {FRESH: FRESH, READY: READY, SCALED: SCALED, OVERFLOWED: READY},
    StageCall.ZERO_GRAD: {FRESH: FRESH, READY: READY, SCALED: BACK, OVERFLOWED: OVERFLOWED},
}


def expect_stage(call: StageCall, stage: GradStage) -> GradStage | None:
    """The stage `call` leaves a handle in `stage` in (BACK: the one SCALED was entered from),
    after checking that `stage` is one `call` is allowed in; else RuntimeError naming both (as
    FSDP2's `_assert_in_states`): a driver called the handle out of order, a bug in it, caught
    before anything changed. Two dict lookups: it runs at every step, zero_grad and scale_loss.

    Never traced: where a compiled function calls scale_loss and step() (mmengine's compiled
    train_step), Dynamo compiles the handle's frames, and it guards no enum read from an
    object's attribute that only keys a dict (torch 2.13): a traced look-up kept the stage it
    first saw (after one overflow, every later step was skipped). There the look-up is a
    graph break and runs eagerly; an eager call pays nothing for it."""
    if torch.compiler.is_compiling():
        return _expect_stage_eagerly(call, stage)
    return _expect_stage(call, stage)


def _expect_stage(call: StageCall, stage: GradStage) -> GradStage | None:
    try:
        return STAGE_MOVES[call][stage]
    except KeyError:
        allowed = ", ".join(s.name for s in STAGE_MOVES[call])
        raise InternalError(f"ampatch: internal error: OptimizerHandle.{call.value} called in stage {stage.name}; "
                            f"it is allowed only in {allowed}. Whatever drives this handle called it out of order "
                            "(before_backward comes before after_backward): please report it with the "
                            "traceback.") from None


# torch.compiler.disable, with Dynamo imported at the first call (never by `import ampatch`)
_expect_stage_eagerly = torch._disable_dynamo(_expect_stage)


class StepGuard(Protocol):
    """Checked at each step() (`session.param_guard.ParamGuard`: the model still holds what the optimizer steps)."""

    def check(self, handle: "OptimizerHandle") -> None: ...


def _never() -> bool:
    return False


@dataclass(frozen=True)
class HandleContext:
    """What an `OptimizerHandle` needs from whatever drives it (a `Session`, or a caller of
    its own); every field has a default that suits one optimizer on its own."""

    process_group: Any = None  # where the masters are made to agree across ranks (None: the world)
    on_step: Callable[["OptimizerHandle", bool], None] | None = None  # after each step(), with `skipped`
    # skipped steps pile up (SKIP_WARNING_AFTER in a row, then twice as many...): (handle, count);
    # None: a generic RuntimeWarning
    on_skips: Callable[["OptimizerHandle", int], None] | None = None
    scales_loss: Callable[[], bool] = _never  # a loss scale other than a static 1.0 is in use
    # the handle holding an FP32 master of a param, if any (add_param_group refuses a second one)
    master_owner: Callable[[torch.Tensor], "OptimizerHandle | None"] | None = None
    level: str = ""  # the opt level, for log lines
    # step(closure) is allowed with scaling: the closure's backward is scaled and unscaled by the
    # driver itself (Apex's FP16_Optimizer.backward), not by a scale_loss it would bypass
    scaled_closures: bool = False
    # attributes to hang on the optimizer while it is patched, made per handle (the public API
    # passes Apex's `_amp_stash` maker, so the core needs no import of compat); None: none
    attributes: Callable[["OptimizerHandle"], dict[str, Any]] | None = None


ON_ITS_OWN = HandleContext()  # the default context: one optimizer on its own, no driver


def drop_attribute(owner: Any, name: str, value: Any) -> None:
    """Remove an attribute `HandleContext.attributes` hung on `owner`, unless someone replaced it since."""
    if vars(owner).get(name) is value:
        delattr(owner, name)


def warn_skips(handle: OptimizerHandle, count: int) -> None:
    """`HandleContext.on_skips`' default: a warning at the user's line."""
    warn(f"ampatch: {count} optimizer steps in a row were skipped because the gradients were not finite.",
         1, RuntimeWarning)
