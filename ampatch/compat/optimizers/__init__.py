"""`apex.optimizers` under the alias: Apex's fused optimizers with Apex's math, arguments and
defaults, computed by the `amp_C` stand-ins on torch's foreach ops (any device).

One module per optimizer, named as in Apex (`fused_adam`, `fused_sgd`, `fused_lamb`,
`fused_mixed_precision_lamb`, `fused_novograd`, `fused_adagrad`, and `fp16_optimizer`: Apex's
wrapper for the pre-2019 FusedAdam), over what they share (`base`). Each keeps its state in
`optimizer.state` (and, as in Apex, `step` in the param group), so `state_dict()`/`load_state_dict()`
round-trip it, and each works under `amp.initialize` at every level (at O2 the FP32 masters are the params it sees).
"""
from __future__ import annotations

from .fp16_optimizer import FP16_Optimizer
from .fused_adagrad import FusedAdagrad
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from .fused_novograd import FusedNovoGrad
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad",
           "FP16_Optimizer"]
