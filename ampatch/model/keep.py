"""`keep_fp32`: which modules run in FP32 whatever the opt level. This module only decides
which; `forwards.keep_in_fp32` wraps them and `model.modules_to_cast` leaves them FP32.

A specification is a module name as `model.named_modules()` gives it (with several models,
a name may carry the model's index: "1.head"; a string may hold several names, "a,b"), a
module class, a callable `(name, module) -> bool`, or a list of these; the names in
`AMPATCH_KEEP_FP32=a,b` are added from outside. The result is the outermost matching
modules: a module inside a kept one runs in FP32 with it.
"""
from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import env
from ..config.values import parse_names
from ..errors import ConfigError, ConfigTypeError

logger = logging.getLogger("ampatch")

__all__ = ["Kept", "labelled", "matching", "select", "outermost", "kept_module_ids", "with_tied"]


@dataclass(frozen=True)
class Kept:
    """One module kept in FP32: its model's index, its name within that model, its label
    (the name with the model's index in front when there are several models: "1.head";
    what `report()` lists and what `keep_fp32` accepts back), and the module."""

    model: int
    name: str
    label: str
    module: nn.Module


def _items(spec: Any) -> list[Any]:
    """The specification as a list of names, classes and callables."""
    if spec is None:
        return []
    if isinstance(spec, str):
        return parse_names(spec)
    if isinstance(spec, (list, tuple, set, frozenset)):
        return list(spec)
    if isinstance(spec, type) or (callable(spec) and not isinstance(spec, nn.Module)):
        return [spec]
    raise ConfigTypeError(f"keep_fp32 takes module names, nn.Module classes or callables (name, module) -> bool, or a "
                          f"list of them; got {type(spec).__name__}.")


def labelled(models: Sequence[nn.Module]) -> list[Kept]:
    """Every module of every model, in `named_modules()` order, as it would be kept: labelled
    as `keep_fp32` names it (the one rule for those names; `ampatch diagnose` uses it too)."""
    out = []
    for i, model in enumerate(models):
        for name, m in model.named_modules():
            label = (f"{i}.{name}" if name else str(i)) if len(models) > 1 else name
            out.append(Kept(i, name, label, m))
    return out


def _unknown(name: str, labels: list[str], source: str) -> ValueError:
    named = [label for label in labels if label]
    close = difflib.get_close_matches(name, named, n=5, cutoff=0.5)
    hint = f" Close names: {', '.join(repr(c) for c in close)}." if close else ""
    some = ", ".join(repr(n) for n in named[:8])
    return ConfigError(f"{source}: no module is named {name!r}.{hint} Names are those of model.named_modules() "
                      f"(here: {some}{', ...' if len(named) > 8 else ''}); with several models, put the model's "
                      "index in front ('1.head').")


def _by_name(item: str, entries: list[Kept], several: bool, source: str) -> list[Kept]:
    """The module a name selects: its label ("1.head"), or with several models an
    unprefixed name found in exactly one of them."""
    by_label = [e for e in entries if e.label == item]
    if not several:
        if not by_label:
            raise _unknown(item, [e.label for e in entries], source)
        return by_label
    by_name = [e for e in entries if e.name == item and all(e.module is not b.module for b in by_label)]
    if by_label and by_name:
        raise ConfigError(f"{source}: {item!r} is ambiguous: it is the label of one module and the name of "
                          f"another in model {by_name[0].model}; write {by_name[0].label!r} for that one.")
    if len({e.model for e in by_name}) > 1:
        raise ConfigError(f"{source}: {item!r} names a module in several models; put the model's index in front "
                          f"({', '.join(repr(e.label) for e in by_name)}).")
    hits = by_label or by_name
    if not hits:
        raise _unknown(item, [e.label for e in entries], source)
    return hits


def _call(fn: Callable[[str, nn.Module], Any], name: str, module: nn.Module) -> bool:
    result = fn(name, module)
    if not isinstance(result, bool):
        raise ConfigTypeError(f"a keep_fp32 callable must return True or False, got {result!r} for {name!r}.")
    return result


