"""The optimizer handle's stage machine (`optim.context.STAGE_MOVES`), driven on a handle with
no session: every call in every stage does what the table says (the allowed moves, "back"
to the stage SCALED left, and the forbidden ones raising with nothing changed), and the
state table in `optim.context`'s module docstring is the code's table."""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ampatch.base.patcher import Patcher
from ampatch.optim import context
from ampatch.optim.context import BACK, STAGE_MOVES, GradStage, HandleContext, StageCall
from ampatch.optim.handle import OptimizerHandle

F32 = torch.float32
SCALE = 2.0 ** 10
BACKS = (GradStage.READY, GradStage.OVERFLOWED)  # where a SCALED handle can go back to


class Rig:
    """A half linear layer with FP32 masters, its SGD optimizer patched by a handle."""

    def __init__(self, waits: bool = False) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.handle = OptimizerHandle(self.opt, master_ids={id(p) for p in self.model.parameters()},
                                      context=HandleContext(scales_loss=lambda: True))
        if waits:  # a handle whose unscale waits (FSDP2 with gradient sync off), through its public hook
            self.handle.unscale_waits = lambda: True  # type: ignore[method-assign]
        self.model.half()
        self.patcher = Patcher()
        self.handle.install(self.patcher)
        self.x = torch.randn(3, 4).half()

    def backward(self) -> None:
        (self.model(self.x).float().sum() * SCALE).backward()

    def call(self, call: StageCall) -> None:
        """What each row of the table is: the call as a driver (or the user) makes it."""
        h = self.handle
        actions: dict[StageCall, Callable[[], object]] = {
            StageCall.BEFORE_BACKWARD: lambda: h.before_backward(SCALE),
            StageCall.KEEP_SCALED: lambda: h.after_backward(SCALE, None, delay_unscale=True),
            StageCall.UNSCALE: lambda: h.after_backward(SCALE, None, delay_unscale=False),
            StageCall.SKIP_NEXT_STEP: h.skip_next_step,
            StageCall.STEP: self.opt.step,
            StageCall.SETTLE_SKIP: h.settle_skip,
            StageCall.ZERO_GRAD: self.opt.zero_grad,
        }
        actions[call]()

    def scale_loss(self, delay: bool) -> None:
        self.call(StageCall.BEFORE_BACKWARD)
        self.backward()
        self.call(StageCall.KEEP_SCALED if delay else StageCall.UNSCALE)

    def to(self, stage: GradStage, back: GradStage = GradStage.READY) -> Rig:
        """Drive the handle into `stage` (SCALED: entered from `back`) with the calls a session makes."""
        if stage is not GradStage.FRESH:
            self.scale_loss(delay=False)
        if stage is GradStage.OVERFLOWED or (stage is GradStage.SCALED and back is GradStage.OVERFLOWED):
            self.call(StageCall.SKIP_NEXT_STEP)
        if stage is GradStage.SCALED:
            self.scale_loss(delay=True)
        assert self.handle.stage is stage
        return self


def _cases() -> list[tuple[StageCall, GradStage, GradStage]]:
    """Every (call, stage) pair, SCALED twice: entered from READY and from OVERFLOWED."""
    return [(call, stage, back) for call, stage in itertools.product(StageCall, GradStage)
            for back in (BACKS if stage is GradStage.SCALED else (GradStage.READY,))]


def _id(case: tuple[StageCall, GradStage, GradStage]) -> str:
    call, stage, back = case
    return f"{call.value}-{stage.name}" + (f"(from {back.name})" if stage is GradStage.SCALED else "")


CASES = _cases()


def test_the_table_covers_every_call_and_names_only_stages() -> None:
    assert set(STAGE_MOVES) == set(StageCall)
    for call, row in STAGE_MOVES.items():
        assert row, f"{call.value} is allowed nowhere"
        assert all(isinstance(s, GradStage) and (t is BACK or isinstance(t, GradStage)) for s, t in row.items())
        assert all(t is not BACK for s, t in row.items() if s is not GradStage.SCALED), "only SCALED goes back"


@pytest.mark.parametrize("case", [c for c in CASES if c[1] in STAGE_MOVES[c[0]]], ids=_id)
def test_an_allowed_call_leaves_the_stage_the_table_names(case: tuple[StageCall, GradStage, GradStage]) -> None:
    call, stage, back = case
    rig = Rig().to(stage, back)
    if call in (StageCall.KEEP_SCALED, StageCall.UNSCALE):
        rig.backward()  # what a scale_loss's backward writes
    rig.call(call)
    target = STAGE_MOVES[call][stage]
    expected = back if target is BACK else target
    assert rig.handle.stage is expected, f"{call.value} in {stage.name}: {rig.handle.stage.name}, not {expected}"


