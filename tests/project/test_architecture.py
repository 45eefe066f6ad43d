"""The layout rules of the package, checked on its source (see docs/reference.md, "Layout").

- no module imports another module's underscore name (`from .o1 import _switch`, or
  `o1._switch` on an imported ampatch module): what a module shares is public; the same
  holds for `scripts/` (the benchmark and the tools use ampatch's public names);
- the module-level imports inside `ampatch/` form no cycle, and neither do all its imports,
  function-level ones included (a package importing its own modules counts too);
- the rooms are layers (`LAYERS`, bottom first): a room imports only rooms below it,
  function-level imports included, so no cycle runs through rooms either; rooms on one
  layer (`session` and `record`, ...) never import each other. `frameworks` registers what
  the core must know of other libraries (Apex's names, lent by `compat` on first use, loaded
  by name) and sits below the public API, which imports it;
- no file in `ampatch/` grows past the size where it should be split by job.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ampatch"
SCRIPTS = PACKAGE.parent / "scripts"
MAX_LINES = 420  # "~400 lines": split a file by job before it grows further
# The rooms, bottom first; a room imports only rooms on a lower line. "api" is ampatch/__init__.py;
# "types" (ampatch/types.py, the public type aliases) and "errors" (ampatch/errors.py, the error family
# every room raises) import nothing of ampatch.
LAYERS = (("types", "errors"), ("base",), ("machine",), ("config",), ("o1",), ("model",), ("optim",),
          ("session", "record"), ("frameworks",), ("api",), ("compat", "workloads"),
          ("lightning", "huggingface", "runs"), ("compare",), ("diagnose",), ("tune",), ("cli",))
RANK = {room: i for i, line in enumerate(LAYERS) for room in line}
# What a room may import above itself, inside a function, first used: nothing (the public
# API's Apex names are lent through `session.addons`, so the API never imports compat).
LAZY_UPWARD_ALLOWED: set[tuple[str, str]] = set()


def _modules(root: Path, base: Path) -> dict[str, Path]:
    """Module name -> file, for the .py files under `root`, named relative to `base`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules(PACKAGE, PACKAGE.parent)
# scripts/ runs with scripts/ on sys.path (`python scripts/bench` imports `bench.harness`)
SCRIPT_MODULES = _modules(SCRIPTS, SCRIPTS)


