"""The README and docs/benchmarks.md agree with the code: every environment variable ampatch
reads is in the README's table and every one in the table exists; the command-line synopsis
lists exactly the options each subcommand takes; every repository path and link they name
exists."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ampatch import env
from ampatch.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


def _section(text: str, title: str) -> str:
    start = text.index(f"### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start:end if end > 0 else None]


def test_every_environment_variable_is_documented_and_every_documented_one_exists() -> None:
    defined = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str) and v.startswith(env.PREFIX)
               and v != env.PREFIX}
    table = set(re.findall(r"^\| `(AMPATCH_[A-Z0-9_]+)=", _section(README, "Environment variables"), re.M))
    assert defined == table
    scripts = set(re.findall(r"\bAMPATCH_[A-Z][A-Z0-9_]*\b", " ".join(p.read_text() for p in (ROOT / "scripts").glob("*.sh"))))
    assert set(re.findall(r"\bAMPATCH_[A-Z][A-Z0-9_]*\b", README)) <= defined | scripts


def _parser_options() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
            for name, p in sub.choices.items()}


def test_the_command_line_synopsis_lists_exactly_each_subcommands_options() -> None:
    block = _section(README, "The command line")
    synopsis = block[block.index("```") + 3:block.index("```", block.index("```") + 3)]
    listed: dict[str, set[str]] = {}
    for part in re.split(r"^ampatch (?=\w)", synopsis, flags=re.M)[1:]:
        name, rest = part.split(None, 1)
        listed[name] = set(re.findall(r"\[(--[a-z0-9-]+)", rest)) | set(re.findall(r"^\s*(--[a-z0-9-]+)", rest, re.M))
    assert listed == _parser_options()


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_path_and_link_named_exists(doc: str) -> None:
    text, base = DOCS[doc], (ROOT / doc).parent
    links = [base / target for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)]
    paths = [ROOT / p for p in re.findall(r"\b((?:scripts|examples|docs|tests)/[\w./-]*\w)", text)
             if not p.startswith("tests/L0/")]  # Apex's own test folders, named as Apex's
    missing = sorted({str(p.relative_to(ROOT)) for p in links + paths if not p.exists()})
    assert not missing, f"{doc} names paths that do not exist: {missing}"
