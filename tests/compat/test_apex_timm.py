"""timm's train.py on its Apex path (`--amp --amp-impl apex --model-ema`), reproduced without
timm under the alias: `amp.initialize(model, optimizer, opt_level=...)`, its `ApexScaler`
(`amp.scale_loss`, clipping `amp.master_params`, a checkpoint's "amp" entry saved only where
`'state_dict' in amp.__dict__`), and its EMA copy (`ModelEmaV3`: `copy.deepcopy` after
initialize, `.to(dtype=torch.float32)` for a half model, a foreach lerp through
`state_dict()`, then the copy evaluated)."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from _idioms import ema_v3_update
from torch import nn

F32 = torch.float32


class Net(nn.Module):
    """A tiny resnet stem and head: conv, batch norm, pooling, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(torch.relu(self.bn(self.conv(x))), 1).flatten(1))


def batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)


def apex_scaler_step(amp, model, optimizer, x, y) -> None:
    """timm.utils.ApexScaler.__call__ with --clip-grad 1.0, as train_one_epoch calls it."""
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_an_fp32_ema_of_a_half_model_evaluates_the_averaged_weights(apex_alias, level) -> None:
    from apex import amp
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    ema = copy.deepcopy(model)  # ModelEmaV3(model, dtype=torch.float32).__init__
    ema.eval()
    ema.to(dtype=F32)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i in range(3):
        apex_scaler_step(amp, model, optimizer, *batch(i))
        ema_v3_update(ema, model, 0.9)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                expected[k] = expected[k].lerp(v, 0.1) if v.is_floating_point() else v.clone()
    got = ema.state_dict()
    for k, v in got.items():
        assert v.dtype == expected[k].dtype and torch.equal(v, expected[k]), k
    # the weights the copy's forward uses are the averaged ones, not the copy's first values
    for name, p in ema.named_parameters():
        assert p.dtype == F32 and torch.equal(p, got[name]), name
    plain = Net()
    plain.load_state_dict(got)
    plain.eval()
    x, _ = batch(50)
    with torch.no_grad():
        torch.testing.assert_close(ema(x), plain(x), rtol=0, atol=0)


def test_the_apex_scaler_checkpoint_entry_resumes_the_loss_scale(apex_alias) -> None:
    from apex import amp
    # ApexScaler.state_dict/load_state_dict save and load only where amp's module dict has them
    assert "state_dict" in amp.__dict__ and "load_state_dict" in amp.__dict__
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0 ** 10
    for i in range(3):
        apex_scaler_step(amp, model, optimizer, *batch(i))
    buf = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, buf)
    saved = amp.state_dict()
    assert saved == {"loss_scaler0": {"loss_scale": 2.0 ** 10, "unskipped": 3}}
    checkpoint = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    model.load_state_dict(checkpoint["state_dict"])  # timm's resume_checkpoint, after initialize
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    assert amp.state_dict() == saved