def matching(models: Sequence[nn.Module], spec: Any, forced: Sequence[str] = (),
            source_of: Callable[[str], str] = lambda name: env.KEEP_FP32) -> list[Kept]:
    """The outermost modules of `models` that `spec` and the `forced` names (from outside:
    AMPATCH_KEEP_FP32, a policy file; `source_of(name)` says which, for messages) select, in
    `named_modules()` order. A name that matches no module raises ValueError listing close
    names and where it came from; a class or callable that matches none is logged. A
    callable gets each module's name within its model."""
    sources = [(x, "keep_fp32") for x in _items(spec)] + [(n, source_of(n)) for n in forced]
    if not sources:
        return []
    entries = labelled(models)
    several = len(models) > 1
    chosen: dict[int, Kept] = {}
    for item, source in sources:
        if isinstance(item, str):
            hits = _by_name(item, entries, several, source)
        elif isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise ConfigTypeError(f"keep_fp32: {item.__name__} is not an nn.Module class.")
            hits = [e for e in entries if isinstance(e.module, item)]
        elif callable(item) and not isinstance(item, nn.Module):
            hits = [e for e in entries if _call(item, e.name, e.module)]
        else:
            raise ConfigTypeError(f"keep_fp32 items are module names, nn.Module classes or callables (name, module) -> "
                                  f"bool; got {type(item).__name__} {item!r}.")
        if not hits:
            logger.warning("ampatch: keep_fp32: %s matches no module.", getattr(item, "__name__", repr(item)))
        for e in hits:
            chosen.setdefault(id(e.module), e)
    return outermost([e for e in entries if chosen.get(id(e.module)) is e])


def outermost(kept: Sequence[Kept]) -> list[Kept]:
    """`kept` without the modules that are inside another kept one (order kept)."""
    inside = {id(c) for k in kept for c in k.module.modules() if c is not k.module}
    return [k for k in kept if id(k.module) not in inside]


def kept_module_ids(kept: Sequence[Kept]) -> frozenset[int]:
    """Ids of the kept modules and everything inside them: what stays FP32."""
    return frozenset(id(m) for k in kept for m in k.module.modules())


def with_tied(models: Sequence[nn.Module], kept: Sequence[Kept]) -> tuple[list[Kept], list[Kept]]:
    """`kept` plus the modules outside it that hold a parameter of a kept module as their
    own (a tied embedding and output layer), in `named_modules()` order; and those added.
    A parameter is FP32 or half everywhere it is used, so where the model is cast to half
    they must be kept too."""
    entries = labelled(models)
    inside = kept_module_ids(kept)
    params = {id(p) for k in kept for p in k.module.parameters()}
    by_module = {id(k.module): k for k in kept}
    added = []
    for e in entries:
        if id(e.module) not in inside and id(e.module) not in by_module \
                and any(id(p) in params for p in e.module.parameters(recurse=False)):
            by_module[id(e.module)] = e
            added.append(by_module[id(e.module)])
    first: dict[int, int] = {}
    for i, e in enumerate(entries):
        first.setdefault(id(e.module), i)
    return outermost(sorted(by_module.values(), key=lambda k: first[id(k.module)])), added


def select(models: Sequence[nn.Module], spec: Any, forced: Sequence[str], casts_model: bool,
           warn: Callable[[str], None], source_of: Callable[[str], str] = lambda name: env.KEEP_FP32) -> list[Kept]:
    """What a session keeps in FP32: `matching(models, spec, forced, source_of)`, and where the
    models are cast to half (`casts_model`), the modules tied to those (`with_tied`, said
    through `warn`). `forced` (from outside: `source_of` names where) is logged, and ignored
    without models (amp.init())."""
    by_source: dict[str, list[str]] = {}
    for n in forced:
        by_source.setdefault(source_of(n), []).append(n)
    where = "; ".join(f"{src}={','.join(names)}" if src == env.KEEP_FP32 else f"{src}: {','.join(names)}"
                      for src, names in by_source.items())
    if forced and not models:
        logger.warning("ampatch: %s sets keep_fp32, but this session has no models (amp.init()): nothing kept in "
                       "FP32.", where)
        forced = ()
    kept = matching(models, spec, forced, source_of)
    if forced:
        logger.warning("ampatch: %s: these modules run in FP32 too (added to the script's keep_fp32).", where)
    if casts_model:
        kept, tied = with_tied(models, kept)
        if tied:
            warn(f"ampatch: keep_fp32 keeps {', '.join(repr(k.label) for k in tied)} in FP32 too: it holds a "
                 "parameter of a kept module (tied weights), and a parameter is FP32 or half everywhere it is "
                 "used. Add it to keep_fp32 to silence this, or untie the weights.")
    if kept:
        logger.info("ampatch: keep_fp32: %s run in FP32.", ", ".join(repr(k.label) for k in kept))
    return kept