def _known() -> dict[str, Path]:
    return {**SCRIPT_MODULES, **MODULES}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name an ImportFrom in `module` names."""
    if node.level == 0:
        return node.module or ""
    is_package = _known()[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, top_level_only: bool) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in `module`."""
    known = _known()
    tree = ast.parse(known[module].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((sub, None, node.lineno) if sub in known else (target, a.name, node.lineno))
        elif top_level_only and isinstance(node, ast.If) and _is_type_checking(node.test):
            continue  # `if TYPE_CHECKING:` imports never run
        elif top_level_only and isinstance(node, (ast.If, ast.Try)):  # guarded imports still run at import
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    found += [(a.name, None, inner.lineno) for a in inner.names]
                elif isinstance(inner, ast.ImportFrom):
                    found += [(_resolve(module, inner), a.name, inner.lineno) for a in inner.names]
    return found


def _running_imports(module: str) -> list[str]:
    """The modules every import statement in `module` names, at module level or inside a
    function, where it can run (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(_known()[module].read_text())
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)  # `from pkg import mod` names mod; `from pkg import name`, pkg
            found.extend(f"{target}.{a.name}" if f"{target}.{a.name}" in _known() else target for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _is_ours(name: str) -> bool:
    return name == "ampatch" or name.startswith("ampatch.") or name in SCRIPT_MODULES


def test_no_module_imports_another_modules_underscore_names() -> None:
    bad = []
    for module, path in _known().items():
        for target, name, line in _imports(module, top_level_only=False):
            if _is_ours(target) and target != module and name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{path.name}:{line} imports {name} from {target}")
        # `patching._switch` where `patching` is an ampatch module this file imported
        tree = ast.parse(path.read_text())
        aliases = {}
        for target, name, _ in _imports(module, top_level_only=False):
            if _is_ours(target) and name is None:
                aliases[target.rsplit(".", 1)[-1]] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                # the package's own Apex-compatible name is public API (DESIGN: amp._amp_state)
                if not (aliases[node.value.id] == "ampatch" and node.attr == "_amp_state"):
                    bad.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _graph(function_level: bool = False) -> dict[str, set[str]]:
    """Module -> the ampatch modules it imports at module level (and, with `function_level`,
    inside its functions too)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        targets = (_running_imports(module) if function_level
                   else [t for t, _, _ in _imports(module, top_level_only=True)])
        for target in targets:
            while target and target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def test_module_level_imports_have_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            # a package's __init__ importing its own children is how packages work
            if n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_import_cycle_function_level_imports_included() -> None:
    """No chain of imports, module-level or inside functions, leads back to where it started:
    a lazy import only hides a cycle until the function runs (the public API lends Apex's
    names through `session.addons` instead of importing `compat`, which imports the API)."""
    cycle = _cycle(_graph(function_level=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _room(module: str) -> str:
    """"ampatch.optim.handle" -> "optim"; the package itself -> "api"; `__main__` is the command."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    return "cli" if parts[1] == "__main__" else parts[1]


def _room_imports(top_level_only: bool) -> list[tuple[str, str, str, int]]:
    """(importing module, its room, imported room, line) for every import between rooms."""
    found = []
    for m in MODULES:
        for target, _, line in _imports(m, top_level_only):
            if target == "ampatch" or target.startswith("ampatch."):
                mine, theirs = _room(m), _room(target)
                if mine != theirs:
                    found.append((m, mine, theirs, line))
    return found


def test_every_room_has_a_layer() -> None:
    rooms = {_room(m) for m in MODULES}
    assert rooms <= set(RANK), f"rooms without a layer in LAYERS: {sorted(rooms - set(RANK))}"


def test_rooms_import_only_rooms_below_them() -> None:
    """At import time and inside functions alike (LAZY_UPWARD_ALLOWED aside, lazily only)."""
    lazy = {(m, t, line) for m, _, t, line in _room_imports(True)}
    bad = []
    for m, mine, theirs, line in _room_imports(False):
        if RANK[theirs] < RANK[mine]:
            continue
        if (mine, theirs) in LAZY_UPWARD_ALLOWED and (m, theirs, line) not in lazy:
            continue
        where = "on one layer" if RANK[theirs] == RANK[mine] else "upward"
        bad.append(f"{m}:{line} ({mine}) imports {theirs}: {where}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_config_imports_nothing_above_base() -> None:
    """(base and the error family, below it)."""
    bad = [f"{m}:{line} imports {theirs}" for m, mine, theirs, line in _room_imports(False)
           if mine == "config" and RANK[theirs] > RANK["base"]]
    assert not bad, "\n".join(bad)


def test_no_file_in_the_package_is_past_the_split_size() -> None:
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"split these by job (over {MAX_LINES} lines): {big}"


def test_the_checks_above_can_fail(tmp_path: Path) -> None:
    """The parser sees the patterns it forbids (a check that cannot fail proves nothing)."""
    global MODULES
    saved = MODULES
    try:
        (tmp_path / "a.py").write_text("from .b import _hidden\nfrom . import b\nx = b._also\n")
        (tmp_path / "b.py").write_text("from . import a\n")
        (tmp_path / "__init__.py").write_text("")
        MODULES = {"ampatch": tmp_path / "__init__.py", "ampatch.a": tmp_path / "a.py",
                   "ampatch.b": tmp_path / "b.py"}
        with pytest.raises(AssertionError, match="_hidden"):
            test_no_module_imports_another_modules_underscore_names()
        with pytest.raises(pytest.fail.Exception, match="import cycle"):
            test_module_level_imports_have_no_cycle()
        (tmp_path / "b.py").write_text("def f():\n    from ampatch import a\n")
        (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
        test_no_import_cycle_function_level_imports_included()  # a TYPE_CHECKING import never runs
        (tmp_path / "a.py").write_text("def g():\n    import ampatch.b\n")
        with pytest.raises(AssertionError, match="import cycle: ampatch.a -> ampatch.b -> ampatch.a"):
            test_no_import_cycle_function_level_imports_included()
        (tmp_path / "low.py").write_text("def f():\n    from ampatch.cli import main\n")
        MODULES = {"ampatch.base.low": tmp_path / "low.py"}
        with pytest.raises(AssertionError, match="base.low:2 .base. imports cli: upward"):
            test_rooms_import_only_rooms_below_them()
    finally:
        MODULES = saved


def test_scripts_are_checked_too(tmp_path: Path) -> None:
    """A script importing an underscore name of ampatch, or of another script, is caught."""
    global SCRIPT_MODULES
    saved = SCRIPT_MODULES
    try:
        (tmp_path / "tool.py").write_text("from ampatch.optim.scaler import _private\nfrom helper import _x\n")
        (tmp_path / "helper.py").write_text("_x = 1\n")
        SCRIPT_MODULES = {"tool": tmp_path / "tool.py", "helper": tmp_path / "helper.py"}
        with pytest.raises(AssertionError, match="_private") as err:
            test_no_module_imports_another_modules_underscore_names()
        assert "_x from helper" in str(err.value)
    finally:
        SCRIPT_MODULES = saved


def test_ls_ampatch_shows_the_architecture() -> None:
    """A handful of modules at the top (the public API, __main__, one per framework); every
    other module lives in a subpackage named for its job (DESIGN.md, "Layout")."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    assert {"__init__.py", "__main__.py"} <= set(top)
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert {"base", "machine", "config", "o1", "model", "optim", "session", "record", "runs", "compare", "diagnose",
            "tune", "cli", "compat"} <= packages
    for name in packages:  # each says what its job is
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc, f"ampatch/{name}/__init__.py has no docstring saying what the package is for"


def test_import_and_initialize_load_neither_compat_nor_a_framework() -> None:
    """`import ampatch` and an initialize with an optimizer import no `ampatch.compat` and no
    framework; the optimizer still has Apex's `_amp_stash`, made by compat when first read."""
    code = textwrap.dedent("""
        import sys, torch
        import ampatch as amp
        m = torch.nn.Linear(4, 4); o = torch.optim.SGD(m.parameters(), lr=0.1)
        m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
        heavy = ("ampatch.compat", "lightning", "pytorch_lightning", "transformers", "accelerate")
        print(sorted(k for k in sys.modules if k.startswith(heavy)))
        print(len(o._amp_stash.all_fp32_from_fp16_params), o._amp_stash.lazy_init_called,
              "ampatch.compat" in sys.modules)
        o._lazy_init_maybe_master_weights()
        amp.deinitialize()
        print(hasattr(o, "_amp_stash"))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["[]", "2 True True", "False"]
