"""The `apex` import alias: `from apex import amp` loads ampatch, for scripts that cannot be
edited (`ampatch run --apex-alias` installs it from a `sitecustomize`).

The alias is a rule, not a table: `apex.amp` is ampatch itself, and every other `apex.X.Y`
of the packages in `PACKAGES` is the module `ampatch.compat.X.Y` (file
`ampatch/compat/X/Y.py`); Apex's compiled top-level `amp_C` and `apex_C` are
`ampatch.compat.extensions.amp_C` / `apex_C`. `install_apex_alias` registers all of them at
once (so that `apex.amp`'s submodules never become attributes of ampatch), and a finder
answers the rest: a name the rule does not reach fails with an `ImportError` that says
ampatch does not provide it and names the PyTorch replacement (`missing`), and
`importlib.util.find_spec` of such a name returns None (code that probes reads a raise as
"broken"). Nothing is installed when a real `apex` is importable: that one wins.

The alias looks installed to libraries that probe for Apex: `apex` has a module spec
(`importlib.util.find_spec("apex")`), and `importlib.metadata.version("apex")` answers
`APEX_VERSION`.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import pkgutil
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .missing import EXTENSIONS, NotProvidedError, not_provided_message

logger = logging.getLogger("ampatch")

__all__ = ["install_apex_alias", "uninstall_apex_alias", "apex_alias_installed", "target_of", "provided_modules",
           "PACKAGES", "EXTENSION_MODULES", "APEX_VERSION"]

_ALIAS_FLAG = "__ampatch_alias__"
_PROBE_FLAG = "__ampatch_probe__"
# What importlib.metadata.version("apex") answers under the alias: Apex's own version number
# (its setup.py said 0.1 to the end), marked as ampatch's stand-in.
APEX_VERSION = "0.1+ampatch"
# Apex's packages that ampatch.compat mirrors: apex.X.Y is ampatch.compat.X.Y ("testing" is
# what Apex's own tests import; "extensions" is where some Apex versions put amp_C/apex_C).
PACKAGES = ("amp", "optimizers", "fp16_utils", "parallel", "normalization", "multi_tensor_apply", "extensions",
            "testing")
# Apex's compiled top-level modules that ampatch stands in for (unless a real one is importable).
EXTENSION_MODULES = ("amp_C", "apex_C")


def target_of(fullname: str) -> str | None:
    """The ampatch module that stands in for Apex's `fullname` by the rule, or None when
    the rule does not reach it (whether that module exists is another question)."""
    if fullname == "apex.amp":
        return "ampatch"
    if fullname in EXTENSION_MODULES:
        return f"ampatch.compat.extensions.{fullname}"
    head, _, rest = fullname.partition(".")
    if head == "apex" and rest.split(".")[0] in PACKAGES:
        return f"ampatch.compat.{rest}"
    return None


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _public_walk(package: types.ModuleType) -> Iterator[str]:
    """The names of `package`'s modules, recursively (packages before their children)."""
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        yield info.name


def provided_modules() -> dict[str, str]:
    """Every Apex module the alias provides -> the ampatch module behind it, parents first."""
    out = {"apex.amp": "ampatch"}
    for name in PACKAGES:
        package = importlib.import_module(f"ampatch.compat.{name}")
        if name != "amp":
            out[f"apex.{name}"] = package.__name__
        for module in _public_walk(package):
            out["apex." + module.removeprefix("ampatch.compat.")] = module
    return out


class _AliasDistribution(importlib.metadata.Distribution):
    """The `apex` distribution importlib.metadata finds under the alias (name, version, summary)."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: apex\nVersion: {APEX_VERSION}\n"
                    "Summary: ampatch's alias for NVIDIA Apex (ampatch.compat.install_apex_alias)\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).resolve().parent / str(path)


class _AliasLoader(importlib.abc.Loader):
    """The loader in an alias module's spec: the module is `target` (already built by ampatch),
    or, with no target, `module` itself (the `apex` package); loading again does nothing."""

    def __init__(self, target: str | None = None, module: types.ModuleType | None = None) -> None:
        self.target = target
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return importlib.import_module(self.target) if self.target else self.module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _probe_placeholder(fullname: str) -> types.ModuleType:
    """A package standing in for a not-provided parent while `importlib.util.find_spec` probes
    one of its children (removed again before find_spec returns)."""
    module = types.ModuleType(fullname, "ampatch: a placeholder while importlib.util.find_spec probes")
    module.__path__ = []
    setattr(module, _PROBE_FLAG, True)
    return module


def _is_placeholder(module: Any) -> bool:
    return getattr(module, "__dict__", {}).get(_PROBE_FLAG) is True  # no getattr: modules may answer anything


def _drop_placeholders() -> None:
    for name in [n for n, m in list(sys.modules.items()) if _is_placeholder(m)]:
        del sys.modules[name]
        parent, _, child = name.rpartition(".")
        if _is_placeholder(getattr(sys.modules.get(parent), "__dict__", {}).get(child)):
            delattr(sys.modules[parent], child)


_FIND_SPEC_CODE = importlib.util.find_spec.__code__


def _probed_name() -> str | None:
    """The name `importlib.util.find_spec` was asked for, when it is the caller (a probe)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        if frame.f_code is _FIND_SPEC_CODE:
            return frame.f_locals.get("fullname") or frame.f_locals.get("name")
        frame = frame.f_back
    return None


