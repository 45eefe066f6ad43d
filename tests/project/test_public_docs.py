"""The public surface's docs and types agree with its code, so that they cannot drift apart.

- every parameter of `amp.initialize` is in its docstring's Args section (with its default)
  and in docs/reference.md's table of keywords (with the same default);
- every public function of `ampatch.__all__` has a structured docstring: Args naming each of
  its parameters (where it takes any), Returns (where it returns something), an Example;
- `ampatch.types.InitializeKeywords` (what the overloads of `initialize` take) has the same
  keywords as `initialize`, and the literal types accept what the parsers accept;
- the framework plugins' public classes document their arguments;
- the package ships a `py.typed` marker.
"""
from __future__ import annotations

import importlib.util
import inspect
import re
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ampatch as amp
from ampatch import types
from ampatch.config import levels, values

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference.md"
SECTIONS = ("Args:", "Returns:", "Raises:", "Example::", "Example:")


def section(doc: str, title: str) -> str | None:
    """The body of `title` ("Args:") in a cleaned docstring, None when it has none."""
    lines = doc.splitlines()
    if title not in [line.strip() for line in lines if not line.startswith(" ")]:
        return None
    start = next(i for i, line in enumerate(lines) if line.strip() == title and not line.startswith(" "))
    body = []
    for line in lines[start + 1:]:
        if line.strip() in SECTIONS and not line.startswith(" "):
            break
        body.append(line)
    return "\n".join(body)


def documented_args(doc: str) -> dict[str, str]:
    """Args' entries: `name` -> its text (continuation lines included)."""
    body = section(doc, "Args:") or ""
    out: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        m = re.match(r"^    (\w+)(?: \([^)]*\))?: (.*)$", line)
        if m:
            name = m.group(1)
            out[name] = m.group(2)
        elif name and line.startswith("        "):
            out[name] += " " + line.strip()
    return out


def problems(fn: Callable[..., object], name: str) -> list[str]:
    """What is missing from `fn`'s docstring (empty: nothing)."""
    doc = inspect.getdoc(fn)
    if not doc:
        return [f"{name}: no docstring"]
    found = []
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    args = documented_args(doc)
    if params and section(doc, "Args:") is None:
        found.append(f"{name}: no Args section")
    found += [f"{name}: Args lacks {p.name!r}" for p in params if p.name not in args]
    found += [f"{name}: Args names {a!r}, which it does not take" for a in args if a not in signature.parameters]
    if signature.return_annotation not in ("None", None, inspect.Signature.empty) and section(doc, "Returns:") is None:
        found.append(f"{name}: no Returns section")
    if section(doc, "Example::") is None and section(doc, "Example:") is None:
        found.append(f"{name}: no Example")
    return found


def public_functions() -> dict[str, Callable[..., object]]:
    return {n: getattr(amp, n) for n in amp.__all__ if not n.startswith("_") and inspect.isfunction(getattr(amp, n))}


def reference_keywords() -> dict[str, str]:
    """docs/reference.md's table of `initialize`'s keywords: name -> default, as written."""
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", REFERENCE.read_text(), flags=re.M)
    return dict(rows)


# ------------------------------------------------------------------ initialize
def test_every_parameter_of_initialize_is_in_its_args_with_its_default() -> None:
    args = documented_args(inspect.getdoc(amp.initialize) or "")
    missing = []
    for p in inspect.signature(amp.initialize).parameters.values():
        if p.name not in args:
            missing.append(f"{p.name}: not in Args")
        elif p.default is not p.empty and "Default:" not in args[p.name]:
            missing.append(f"{p.name}: Args does not say its default")
    assert not missing, "initialize's docstring drifted from its signature:\n" + "\n".join(missing)


def test_every_parameter_of_initialize_is_in_the_reference_with_the_same_default() -> None:
    table = reference_keywords()
    wrong = []
    for p in inspect.signature(amp.initialize).parameters.values():
        if p.name not in table:
            wrong.append(f"{p.name}: no row in docs/reference.md's keyword table")
        elif p.default is not p.empty and table[p.name] != _written(p.default):
            wrong.append(f"{p.name}: docs/reference.md says {table[p.name]!r}, the code {_written(p.default)!r}")
    extra = sorted(set(table) - set(inspect.signature(amp.initialize).parameters))
    wrong += [f"{name}: in docs/reference.md's table, not a parameter" for name in extra]
    assert not wrong, "\n".join(wrong)


def _written(default: object) -> str:
    """A default as the reference writes it: `2.0 ** 24` for the max loss scale, a string in
    double quotes, else repr."""
    if isinstance(default, float) and default == 2.0 ** 24:
        return "2.0 ** 24"
    return f'"{default}"' if isinstance(default, str) else repr(default)


