"""The FP8 layers of a diagnosed run, each measured against bfloat16 on its own inputs.

An `Fp8Probe` hooks the layers a session converted (`model.fp8.Fp8Layers`): for the first
`CALLS_PER_STEP` calls of each layer per recorded step it keeps the call's input and a copy
of the weights it ran with, and the gradient that reaches its output; once the step is done
(`on_step`) it measures each of those calls with `fp8_error.layer_fp8_error` under the
layer's own torchao config (the recipe's scaling, emulated or not as the run was) and keeps
the numbers (`records.Fp8LayerRecord`), never the tensors: the output's and the weight
gradient's relative error against the same GEMMs in bfloat16, and, per FP8 cast the recipe
makes, how many values saturate, flush to zero or land among FP8's subnormals.

Measuring runs on detached copies after the step, so the run trains exactly as it would
without the probe.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch import nn

from .fp8_error import layer_fp8_error, weight_and_bias
from .records import Fp8LayerRecord

__all__ = ["Fp8Probe", "CALLS_PER_STEP", "converted_layers", "probe"]

CALLS_PER_STEP = 1  # calls measured per layer and step (a layer called in a loop is measured once a step)


def converted_layers(layers: Any) -> list[tuple[str, nn.Module, str]]:
    """(label, layer, kind) of each layer a session's `Fp8Layers` converted, in module order."""
    return [(c.label, layers.models[c.model].get_submodule(c.name), c.kind) for c in layers.choices if c.convert]


class Fp8Probe:
    """Hooks on the converted layers of `layers` (a `model.fp8.Fp8Layers`); see the module docstring."""

    def __init__(self, layers: Any, recipe: str) -> None:
        self.layers = converted_layers(layers)
        emulated = bool(layers.emulated)
        self.records = {label: Fp8LayerRecord(label, kind, recipe, emulated) for label, _, kind in self.layers}
        self._pending: list[tuple[str, nn.Module, dict[str, Any]]] = []
        self._calls: dict[str, int] = {}
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self.active = False

    def attach(self) -> None:
        for label, layer, _ in self.layers:
            self._handles.append(layer.register_forward_hook(functools.partial(self._forward, label)))
        self.active = True

    def detach(self) -> None:
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()

    def _forward(self, label: str, layer: nn.Module, inputs: tuple, output: Any) -> None:
        if not self.active or not inputs or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        with self._lock:
            if self._calls.get(label, 0) >= CALLS_PER_STEP:
                return
            self._calls[label] = self._calls.get(label, 0) + 1
        weight, bias = weight_and_bias(layer)
        call: dict[str, Any] = {
            "x": inputs[0].detach(),
            "weight": weight.detach().clone(),  # the step changes the layer's own before it is measured
            "bias": bias.detach().clone() if bias is not None else None,
            "grad": None}

        def grad_hook(grad: torch.Tensor) -> None:
            if self.active and call["grad"] is None:
                call["grad"] = grad.detach()
        output.register_hook(grad_hook)
        with self._lock:
            self._pending.append((label, layer, call))

    def on_step(self) -> None:
        """A recorded optimizer step ended: measure the calls it made, and forget their tensors."""
        with self._lock:
            pending, self._pending, self._calls = self._pending, [], {}
        for label, layer, call in pending:
            if call["grad"] is None:  # its output never reached the loss (or backward has not run)
                continue
            record = self.records[label]
            try:
                with torch.enable_grad():  # its own small graph (the step may have left grad mode off)
                    found = layer_fp8_error(layer, call["x"], layer.config, call["grad"], weight=call["weight"],
                                            bias=call["bias"])
            except Exception as exc:  # a layer that cannot be measured: no figure, never a failed run
                record.failure = record.failure or f"{type(exc).__name__}: {exc}"[:200]
                continue
            record.add(found)

    def result(self) -> list[Fp8LayerRecord]:
        return [self.records[label] for label, _, _ in self.layers]


def probe(layers: Any) -> Fp8Probe | None:
    """The probe of a session's FP8 layers (None: no layer was converted)."""
    if layers is None or not any(c.convert for c in layers.choices):
        return None
    return Fp8Probe(layers, layers.recipe)
