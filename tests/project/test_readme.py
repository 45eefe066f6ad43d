"""The README and the docs/ pages agree with the code: every environment variable ampatch
reads is in docs/reference.md's table and every one in the table exists; the command-line
synopsis there lists exactly the options each subcommand takes; every repository path and
link they name exists; the README links every docs page, and every page's internal anchors
exist."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ampatch.cli import build_parser
from ampatch.config import env

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
PAGES = ["docs/recipes.md", "docs/apex.md", "docs/reference.md", "docs/benchmarks.md"]
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text()
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
README_MAX_LINES = 350  # a README for a reader in a hurry; the rest is in docs/


def _section(text: str, title: str) -> str:
    """The text under the heading `title` (any level), up to the next heading of the same or a
    higher level."""
    m = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert m, f"no heading {title!r}"
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", text[m.end():], re.M)
    return text[m.start():m.end() + end.start() if end else None]


def test_every_environment_variable_is_documented_and_every_documented_one_exists() -> None:
    defined = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str) and v.startswith(env.PREFIX)
               and v != env.PREFIX}
    table = set(re.findall(r"^\| `(AMPATCH_[A-Z0-9_]+)=", _section(REFERENCE, "Environment variables"), re.M))
    assert defined == table
    shell = " ".join(p.read_text() for p in (ROOT / "scripts").glob("*.sh"))
    scripts = set(re.findall(r"\bAMPATCH_[A-Z][A-Z0-9_]*\b", shell))
    for doc, text in DOCS.items():
        named = set(re.findall(r"\bAMPATCH_[A-Z][A-Z0-9_]*\b", text))
        assert named <= defined | scripts, f"{doc} names variables that do not exist: {named - defined - scripts}"


def _parser_options() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
            for name, p in sub.choices.items()}


def test_the_command_line_synopsis_lists_exactly_each_subcommands_options() -> None:
    block = _section(REFERENCE, "The command line")
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


def test_the_readme_is_short_and_links_every_docs_page() -> None:
    assert len(README.splitlines()) <= README_MAX_LINES
    linked = set(re.findall(r"\]\((docs/[\w./-]+\.md)(?:#[^)]*)?\)", README))
    assert set(PAGES) <= linked, f"README does not link {sorted(set(PAGES) - linked)}"
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert on_disk <= linked, f"docs pages the README does not link: {sorted(on_disk - linked)}"


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # a `# comment` in a code block is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_anchor_linked_exists(doc: str) -> None:
    text, base = DOCS[doc], (ROOT / doc).parent
    missing = []
    for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", text):
        page = (base / target).resolve() if target else ROOT / doc
        if page.suffix == ".md" and page.exists() and anchor not in _anchors(page.read_text()):
            missing.append(f"{target}#{anchor}")
    assert not missing, f"{doc} links anchors that do not exist: {missing}"