class _ApexFinder(importlib.abc.MetaPathFinder):
    """Finds the alias's modules by the rule; answers the Apex modules ampatch does not
    provide with a clear error (None to a `find_spec` probe), and importlib.metadata's
    question for the `apex` distribution with the alias's."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        apex_name = fullname.startswith("apex.")
        if not apex_name and not (fullname in EXTENSIONS
                                  and importlib.machinery.PathFinder.find_spec(fullname) is None):
            return None
        stand_in = target_of(fullname) if apex_name else None
        spec = importlib.util.find_spec(stand_in) if stand_in is not None and _exists(stand_in) else None
        if stand_in is not None and spec is not None:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(stand_in), origin=spec.origin,
                                                  is_package=spec.submodule_search_locations is not None)
        probed = _probed_name()
        if probed is None or not (probed == fullname or probed.startswith(fullname + ".")):
            # not the name a find_spec asks about, nor a parent on its way to it (an import run
            # by a package that find_spec imports): the clear ImportError, no placeholder
            _drop_placeholders()
            raise NotProvidedError(not_provided_message(fullname), name=fullname)
        if probed == fullname:  # the name asked about: "not there", placeholders gone
            _drop_placeholders()
            return None
        # a parent find_spec imports on its way to the name asked about
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module=_probe_placeholder(fullname)),
                                              is_package=True)

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if apex_alias_installed() and (name is None or name.lower().replace("-", "_") == "apex"):
            yield _AliasDistribution()


_finder = _ApexFinder()


def _alias_getattr(name: str) -> Any:
    """`apex.<name>` for a subpackage ampatch does not provide: AttributeError with the hint."""
    if name.startswith("__"):
        raise AttributeError(f"module 'apex' has no attribute {name!r}")
    raise AttributeError(not_provided_message(f"apex.{name}"))


def apex_alias_installed() -> bool:
    """Whether `apex` currently resolves to ampatch's alias."""
    return getattr(sys.modules.get("apex"), _ALIAS_FLAG, False) is True


def _real_apex_spec() -> Any:
    """The spec (or True) of an importable real `apex`, else None."""
    real = sys.modules.get("apex")  # already imported, so importable
    try:
        return importlib.util.find_spec("apex") if real is None else (real.__spec__ or True)
    except (ImportError, ValueError):  # a broken apex on the path: still not ours to shadow
        return True


def _alias_package() -> types.ModuleType:
    apex = types.ModuleType("apex", "ampatch's alias for NVIDIA Apex: apex.amp is ampatch, apex.parallel, "
                                    "apex.optimizers, ... are ampatch.compat's adapters over PyTorch.")
    apex.__spec__ = importlib.machinery.ModuleSpec("apex", _AliasLoader(module=apex), origin="ampatch.compat.alias",
                                                   is_package=True)
    apex.__loader__ = apex.__spec__.loader
    locations = apex.__spec__.submodule_search_locations
    assert locations is not None  # is_package=True made it []
    apex.__path__ = locations  # [], a package: `import apex.amp` is a submodule
    vars(apex)["__getattr__"] = _alias_getattr  # the module's own __getattr__ (PEP 562)
    setattr(apex, _ALIAS_FLAG, True)
    return apex


def install_apex_alias() -> bool:
    """Make `import apex.amp` / `from apex import amp` load ampatch, and `apex.parallel`,
    `apex.optimizers`, ... ampatch's adapters.

    Returns True when the alias is in place (idempotent), False when a real `apex` is
    importable: then nothing changes and a warning says that the real one will be used.
    """
    if apex_alias_installed():
        return True
    spec = _real_apex_spec()
    if spec is not None:
        where = getattr(spec, "origin", None) or getattr(sys.modules.get("apex"), "__file__", None) or "on sys.path"
        message = (f"ampatch: a real 'apex' package is importable ({where}); not aliasing apex.amp to "
                   "ampatch, so `from apex import amp` loads Apex. Uninstall apex, or import ampatch "
                   "directly (`import ampatch as amp`).")
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False
    modules = {"apex": _alias_package()}
    for name, target in provided_modules().items():  # parents first
        module = modules[name] = importlib.import_module(target)
        parent, _, child = name.rpartition(".")
        if parent != "apex.amp" and not hasattr(modules[parent], child):  # never an attribute of ampatch
            setattr(modules[parent], child, module)
    for name in EXTENSION_MODULES:
        if name not in sys.modules and importlib.machinery.PathFinder.find_spec(name) is None:
            modules[name] = importlib.import_module(target_of(name) or "")
    for name, module in modules.items():
        sys.modules[name] = module
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    logger.info("ampatch: `apex.amp` now loads ampatch")
    return True


def uninstall_apex_alias() -> bool:
    """Remove the alias; returns whether there was one. A real apex is never touched."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    if not apex_alias_installed():
        return False
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        del sys.modules[name]
    for name in EXTENSION_MODULES:
        if getattr(sys.modules.get(name), "__name__", "") == target_of(name):
            del sys.modules[name]
    return True