@pytest.mark.parametrize("case", [c for c in CASES if c[1] not in STAGE_MOVES[c[0]]], ids=_id)
def test_a_forbidden_call_raises_and_changes_nothing(case: tuple[StageCall, GradStage, GradStage]) -> None:
    call, stage, back = case
    rig = Rig().to(stage, back)
    masters = [m.detach().clone() for _, m in rig.handle.pairs()]
    steps = rig.handle.steps
    with pytest.raises(RuntimeError) as raised:
        rig.call(call)
    message = str(raised.value)
    if call is StageCall.STEP:  # the user's mistake: the message names the fix
        assert "delay_unscale=False" in message
    else:  # a driver's bug: the call, the stage and the allowed ones are named
        allowed = ", ".join(s.name for s in STAGE_MOVES[call])
        assert f"{call.value} called in stage {stage.name}" in message and allowed in message
    assert rig.handle.stage is stage and rig.handle.steps == steps
    assert all(torch.equal(a, m) for a, (_, m) in zip(masters, rig.handle.pairs()))


def test_back_is_the_stage_scaled_was_entered_from_and_a_skip_in_scaled_changes_it() -> None:
    rig = Rig().to(GradStage.SCALED, GradStage.READY)
    rig.call(StageCall.SKIP_NEXT_STEP)
    assert rig.handle.stage is GradStage.SCALED
    rig.backward()
    rig.call(StageCall.UNSCALE)
    assert rig.handle.stage is GradStage.OVERFLOWED
    rig.call(StageCall.STEP)  # skipped
    assert rig.handle.stage is GradStage.READY and rig.handle.steps == 1 and rig.handle.consecutive_skips == 1


def test_a_step_in_overflowed_is_skipped_and_one_in_ready_runs() -> None:
    rig = Rig().to(GradStage.OVERFLOWED)
    before = [m.detach().clone() for _, m in rig.handle.pairs()]
    rig.call(StageCall.STEP)
    assert all(torch.equal(a, m) for a, (_, m) in zip(before, rig.handle.pairs()))
    assert all(m.grad is None for _, m in rig.handle.pairs())
    rig.scale_loss(delay=False)
    rig.call(StageCall.STEP)
    assert not all(torch.equal(a, m) for a, (_, m) in zip(before, rig.handle.pairs()))
    assert (rig.handle.steps, rig.handle.consecutive_skips) == (2, 0)


def test_a_handle_whose_unscale_waits_keeps_its_grads_scaled() -> None:
    """after_backward(delay) in the table is also a plain after_backward while `unscale_waits()`."""
    rig = Rig(waits=True).to(GradStage.FRESH)
    rig.call(StageCall.BEFORE_BACKWARD)
    rig.backward()
    rig.call(StageCall.UNSCALE)
    assert rig.handle.stage is GradStage.SCALED


# ------------------------------------------------------------------ the docs are the code's table
def _documented() -> dict[StageCall, dict[GradStage, GradStage | None]]:
    """The state table of `optim.context`'s module docstring, read back: "raises" is a stage
    missing from the row, "back" is BACK."""
    lines = (context.__doc__ or "").splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["call"])
    stages = [GradStage[name] for name in lines[header].split()[1:]]
    table: dict[StageCall, dict[GradStage, GradStage | None]] = {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        call, *cells = line.split()
        assert len(cells) == len(stages), f"the docstring's row {line!r} has {len(cells)} cells"
        table[StageCall(call)] = {stage: (BACK if cell == "back" else GradStage[cell])
                                  for stage, cell in zip(stages, cells) if cell != "raises"}
    return table


def test_the_docstring_table_is_the_codes_table() -> None:
    documented = _documented()
    assert set(documented) == set(StageCall), "a call is missing from the docstring's table"
    for call in StageCall:
        assert documented[call] == dict(STAGE_MOVES[call]), f"the docstring's row {call.value} differs from the code"


def test_the_docstring_table_check_catches_a_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a docstring with one cell changed is told apart."""
    doc = context.__doc__ or ""
    row = re.search(r"^ *zero_grad +FRESH +READY +back +OVERFLOWED$", doc, re.M)
    assert row is not None
    monkeypatch.setattr(context, "__doc__", doc.replace(row.group(0), row.group(0).replace("back", "READY")))
    assert _documented()[StageCall.ZERO_GRAD] != dict(STAGE_MOVES[StageCall.ZERO_GRAD])