def test_help_shows_every_parameter_in_the_signature_and_in_args() -> None:
    text = inspect.getdoc(amp.initialize) or ""
    signature = str(inspect.signature(amp.initialize))
    for p in inspect.signature(amp.initialize).parameters.values():
        assert f"{p.name}:" in signature and f"    {p.name}:" in text


def test_the_overloads_take_the_keywords_initialize_takes() -> None:
    params = [n for n in inspect.signature(amp.initialize).parameters if n not in ("models", "optimizers")]
    assert list(types.InitializeKeywords.__annotations__) == params
    hints = typing.get_type_hints(amp.initialize.__wrapped__, globalns=vars(amp), localns=_checking_names())
    keywords = typing.get_type_hints(types.InitializeKeywords, globalns=vars(types), localns=_checking_names())
    assert {n: hints[n] for n in params} == keywords


def _checking_names() -> dict[str, object]:
    """The names `if TYPE_CHECKING:` imports, for `get_type_hints`."""
    names: dict[str, object] = {"ProcessGroup": getattr(torch.distributed, "ProcessGroup", object)}
    if importlib.util.find_spec("torchao") is not None:
        from torchao.float8 import Float8LinearConfig
        names["Float8LinearConfig"] = Float8LinearConfig
    else:
        names["Float8LinearConfig"] = object
    return names


# ------------------------------------------------------------------ every public function
def test_every_public_function_has_a_structured_docstring() -> None:
    found = [p for name, fn in public_functions().items() for p in problems(fn, f"amp.{name}")]
    assert not found, "\n".join(found)


def test_the_checks_can_fail() -> None:
    """A docstring that lacks a parameter, Returns or an Example is caught (a check that
    cannot fail proves nothing)."""
    def sample(a: int, b: int = 0) -> int:
        """Add.

        Args:
            a: one.

        Example::

            >>> sample(1)
        """
        return a + b

    assert problems(sample, "sample") == ["sample: Args lacks 'b'", "sample: no Returns section"]
    doc = "Args:\n    only: one line.\n\nExample::\n\n    >>> x"
    assert documented_args(doc) == {"only": "one line."}


# ------------------------------------------------------------------ the types against the parsers
def _literals(alias: object) -> set[object]:
    out: set[object] = set()
    for arg in typing.get_args(alias):
        if typing.get_origin(arg) is typing.Literal:
            out |= set(typing.get_args(arg))
        elif arg is not type(None):
            out |= _literals(arg)
    if typing.get_origin(alias) is typing.Literal:
        out |= set(typing.get_args(alias))
    return out


def test_the_literal_types_are_what_the_parsers_accept() -> None:
    assert list(typing.get_args(types.OptLevel)) == list(levels.LEVELS)
    for level in typing.get_args(types.OptLevel):
        assert levels.normalize(level) == level
    assert _literals(types.OptimizerStates) == set(values.STATE_PRECISIONS)
    for name in _literals(types.OptimizerStates):
        values.parse_optimizer_states(name)
    assert set(typing.get_args(types.FP8Recipe)) == set(values.FP8_RECIPES)
    for value in _literals(types.MasterWeights):
        values.parse_master_weights(value)
    assert {v for v in _literals(types.MasterWeights) if v not in ("True", "False")} == set(values.LOW_MEMORY_MODES)
    for value in _literals(types.Flag):
        values.parse_bool(value, "flag")


# ------------------------------------------------------------------ plugins
@pytest.mark.parametrize("where, names", [
    ("ampatch.lightning", ("AmpatchPrecision", "AmpatchFabricPrecision")),
    ("ampatch.huggingface", ("AmpatchTrainer", "AmpatchTrainerMixin")),
])
def test_the_plugins_document_their_arguments(where: str, names: tuple[str, ...]) -> None:
    module = pytest.importorskip(where)
    for name in names:
        cls = getattr(module, name)
        doc = inspect.getdoc(cls) or ""
        args = documented_args(doc)
        own = [p for p in ("opt_level", "policy") if p in inspect.signature(cls.__init__).parameters]
        assert own and all(p in args for p in own), f"{name}: Args lacks {own}"
        assert section(doc, "Example::") is not None, f"{name}: no Example"


# ------------------------------------------------------------------ packaging
def test_the_package_ships_a_py_typed_marker() -> None:
    assert (ROOT / "ampatch" / "py.typed").is_file()
    assert re.search(r'^ampatch = \[[^\]]*"py\.typed"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
