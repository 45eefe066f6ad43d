"""Each FP8 layer's error against the same layer in bfloat16, on the same inputs: what
`diagnose --fp8` reports per layer, and what tells the layers FP8 hurts from the rest.

- `layer_fp8_error(layer, x, recipe, grad_output)`: one layer (`nn.Linear`, a converted
  `Float8Linear`, or Transformers' `Conv1D`) run through torchao's float8 matmul and through a
  bfloat16 one with the same weight values, input and upstream gradient: the relative error
  of the output and of the weight gradient, and the share of values that saturate, flush to
  zero or land below the FP8 format's normal range in the recipe's own casts (recomputed
  with torchao's scaling helpers: the scales and bits are torchao's).
- `capture_layer_io(model, names, run)`: each named layer's input and output gradient from
  one forward and backward of `run()` (the model's gradients left as they were).
- `fp8_error_table(model, run, recipe)`: both, for every layer the default choice converts.

Numbers only; the layer, its parameters and their `.grad` are never changed.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigTypeError
from ..model import fp8
from ..model.fp8_choice import choose, is_conv1d

__all__ = ["layer_fp8_error", "weight_and_bias", "cast_stats", "capture_layer_io", "fp8_error_table", "TABLE_KEYS"]

TABLE_KEYS = ("out_rel_err", "wgrad_rel_err", "saturated_share", "underflow_share", "subnormal_share")


def _casts(config: Any) -> list[tuple[str, str, Any, int]]:
    """The six float8 casts of torchao's float8 matmul (float8_linear.py): (label, operand,
    CastConfig, axiswise dim on the 2-D operand); operands: "x" (M, K) input, "wt" (K, N) the
    weight transposed, "go" (M, N) output gradient."""
    c = config
    return [("input@output", "x", c.cast_config_input, -1),
            ("weight@output", "wt", c.cast_config_weight, 0),
            ("grad_output@grad_input", "go", c.cast_config_grad_output, -1),
            ("weight@grad_input", "wt", c.cast_config_weight_for_grad_input, -1),
            ("grad_output@grad_weight", "go", c.cast_config_grad_output_for_grad_weight, 0),
            ("input@grad_weight", "x", c.cast_config_input_for_grad_weight, 0)]


@torch.no_grad()
def cast_stats(hp: torch.Tensor, cast: Any, axiswise_dim: int, round_pow2: bool) -> dict[str, Any]:
    """Saturation and flush-to-zero of one of torchao's dynamic casts of `hp` (`cast`: its
    CastConfig), with torchao's own scale and saturating conversion."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    gran = cast.scaling_granularity
    scale = tensor_to_scale(hp, cast.target_dtype, scaling_granularity=gran,
                            axiswise_dim=axiswise_dim if gran is ScalingGranularity.AXISWISE else None,
                            round_scales_to_power_of_2=round_pow2)
    scaled = hp.float() * scale
    info = torch.finfo(cast.target_dtype)
    low = to_fp8_saturated(scaled, cast.target_dtype).float()
    nonzero = hp != 0
    # beyond the largest value by more than half its spacing: it would round past it (the amax itself, scaled
    # to the largest value, can land a float32 rounding above it and loses nothing)
    top = info.max + info.eps * 2.0 ** math.floor(math.log2(info.max)) / 2
    return {"dtype": str(cast.target_dtype).replace("torch.", ""), "granularity": gran.value, "n": hp.numel(),
            "saturated": int((scaled.abs() >= top).sum()),
            "underflow": int((nonzero & (low == 0)).sum()),
            "subnormal": int((nonzero & (low != 0) & (low.abs() < info.tiny)).sum()),
            "rel_err": _rel(low / scale, hp)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()  # float32's squares overflow from 1.8e19 (wide gradients)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def weight_and_bias(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`layer`'s own weight and bias (None where it has none); TypeError for a layer without a
    weight, which no FP8 matmul could run."""
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if not isinstance(weight, torch.Tensor):
        raise ConfigTypeError(f"{type(layer).__name__} has no weight tensor; give layer_fp8_error a Linear "
                              "(or Float8Linear, Conv1D) layer")
    return weight, bias if isinstance(bias, torch.Tensor) else None


def layer_fp8_error(layer: nn.Module, x: torch.Tensor, recipe: Any = "tensorwise",
                    grad_output: torch.Tensor | None = None, *, compute_dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> dict[str, Any]:
    """The FP8 error of `layer` under `recipe` (a name or a torchao Float8LinearConfig)
    against the same layer in `compute_dtype`, on input `x` and upstream gradient
    `grad_output` (None: a seeded random one); `weight`/`bias`: the values to use instead of
    the layer's own (in its layout: a copy taken when it ran, before the step changed it).
    Returns `out_rel_err`, `wgrad_rel_err`, the shares (over every element of every FP8 cast
    the recipe makes) `saturated_share`,
    `underflow_share`, `subnormal_share`, and `per_cast` details; `emulated` says whether
    torchao emulated the FP8 GEMMs (on this device it has no FP8 tensor cores)."""
    from torchao.float8.config import ScalingType
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    config = fp8.config_for(recipe, x.device)
    own_weight, own_bias = weight_and_bias(layer)
    weight = own_weight if weight is None else weight
    bias = own_bias if bias is None else bias
    w_t = (weight if is_conv1d(layer) else weight.t()).detach().to(compute_dtype)  # (in, out)
    bias = bias.detach().to(compute_dtype) if bias is not None else None
    x = x.detach().to(compute_dtype).reshape(-1, w_t.shape[0])
    out_shape = (x.shape[0], w_t.shape[1])
    if grad_output is None:
        grad_output = torch.randn(out_shape, generator=torch.Generator().manual_seed(seed)).to(x.device)
    go = grad_output.detach().to(compute_dtype).reshape(out_shape)
    outputs, grads = [], []
    for run_fp8 in (False, True):
        w = w_t.clone().requires_grad_(True)
        y = matmul_with_hp_or_float8_args.apply(x, w, fp8.linear_mm_config(config), config) if run_fp8 else x @ w
        y = y + bias if bias is not None else y
        (gw,) = torch.autograd.grad(y, w, go)
        outputs.append(y)
        grads.append(gw)
    operands = {"x": x, "wt": w_t, "go": go}
    per_cast: dict[str, dict[str, Any]] = {}
    for label, operand, cast, dim in _casts(config):
        per_cast[label] = ({"dtype": "high precision"} if cast.scaling_type is ScalingType.DISABLED
                           else cast_stats(operands[operand], cast, dim, config.round_scales_to_power_of_2))
    made = [s for s in per_cast.values() if "n" in s]
    total = sum(s["n"] for s in made) or 1
    return {"recipe": recipe if isinstance(recipe, str) else "custom", "emulated": bool(config.emulate),
            "out_rel_err": _rel(outputs[1], outputs[0]), "wgrad_rel_err": _rel(grads[1], grads[0]),
            "saturated_share": sum(s["saturated"] for s in made) / total,
            "underflow_share": sum(s["underflow"] for s in made) / total,
            "subnormal_share": sum(s["subnormal"] for s in made) / total,
            "per_cast": per_cast}


def capture_layer_io(model: nn.Module, names: Sequence[str], run: Callable[[], torch.Tensor]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{name: (input, output gradient)}` of each named layer over one forward and backward of
    `run()` (which returns the loss); the parameters' `.grad` are as they were afterwards."""
    saved: dict[str, list[Any]] = {n: [None, None] for n in names}
    handles = []
    for name in names:
        layer = model.get_submodule(name)

        def forward_hook(_m: nn.Module, inputs: tuple, _out: Any, name: str = name) -> None:
            saved[name][0] = inputs[0].detach().clone()

        def backward_hook(_m: nn.Module, _gin: tuple, gout: tuple, name: str = name) -> None:
            saved[name][1] = gout[0].detach().clone()
        handles += [layer.register_forward_hook(forward_hook), layer.register_full_backward_hook(backward_hook)]
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:  # backward would accumulate into them in place
        p.grad = None
    try:
        with warnings.catch_warnings():  # a first layer's input needs no grad: its hook sees the output's, as wanted
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            run().backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in grads.items():
            p.grad = g
    return {n: (x, g) for n, (x, g) in saved.items() if x is not None and g is not None}


def fp8_error_table(model: nn.Module, run: Callable[[], torch.Tensor], recipe: Any = "tensorwise",
                    names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """For each layer in `names` (default: those the default choice converts), its FP8 error
    (`layer_fp8_error`) on the inputs and output gradients of one real step of `run`."""
    if names is None:
        names = [c.name for c in choose([model]) if c.convert]
    io = capture_layer_io(model, names, run)
    rows = []
    for name in names:
        if name not in io:  # not reached by this step's forward and backward
            continue
        x, go = io[name]
        result = layer_fp8_error(model.get_submodule(name), x, recipe, grad_output=go)
        rows.append({"name": name, **{k: result[k] for k in TABLE_KEYS}})
    return rows
