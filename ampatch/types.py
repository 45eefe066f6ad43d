"""The types of ampatch's public surface, for annotating code that calls it.

    from ampatch.types import OptLevel
    def train(level: OptLevel = "O2") -> None: ...

Each alias says what a keyword of `ampatch.initialize` accepts, as closely as a type can:
where Apex took a string form ("True", a numeric loss scale) the alias takes it too; where
the parser forgives more (any case, spaces: " o2 " is O2) the type names the canonical form.
What a value means is in the docstring of `initialize` and in docs/reference.md; the parsing
is `ampatch.config.values` (and `config.levels`, `model.keep`, `config.policy_file`), which
this module only describes: it imports nothing of ampatch.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, Literal, SupportsFloat, TypedDict, TypeVar, Union

import torch
from torch import nn

if TYPE_CHECKING:  # names only a type checker needs: torchao is the `fp8` extra
    from torch.distributed import ProcessGroup
    from torchao.float8 import Float8LinearConfig

__all__ = ["OptLevel", "MasterWeights", "OptimizerStates", "Flag", "DTypeLike", "CastModelType", "LossScale",
           "KeepFP32", "KeepFP32Item", "FP8", "FP8Recipe", "FP8Modules", "Policy", "ModelT", "OptimizerT", "Several",
           "InitializeKeywords"]

OptLevel = Literal["O0", "O1", "O2", "O3", "O4", "O5"]
"""An opt level: O0 FP32, O1 patched casts, O2 half model + FP32 masters, O3 pure half,
O4/O5 = O1/O2 in bfloat16 (case and surrounding spaces are forgiven at run time)."""

Flag = Union[bool, Literal["True", "False"], None]
"""A property flag (`patch_torch_functions`, `keep_batchnorm_fp32`): True/False, Apex's
strings "True"/"False", or None (the level's default)."""

MasterWeights = Union[bool, Literal["stochastic", "kahan"], Literal["True", "False"], None]
"""`master_weights`: True (FP32 masters), False (none), None (the level's default), or for a
bfloat16 model (O2/O3/O5) "stochastic" / "kahan" (no FP32 copy); Apex's "True"/"False" too."""

OptimizerStates = Union[Literal["float32", "bfloat16", "int8"], torch.dtype, None]
"""`optimizer_states`: what the optimizer's per-element state is stored in between steps:
"float32" (the optimizer's own; also None), "bfloat16" or "int8", or the torch dtype of
that name."""

DTypeLike = Union[torch.dtype, str]
"""A float dtype or its name: torch.float16, "bfloat16", "torch.float16", "half", "float32"."""

CastModelType = Union[DTypeLike, Literal[False], None]
"""`cast_model_type`: a float dtype (or its name), None (the level's), or False (Apex's "leave
the model as it is")."""

LossScale = Union[SupportsFloat, str, None]
"""A loss scale: a number (also a numpy scalar or 0-dim tensor) between 2**-126 and 2**126,
a numeric string such as "128.0", or "dynamic"; None: the level's default."""

KeepFP32Item = Union[str, type[nn.Module], Callable[[str, nn.Module], bool]]
"""One `keep_fp32` entry: a module name, an `nn.Module` class, or `(name, module) -> bool`."""
KeepFP32 = Union[KeepFP32Item, Sequence[KeepFP32Item], Set[KeepFP32Item], None]
"""`keep_fp32`: module names as `named_modules()` gives them ("head", "1.head" with several
models, "a,b"), module classes, callables `(name, module) -> bool`, or a list of these."""

FP8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""torchao's float8 training recipes (`torchao.float8.Float8LinearRecipeName`)."""
FP8 = Union[bool, FP8Recipe, "Float8LinearConfig", None]
"""`fp8`: True (= "tensorwise"), a recipe name, a torchao `Float8LinearConfig`, or
None/False (off)."""

FP8Modules = Union[str, Sequence[str], Set[str], Callable[[nn.Module, str], bool], None]
"""`fp8_modules`: layer names or globs ("blocks.*.mlp.*"; "a,b"), or `(module, fqn) -> bool`."""

Policy = Union[str, os.PathLike[str], Mapping[str, Any], None]
"""`policy`: the path of a policy file `ampatch tune` wrote, or its contents as a dict."""

T = TypeVar("T")
Several = Union[list[T], tuple[T, ...]]
"""Several models or optimizers, as `initialize` takes them (it returns a list)."""

ModelT = TypeVar("ModelT", bound=nn.Module)
"""A model's own class, kept through `initialize` (it returns the same object)."""
OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)
"""An optimizer's own class, kept through `initialize` (it returns the same object)."""


class InitializeKeywords(TypedDict, total=False):
    """`initialize`'s keywords after `models` and `optimizers`, with their types: what its
    overloads take (tests/project/test_public_docs.py keeps the two equal)."""

    enabled: bool
    opt_level: OptLevel
    cast_model_type: CastModelType
    patch_torch_functions: Flag
    keep_batchnorm_fp32: Flag
    master_weights: MasterWeights
    loss_scale: LossScale
    cast_model_outputs: DTypeLike | None
    num_losses: int
    verbosity: int
    min_loss_scale: float | None
    max_loss_scale: float
    half_dtype: DTypeLike | None
    allow_banned: bool
    patch_torch_functions_type: DTypeLike | None
    process_group: ProcessGroup | None
    keep_fp32: KeepFP32
    fp8: FP8
    fp8_modules: FP8Modules
    optimizer_states: OptimizerStates
    policy: Policy
