"""The undo registry (`base.patcher.Patcher`) on its own: each patch undone exactly, a second
patch of one attribute refused, a foreign replacement warned about and undone anyway, names
an owner inherits deleted rather than set, restore callbacks run newest first, and the
per-thread cast switch."""
from __future__ import annotations

import logging
import threading
import types

import pytest

from ampatch.base.patcher import Patcher, cast_switch, disable_casts


class Base:
    def inherited(self) -> str:
        return "base"


class Owner(Base):
    own = "own"


def test_restore_puts_an_owned_attribute_back_as_the_same_object():
    original = Owner.__dict__["own"]
    p = Patcher()
    p.patch(Owner, "own", "patched")
    assert Owner.own == "patched" and len(p) == 1
    p.restore_all()
    assert Owner.__dict__["own"] is original and len(p) == 0


def test_an_inherited_name_is_deleted_on_restore_not_set():
    p = Patcher()
    p.patch(Owner, "inherited", lambda self: "patched")
    assert Owner().inherited() == "patched" and "inherited" in vars(Owner)
    p.restore_all()
    assert "inherited" not in vars(Owner) and Owner().inherited() == "base"


def test_a_module_attribute_round_trips():
    mod = types.ModuleType("m")
    mod.f = len
    p = Patcher()
    p.patch(mod, "f", abs)
    p.restore_all()
    assert mod.f is len


def test_a_second_patch_of_the_same_attribute_is_refused():
    p = Patcher()
    p.patch(Owner, "own", 1)
    with pytest.raises(RuntimeError, match="already patched"):
        p.patch(Owner, "own", 2)
    assert Owner.own == 1
    p.restore_all()
    assert Owner.own == "own"


def test_a_foreign_replacement_is_warned_about_and_the_original_restored(caplog):
    p = Patcher()
    p.patch(Owner, "own", "ours")
    Owner.own = "someone else's"
    with caplog.at_level(logging.WARNING, logger="ampatch"):
        p.restore_all()
    assert "replaced by someone else" in caplog.text
    assert Owner.own == "own"


def test_restore_runs_newest_first_and_the_callbacks_after_the_attributes():
    order = []
    p = Patcher()
    p.patch(Owner, "own", "a")
    p.patch(Base, "inherited", "b")
    p.on_restore(lambda: order.append(("first callback", Owner.own)))
    p.on_restore(lambda: order.append(("second callback", Owner.own)))
    p.restore_all()
    assert order == [("second callback", "own"), ("first callback", "own")]
    assert Base.inherited is not None and "inherited" in vars(Base)


def test_patched_lists_the_live_patches_oldest_first_and_containment():
    p = Patcher()
    p.patch(Owner, "own", 1)
    p.patch(Owner, "inherited", 2)
    assert [(name, new) for _, name, _, new in p.patched()] == [("own", 1), ("inherited", 2)]
    assert (Owner, "own") in p and (Base, "own") not in p
    p.restore_all()
    assert p.patched() == []


def test_disable_casts_is_per_thread_and_nests():
    seen = []
    assert cast_switch.enabled
    with disable_casts():
        with disable_casts():
            assert not cast_switch.enabled
        assert not cast_switch.enabled
        t = threading.Thread(target=lambda: seen.append(cast_switch.enabled))
        t.start()
        t.join()
    assert cast_switch.enabled and seen == [True]
