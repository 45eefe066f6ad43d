"""Installing O1 (and O4, which is O1 in bfloat16: the wrappers cast to the session's half
dtype) in a session: find what to patch, build each wrapper, apply it (the three steps
wrapt's patching takes), then the parts that are not one wrapper per op: RNN modules,
`Tensor.data`, TorchScript and torch.compile.

`find` reads the cast lists (`o1.lists`: the built-in ones and the user's registrations)
against this torch; `build` makes one O1 function (`proxies.wrap`); `O1Patches` applies them through
the session's `Patcher`, which restores everything on `deinitialize`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..base.patcher import Patcher, resolve_owner
from ..machine import tips
from . import captured, dynamo, jit
from .cache import ParamCastCache, watch_data
from .plans import BANNED, CPU_FLOAT, FLOAT, HALF, PROMOTE, SEQUENCE_PROMOTE
from .proxies import wrap
from .rnn import patch_rnn_modules
from .wrappers import WrapContext

logger = logging.getLogger("ampatch")

# (list name in a policy module, the kind its ops get); BANNED is a dict with messages
LIST_KINDS = (("HALF", HALF), ("FLOAT", FLOAT), ("PROMOTE", PROMOTE), ("SEQUENCE_PROMOTE", SEQUENCE_PROMOTE),
              ("CPU_FLOAT", CPU_FLOAT))


@dataclass(frozen=True)
class Target:
    """One attribute to patch: `owner.name` gets the `kind` wrapper."""

    owner: Any
    name: str
    kind: str
    message: str = ""  # BANNED: names the safe alternative
    user: bool = False  # a registration: dtype errors get the registration hint


def find(registered: Iterable[tuple[Any, str, str]],
         namespaces: Iterable[tuple[str, ModuleType]]) -> list[Target]:
    """Every attribute the policy names that this torch has, each once: registrations
    first, so they win over the built-in lists (an attribute is patched once)."""
    found: list[Target] = []
    seen: set[tuple[int, str]] = set()

    def add(owner: Any, name: str, kind: str, message: str = "", user: bool = False) -> None:
        if not hasattr(owner, name):
            logger.debug("ampatch: %s has no %s on this torch; not patched", owner, name)
        elif (id(owner), name) not in seen:
            seen.add((id(owner), name))
            found.append(Target(owner, name, kind, message, user))

    for owner, name, kind in registered:
        add(owner, name, kind, user=True)
    for path, lists in namespaces:
        owner = resolve_owner(path)
        for attr, kind in LIST_KINDS:
            for name in getattr(lists, attr, ()):
                add(owner, name, kind)
        for name, message in getattr(lists, "BANNED", {}).items():
            add(owner, name, BANNED, message)
    return found


def build(target: Target, ctx: WrapContext) -> Callable:
    """The O1 function that replaces `target` (its current value wrapped)."""
    hint = tips.qualified_name(target.owner, target.name) if target.user else None
    return wrap(target.kind, target.name, getattr(target.owner, target.name), ctx, target.message, target.owner,
                hint)


class O1Patches:
    """A session's O1 patches: torch's ops, registrations made while it runs, and the
    wrappers of functions decorated with `amp.half_function` & co."""

    def __init__(self, patcher: Patcher, cache: ParamCastCache, ctx: WrapContext) -> None:
        self.patcher, self.cache, self.ctx = patcher, cache, ctx
        self._decorated: dict[tuple[str, Any], Callable] = {}
        self._originals: dict[int, tuple[Any, Any]] = {}  # id(O1 function) -> (it, the op it replaced)

    def _patch(self, target: Target) -> None:
        function = build(target, self.ctx)
        self._originals[id(function)] = (function, getattr(target.owner, target.name))
        self.patcher.patch(target.owner, target.name, function)

    def original_of(self, obj: Any) -> Any:
        """The op an O1 function of this session replaced; None for anything else (also
        after `deinitialize`)."""
        found = self._originals.get(id(obj))
        return found[1] if found is not None and found[0] is obj else None

    def install(self, registered: Iterable[tuple[Any, str, str]], namespaces: Iterable[tuple[str, ModuleType]],
                eager: Sequence[tuple[type, str]] = ()) -> None:
        """Patch every op the policy names, then RNN modules, `Tensor.data` (p.data changes
        drop p's casts), TorchScript (script without casts, trace with them) and
        torch.compile (it sees the casts of Tensor methods too; the methods in `eager` run
        outside its graphs, see `dynamo.install`; what the compiler binds from torch stays
        torch's own, see `captured`)."""
        for target in find(registered, namespaces):
            self._patch(target)
        patch_rnn_modules(self.patcher, self.ctx.cast_for, self.ctx.half_dtype)
        watch_data(self.cache, self.patcher)
        jit.install(self.patcher, self.cache)
        dynamo.install(self.patcher, eager, captured.keep_torch_ops(self.patcher, self.original_of))
        logger.debug("ampatch: patched %d torch attributes", len(self.patcher))

    def register(self, owner: Any, name: str, kind: str) -> None:
        """A registration made while the session patches torch: applied at once, unless the
        attribute is patched already (then from the next initialize)."""
        if (owner, name) in self.patcher:
            logger.info("ampatch: %s was patched already; the new registration applies from the next initialize.",
                        name)
            return
        for target in find([(owner, name, kind)], ()):
            self._patch(target)

    def decorated(self, kind: str, fn: Any) -> Callable:
        """The cast wrapper for a function decorated with `amp.half_function` & co., made once:
        an O1 function of `fn`, called like `fn` (torch.compile traces its twin)."""
        key = (kind, fn)
        wrapper = self._decorated.get(key)
        if wrapper is None:
            name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', 'function')}"
            wrapper = self._decorated[key] = wrap(kind, getattr(fn, "__name__", "function"), fn, self.ctx,
                                                  hint_name=name)
        return wrapper
