"""Training-code idioms as the libraries that use them write them, shared by the tests of
what ampatch must keep right between steps (tests/session/test_one_truth.py) and of the
libraries' own flows through the Apex alias (tests/compat/)."""
from __future__ import annotations

import torch
from torch import nn


def ema_v3_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """timm's ModelEmaV3.apply_update_ (foreach path), as timm writes it."""
    with torch.no_grad():
        ema_values, model_values = [], []
        for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_values.append(ema_v)
                model_values.append(model_v)
            else:
                ema_v.copy_(model_v)
        torch._foreach_lerp_(ema_values, model_values, weight=1.0 - decay)
