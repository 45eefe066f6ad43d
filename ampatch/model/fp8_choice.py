"""Which layers `fp8=` runs in FP8, each with its reason (`choose`): a `LayerChoice` per
`nn.Linear` and Transformers `Conv1D` of the models, converted or skipped.

The default (no `fp8_modules`): every `nn.Linear` whose in/out features are multiples of 16
(FP8 GEMMs need them), and GPT-2's `Conv1D` (a Linear with its weight transposed), except
the output head: a layer whose weight is tied to an `nn.Embedding`, or the last of them in
module order. `fp8_modules` (names or globs as `named_modules()` gives them, "1.fc" with
several models; or a callable `(module, fqn) -> bool`) replaces the default choice, the head
rule included; the rules that make a conversion wrong or silently useless hold for both.
Pure decisions: nothing here changes a model or imports torchao.
"""
from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampatch.errors import ConfigError

__all__ = ["LayerChoice", "choose", "is_conv1d", "is_float8", "features"]

MULTIPLE = 16  # FP8 GEMMs (torch._scaled_mm) need both dimensions divisible by 16


@dataclass(frozen=True)
class LayerChoice:
    """One Linear-like layer: where it is (`label`: its name, with the model's index in front
    when there are several models), what it is, and whether it runs in FP8, and why."""

    model: int
    name: str
    label: str
    kind: str  # "Linear" or "Conv1D"
    in_features: int
    out_features: int
    convert: bool
    reason: str

    def __str__(self) -> str:
        return (f"{'fp8 ' if self.convert else 'skip'} {self.label} ({self.kind} {self.in_features}->"
                f"{self.out_features}): {self.reason}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.label, "kind": self.kind, "in_features": self.in_features,
                "out_features": self.out_features, "converted": self.convert, "reason": self.reason}


def is_conv1d(module: nn.Module) -> bool:
    """A Transformers `Conv1D` (GPT-2's projections: y = x @ W + b, W of shape (in, out));
    Transformers is imported where a model holds one."""
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None)
    return cls is not None and isinstance(module, cls)


def is_float8(module: nn.Module) -> bool:
    """A layer already running torchao's float8 training (`Float8Linear`, or ours)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    cls = getattr(linear, "Float8Linear", None)
    return (cls is not None and isinstance(module, cls)) or getattr(module, "ampatch_fp8", False)


def features(module: nn.Module) -> tuple[str, int, int] | None:
    """(kind, in features, out features) of a Linear-like layer, None for any other module."""
    if isinstance(module, nn.Linear):
        return "Linear", module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if is_conv1d(module) and isinstance(weight, torch.Tensor):
        return "Conv1D", weight.shape[0], weight.shape[1]
    return None


def _own_forward(module: nn.Module, kind: str) -> str | None:
    """The class of a Linear subclass that brings its own forward (converting it would drop it)."""
    base = nn.Linear if kind == "Linear" else sys.modules["transformers.pytorch_utils"].Conv1D
    owner = next(c for c in type(module).__mro__ if "forward" in vars(c))
    return None if owner is base else owner.__name__


def _reason(module: nn.Module, kind: str, fin: int, fout: int, parent: nn.Module, names_of: dict[int, int],
            kept: Collection[int]) -> str | None:
    """Why this layer must not run in FP8 whatever was asked (None: it may)."""
    if id(module) in kept:
        return "kept in FP32 (keep_fp32)"
    if is_float8(module):
        return "already float8 (converted before initialize)"
    if isinstance(parent, nn.MultiheadAttention):
        return ("inside nn.MultiheadAttention, whose forward reads out_proj.weight directly: converting it would "
                "change nothing")
    if names_of[id(module)] > 1:
        return "one module registered under several names"
    own = _own_forward(module, kind)
    if own:
        return f"{own} has its own forward, which converting would replace"
    weight = module.weight
    if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
        return f"weight is {weight.dtype}, not floating point"
    if fin % MULTIPLE or fout % MULTIPLE:
        return f"in/out features {fin}x{fout} are not multiples of {MULTIPLE} (FP8 GEMMs need them)"
    return None


def _output_head(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> tuple[str | None, str]:
    """The model's output head (its name, and why it is the head): the layer whose weight an
    `nn.Embedding` holds too (tied input and output embeddings), else the last in module order."""
    embeddings = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    for name, module in layers:
        if id(module.weight) in embeddings:
            return name, f"output head: weight tied to embedding '{embeddings[id(module.weight)]}'"
    if layers:
        return layers[-1][0], "output head: the last Linear in module order"
    return None, ""


def _matcher(spec: Any, labels: list[str]) -> Callable[[nn.Module, str, str], bool]:
    """`fp8_modules` as a test of (module, name, label); a pattern matching no layer raises
    ValueError listing the layers there are."""
    if callable(spec):
        return lambda module, name, label: bool(spec(module, name))
    for pattern in spec:
        if not any(fnmatch.fnmatchcase(label, pattern) for label in labels):
            raise ConfigError(f"fp8_modules: {pattern!r} matches no Linear layer (nn.Linear or Transformers Conv1D). "
                              f"The Linear layers are: {', '.join(labels) or '(none)'}. Names are those of "
                              "model.named_modules(); globs such as 'blocks.*.mlp.*' work.")
    return lambda module, name, label: any(fnmatch.fnmatchcase(label, p) for p in spec)


def choose(models: Sequence[nn.Module], fp8_modules: Any = None, kept: Collection[int] = frozenset(),
           conv1d: bool = True) -> list[LayerChoice]:
    """A `LayerChoice` for every Linear-like layer of `models`, in module order. `fp8_modules`:
    None (the default choice), a tuple of names/globs, or a callable `(module, fqn) -> bool`;
    `kept`: ids of the modules kept in FP32. Raises ValueError for a pattern matching nothing."""
    found: list[tuple[int, str, str, nn.Module, nn.Module]] = []
    for i, model in enumerate(models):
        for name, module in model.named_modules(remove_duplicate=False):
            if name and features(module) is not None:
                parent = model.get_submodule(name.rpartition(".")[0])
                found.append((i, name, f"{i}.{name}" if len(models) > 1 else name, module, parent))
    match = _matcher(fp8_modules, [f[2] for f in found]) if fp8_modules is not None else None
    names_of: dict[int, int] = {}
    for *_, module, _ in found:
        names_of[id(module)] = names_of.get(id(module), 0) + 1
    heads = {i: _output_head(m, [(n, mod) for j, n, _, mod, _ in found if j == i]) for i, m in enumerate(models)}
    out = []
    for i, name, label, module, parent in found:
        dims = features(module)
        if dims is None:  # not reached: `found` holds Linear-like layers only
            continue
        kind, fin, fout = dims
        head, why_head = heads[i]
        reason = _reason(module, kind, fin, fout, parent, names_of, kept)
        if reason is None and kind == "Conv1D" and not conv1d:
            reason = "Transformers Conv1D left out"
        if reason is None:
            if match is not None:
                convert = match(module, name, label)
                reason = "selected by fp8_modules" if convert else "not selected by fp8_modules"
            elif name == head:
                convert, reason = False, why_head
            else:
                convert = True
                reason = ("default: Linear with dims multiples of 16" if kind == "Linear"
                          else "default: Conv1D, run as a Linear with its weight transposed")
        else:
            convert = False
        out.append(LayerChoice(i, name, label, kind, fin, fout, convert, reason))
    return out
