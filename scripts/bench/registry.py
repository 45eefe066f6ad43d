"""The sections `--only` chooses from, in the order they run, with their targets; which run
by default on each device; the report's blocks in print order."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .harness import Env, Log
from .sections import compiled, gpu, memory, micro, o1, training
from .targets import Target, TargetBlock


@dataclass(frozen=True)
class Section:
    """One section: how it runs and how its results become flat ratio keys."""

    name: str
    run: Callable[[Env, bool, Log], dict[str, Any]]      # (env, quick, log) -> its results
    ratios: Callable[[dict[str, Any]], dict[str, float]]  # its results -> {"name.key": ratio}
    settings: Callable[[bool], dict[str, int]]           # rounds and sizes (quick?), for the JSON
    targets: dict[str, Target] = field(default_factory=dict)


def _training(name: str) -> Section:
    return Section(name, functools.partial(training.run, name), functools.partial(training.ratios, name),
                   functools.partial(training.settings, name),
                   {k: t for k, t in training.TARGETS.items() if k.startswith(name + ".")})


SECTIONS: dict[str, Section] = {s.name: s for s in (
    *(_training(n) for n in training.NAMES),
    Section("micro", micro.run, micro.ratios, micro.settings, micro.TARGETS),
    Section("o1", o1.run, o1.ratios, o1.settings, o1.TARGETS.targets),
    Section("memory", memory.run, memory.ratios, memory.settings, memory.TARGETS),
    Section("compiled", compiled.run, compiled.ratios, compiled.settings, compiled.TARGETS.targets),
    Section("gpu", gpu.run, gpu.ratios, gpu.settings, gpu.TARGETS.targets),
)}
GROUPS = {"train": training.NAMES}  # names --only accepts for several sections
DEFAULTS = {"cpu": ("transformer", "mlp", "cnn", "micro", "o1", "memory", "compiled"), "cuda": ("gpu", "micro")}

# Issue 8's targets, listed together after the sections' blocks.
ISSUE_8 = TargetBlock("targets (issue 8)", {**training.TARGETS, **micro.TARGETS, **memory.TARGETS})


def select(only: str, device_type: str) -> list[str]:
    """The sections to run, in SECTIONS order: those `only` names (comma-separated, groups
    allowed), or the device's defaults when it names none. ValueError for an unknown name."""
    wanted: set[str] = set()
    for s in filter(None, (t.strip() for t in only.split(","))):
        if s in GROUPS:
            wanted |= set(GROUPS[s])
        elif s in SECTIONS:
            wanted.add(s)
        else:
            raise ValueError(f"unknown section {s!r} (choose from {', '.join(SECTIONS)}, {', '.join(GROUPS)})")
    chosen = wanted or set(DEFAULTS["cuda" if device_type == "cuda" else "cpu"])
    return [s for s in SECTIONS if s in chosen]


def flat_ratios(results: dict[str, Any]) -> dict[str, float]:
    """Every ratio of the sections that ran, keyed "section.key"."""
    flat: dict[str, float] = {}
    for name, result in results.items():
        flat.update(SECTIONS[name].ratios(result))
    return flat


def target_records(names: Sequence[str], flat: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The JSON form of every measured target of the sections `names`."""
    return {k: t.record(flat[k]) for n in names for k, t in SECTIONS[n].targets.items() if k in flat}


def render(results: dict[str, Any], flat: dict[str, float]) -> list[str]:
    """The report's lines after its header (a section that did not run gives none)."""
    lines = training.render(results) + micro.render(results) + o1.render(results) + memory.render(results)
    lines += gpu.render(results)
    lines += ISSUE_8.lines(flat)  # after the blocks of the sections they belong to, even when none ran
    return lines + compiled.render(results)  # its own block, with its own targets
