"""`base.patcher.tolerate`: a replacement of a patched attribute that a registered predicate
expects (torch's LR-scheduler wrapper, registered by `frameworks.scheduler_guard`) is
restored without the warning that any other replacement gets."""
from __future__ import annotations

import logging

import pytest

import ampatch  # noqa: F401 - registers the frameworks' predicates
from ampatch.base.patcher import Patcher
from ampatch.frameworks.scheduler_guard import wrapped_by_scheduler


class Owner:
    def step(self) -> str:
        return "own"


def _replaced_then_restored(replacement: object, caplog: pytest.LogCaptureFixture) -> list[str]:
    owner = Owner()
    patcher = Patcher()
    patcher.patch(owner, "step", lambda: "patched")
    owner.step = replacement  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="ampatch"):
        patcher.restore_all()
    assert "step" not in vars(owner) and owner.step() == "own"
    return [r.getMessage() for r in caplog.records]


def test_a_foreign_replacement_is_restored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    messages = _replaced_then_restored(lambda: "someone else", caplog)
    assert any("replaced by someone else" in m for m in messages)


def test_an_lr_scheduler_wrapper_is_expected(caplog: pytest.LogCaptureFixture) -> None:
    def wrapper() -> str:
        return "scheduler"
    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # what torch's LRScheduler marks
    assert wrapped_by_scheduler(wrapper) and not wrapped_by_scheduler(Owner().step)
    assert _replaced_then_restored(wrapper, caplog) == []
