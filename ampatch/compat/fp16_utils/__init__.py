"""`apex.fp16_utils` under the alias: Apex's manual mixed-precision helpers.

`to_python_float`, `network_to_half`, `BN_convert_float`, `tofp16`, `convert_module`,
`convert_network`, `FP16Model`, `FP16_Module`, `fp32_to_fp16`, `fp16_to_fp32`,
`prep_param_lists`, `model_grads_to_master_grads` and `master_params_to_model_params` behave as
in Apex (the copies use torch's foreach ops). `FP16_Optimizer` (`fp16_optimizer`) and the
stand-alone `LossScaler`/`DynamicLossScaler` (`loss_scaler`) are thin layers over ampatch's
master weights and loss scaler. `Fused_Weight_Norm` (a CUDA kernel) is not provided.
"""
from __future__ import annotations

from .fp16_optimizer import FP16_Optimizer
from .fp16util import (
           BN_convert_float,
           FP16_Module,
           FP16Model,
           Fused_Weight_Norm,
           clip_grad_norm,
           convert_module,
           convert_network,
           fp16_to_fp32,
           fp32_to_fp16,
           master_params_to_model_params,
           model_grads_to_master_grads,
           network_to_half,
           prep_param_lists,
           to_python_float,
           tofp16,
)
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["to_python_float", "tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network",
           "FP16Model", "FP16_Module", "fp32_to_fp16", "fp16_to_fp32", "prep_param_lists",
           "model_grads_to_master_grads", "master_params_to_model_params", "clip_grad_norm", "FP16_Optimizer",
           "LossScaler", "DynamicLossScaler", "Fused_Weight_Norm"]
