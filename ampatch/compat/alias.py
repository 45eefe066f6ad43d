"""The `apex` import alias: `from apex import amp` loads ampatch, for scripts that cannot be
edited (`ampatch run --apex-alias` installs it from a `sitecustomize`).

Under the alias `apex.amp` is ampatch itself, and `apex.parallel`, `apex.optimizers`,
`apex.normalization`, `apex.fp16_utils`, `apex.multi_tensor_apply` (and `apex.testing`, which
Apex's own tests import) are ampatch's thin adapters over PyTorch; Apex's compiled `amp_C` and
`apex_C` are its foreach-op stand-ins (also as `apex.extensions.amp_C`). Everything else of
Apex (`apex.contrib`, its other CUDA extensions, ...) fails to import with an `ImportError`
that says ampatch does not provide it and names the PyTorch replacement; the message survives
`from X import Y`, which swallows a `ModuleNotFoundError` for the name it asked for. Nothing is
installed when a real `apex` is importable: that one wins.

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
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("ampatch")

_ALIAS_FLAG = "__ampatch_alias__"
_README = "see 'Coming from Apex' in ampatch's README"
# What importlib.metadata.version("apex") answers under the alias: Apex's own version number
# (its setup.py said 0.1 to the end), marked as ampatch's stand-in.
APEX_VERSION = "0.1+ampatch"

# Apex module -> the ampatch module that stands in for it under the alias.
PROVIDED = {
    "apex.amp": "ampatch",
    "apex.amp._amp_state": "ampatch.compat.state",
    "apex.parallel": "ampatch.compat.parallel",
    "apex.parallel.LARC": "ampatch.compat.larc",
    "apex.optimizers": "ampatch.compat.optimizers",
    "apex.normalization": "ampatch.compat.normalization",
    "apex.fp16_utils": "ampatch.compat.fp16_utils",
    "apex.multi_tensor_apply": "ampatch.compat.multi_tensor_apply",
    "apex.testing": "ampatch.compat.testing",
    "apex.testing.common_utils": "ampatch.compat.testing",
    # Apex's own module names inside those packages, which some scripts import from
    "apex.parallel.distributed": "ampatch.compat.parallel",
    "apex.parallel.sync_batchnorm": "ampatch.compat.parallel",
    "apex.parallel.optimized_sync_batchnorm": "ampatch.compat.parallel",
    "apex.optimizers.fused_adam": "ampatch.compat.optimizers",
    "apex.optimizers.fused_sgd": "ampatch.compat.optimizers",
    "apex.optimizers.fused_adagrad": "ampatch.compat.optimizers",
    "apex.optimizers.fused_lamb": "ampatch.compat.optimizers",
    "apex.optimizers.fused_novograd": "ampatch.compat.optimizers",
    "apex.optimizers.fp16_optimizer": "ampatch.compat.optimizers",
    "apex.normalization.fused_layer_norm": "ampatch.compat.normalization",
    "apex.fp16_utils.fp16util": "ampatch.compat.fp16_utils",
    "apex.fp16_utils.fp16_optimizer": "ampatch.compat.fp16_utils",
    "apex.fp16_utils.loss_scaler": "ampatch.compat.fp16_utils",
    "apex.multi_tensor_apply.multi_tensor_apply": "ampatch.compat.multi_tensor_apply",
    # where some Apex versions import their compiled modules from
    "apex.extensions": "ampatch.compat.extensions",
    "apex.extensions.amp_C": "ampatch.compat.amp_c",
    "apex.extensions.apex_C": "ampatch.compat.apex_c",
}
# Apex's compiled top-level modules that ampatch stands in for (unless a real one is importable).
EXTENSION_MODULES = {"amp_C": "ampatch.compat.amp_c", "apex_C": "ampatch.compat.apex_c"}

# What ampatch does not provide, and what replaces it in PyTorch (most specific prefix wins).
NOT_PROVIDED = {
    "apex.amp": "Apex's amp internals are not provided; `from apex import amp` gives ampatch's public API "
                f"(initialize, scale_loss, _amp_state, init, ...), {_README}",
    "apex.contrib": "use PyTorch's own: torch.nn.functional.scaled_dot_product_attention (fmha, multihead_attn), "
                    "torch.optim with fused=True (contrib optimizers), "
                    "torch.distributed.optim.ZeroRedundancyOptimizer (DistributedFusedAdam/LAMB), "
                    "torch.nn.functional.cross_entropy(label_smoothing=...) (xentropy), "
                    "torch.nn.GroupNorm / torch.nn.SyncBatchNorm (group_norm, groupbn)",
    "apex.transformer": "use torch.distributed.tensor (tensor parallelism) or Megatron-Core",
    "apex.mlp": "use torch.nn.Sequential of torch.nn.Linear layers",
    "apex.fused_dense": "use torch.nn.Linear (torch.compile fuses the bias and activation)",
    "apex.extensions": "of Apex's compiled extensions only amp_C and apex_C are provided; use torch._foreach_* ops and "
                       "torch.optim's fused=True / foreach=True",
    "apex": f"only apex.amp, apex.parallel, apex.optimizers, apex.normalization, apex.fp16_utils, "
            f"apex.multi_tensor_apply and the amp_C/apex_C kernels are provided, {_README}",
}
_KERNELS = "Apex's compiled CUDA kernels are not provided (amp_C and apex_C are); "
EXTENSIONS = {
    "syncbn": _KERNELS + "use torch.nn.SyncBatchNorm",
    "fused_layer_norm_cuda": _KERNELS + "use torch.nn.functional.layer_norm / rms_norm",
    "fused_adam_cuda": _KERNELS + "use torch.optim.AdamW(fused=True)",
    "fused_lamb_cuda": _KERNELS + "PyTorch has no LAMB; use torch.optim.AdamW(fused=True)",
    "mlp_cuda": _KERNELS + "use torch.nn.Linear layers",
    "fused_dense_cuda": _KERNELS + "use torch.nn.Linear",
    "xentropy_cuda": _KERNELS + "use torch.nn.functional.cross_entropy(label_smoothing=...)",
    "scaled_masked_softmax_cuda": _KERNELS + "use torch.nn.functional.scaled_dot_product_attention",
    "scaled_upper_triang_masked_softmax_cuda": _KERNELS + "use torch.nn.functional.scaled_dot_product_attention",
}


class NotProvidedError(ImportError):
    """An Apex module ampatch does not provide. An `ImportError`, deliberately not a
    `ModuleNotFoundError`: `from apex import contrib` would swallow that one and replace
    the message by a bare "cannot import name"."""


def not_provided_class(name: str, module: str, message: str, base: type = object) -> type:
    """A stand-in for an Apex class ampatch does not provide: it imports fine (scripts import
    Apex's names unconditionally) and constructing it raises NotImplementedError(message)."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(message)
    return type(name, (base,), {"__init__": __init__, "__module__": module, "__doc__": f"Not provided: {message}"})


def not_provided_message(fullname: str) -> str:
    """Why `fullname` cannot be imported under the alias, with the PyTorch replacement."""
    if fullname in EXTENSIONS:
        return (f"ampatch does not provide {fullname!r} ('apex' here is ampatch's alias, "
                f"ampatch.compat.install_apex_alias): {EXTENSIONS[fullname]}.")
    prefix = max((p for p in NOT_PROVIDED if fullname == p or fullname.startswith(p + ".")), key=len)
    return (f"ampatch does not provide {fullname!r} ('apex' here is ampatch's alias for Apex, "
            f"ampatch.compat.install_apex_alias): {NOT_PROVIDED[prefix]}.")


class _AliasDistribution(importlib.metadata.Distribution):
    """The `apex` distribution importlib.metadata finds under the alias (name, version, summary)."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: apex\nVersion: {APEX_VERSION}\n"
                    "Summary: ampatch's alias for NVIDIA Apex (ampatch.compat.install_apex_alias)\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).resolve().parent / str(path)


class _ApexFinder(importlib.abc.MetaPathFinder):
    """Answers imports of the Apex modules ampatch does not provide with a clear error, and
    importlib.metadata's question for the `apex` distribution with the alias's."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.startswith("apex."):
            raise NotProvidedError(not_provided_message(fullname), name=fullname)
        if fullname in EXTENSIONS and importlib.machinery.PathFinder.find_spec(fullname) is None:
            raise NotProvidedError(not_provided_message(fullname), name=fullname)
        return None

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if apex_alias_installed() and (name is None or name.lower().replace("-", "_") == "apex"):
            yield _AliasDistribution()


class _AliasLoader(importlib.abc.Loader):
    """The loader in the `apex` alias's spec: the module is built by `install_apex_alias`, so
    loading (or reloading) it again does nothing."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_finder = _ApexFinder()


def _alias_getattr(name: str) -> Any:
    """`apex.<name>` for a subpackage ampatch does not provide: AttributeError with the hint."""
    if name.startswith("__"):
        raise AttributeError(f"module 'apex' has no attribute {name!r}")
    raise AttributeError(not_provided_message(f"apex.{name}"))


def apex_alias_installed() -> bool:
    """Whether `apex` currently resolves to ampatch's alias."""
    return getattr(sys.modules.get("apex"), _ALIAS_FLAG, False) is True


def install_apex_alias() -> bool:
    """Make `import apex.amp` / `from apex import amp` load ampatch, and `apex.parallel`,
    `apex.optimizers`, ... ampatch's adapters.

    Returns True when the alias is in place (idempotent), False when a real `apex` is
    importable: then nothing changes and a warning says that the real one will be used.
    """
    if apex_alias_installed():
        return True
    real = sys.modules.get("apex")  # already imported, so importable
    try:
        spec = importlib.util.find_spec("apex") if real is None else (real.__spec__ or True)
    except (ImportError, ValueError):  # a broken apex on the path: still not ours to shadow
        spec = True
    if spec is not None:
        where = getattr(spec, "origin", None) or getattr(real, "__file__", None) or "on sys.path"
        message = (f"ampatch: a real 'apex' package is importable ({where}); not aliasing apex.amp to "
                   "ampatch, so `from apex import amp` loads Apex. Uninstall apex, or import ampatch "
                   "directly (`import ampatch as amp`).")
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False

    apex = types.ModuleType("apex", "ampatch's alias for NVIDIA Apex: apex.amp is ampatch, apex.parallel, "
                                    "apex.optimizers, ... are ampatch.compat's adapters over PyTorch.")
    apex.__spec__ = importlib.machinery.ModuleSpec("apex", _AliasLoader(), origin="ampatch.compat.alias",
                                                   is_package=True)
    apex.__loader__ = apex.__spec__.loader
    apex.__path__ = apex.__spec__.submodule_search_locations  # [], a package: `import apex.amp` is a submodule
    apex.__getattr__ = _alias_getattr
    setattr(apex, _ALIAS_FLAG, True)
    modules = {"apex": apex}
    for name, target in PROVIDED.items():  # parents first: the dict lists them first
        module = modules[name] = importlib.import_module(target)
        parent, _, child = name.rpartition(".")
        if parent == "apex":
            setattr(apex, child, module)
        elif not hasattr(modules[parent], child):  # `apex.testing.common_utils` as an attribute too
            setattr(modules[parent], child, module)
    for name, target in EXTENSION_MODULES.items():
        if name not in sys.modules and importlib.machinery.PathFinder.find_spec(name) is None:
            modules[name] = importlib.import_module(target)
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
    del sys.modules["apex"]
    for name, target in {**PROVIDED, **EXTENSION_MODULES}.items():
        if name in sys.modules and sys.modules.get(name) is sys.modules.get(target):
            del sys.modules[name]
    return True
