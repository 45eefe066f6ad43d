"""Lightning 2.x: ampatch's opt levels as precision plugins.

    trainer = lightning.Trainer(plugins=[AmpatchPrecision("O2")], ...)      # the Trainer
    fabric = lightning.Fabric(plugins=[AmpatchFabricPrecision("O2")])       # Fabric

Lightning's own precision plugins are autocast ("16-mixed") or pure half without FP32
masters ("16-true"); these are `amp.initialize` + `amp.scale_loss` driven by Lightning's
hooks, so O2/O5 (half weights, FP32 masters, dynamic loss scale) and every other level
train as a hand-written ampatch loop would. `opt_level=None` with `policy=` runs the
policy's level; with neither, O2.

- `trainer`: `AmpatchPrecision`, the Trainer's plugin;
- `fabric`: `AmpatchFabricPrecision`, Fabric's;
- `common`: what both share (the level chosen, batches and step code at the cast levels,
  grads and `requires_grad` seen from the model's side of the FP32 masters);
- `framework`: Lightning's names, and the few private ones the plugins cannot avoid.

Imported only by who uses it (never by `import ampatch`).
"""
from __future__ import annotations

from .common import DEFAULT_LEVEL, PluginState
from .fabric import AmpatchFabricPrecision
from .trainer import AmpatchPrecision

__all__ = ["AmpatchPrecision", "AmpatchFabricPrecision", "PluginState", "DEFAULT_LEVEL"]
