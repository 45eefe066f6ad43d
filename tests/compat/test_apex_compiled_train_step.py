"""A whole training step compiled, the way mmengine's `Runner(cfg=dict(compile=True))`
compiles `BaseModel.train_step` around its unmodified `ApexOptimWrapper`: `amp.initialize`
on the first call (while the optimizer has no `_amp_stash`), then the forward,
`amp.scale_loss(loss / accumulative_counts, optimizer)` with backward, and `step()`,
`zero_grad()` every `accumulative_counts` calls, all inside the compiled function.

After a graph break Dynamo compiles the frames that the eager rest of the step calls, the
optimizer handle's among them; a traced stage move specialized on the stage it saw and
went on writing it, so after one overflow every later step was skipped (at every level: O2
here, the cheapest to compile)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_steps_after_an_overflow_run_in_a_compiled_accumulating_train_step(apex_alias) -> None:
    from apex import amp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    wrapper = {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2), "count": 0}
    accumulative_counts, poisoned = 2, 2  # the first micro-batch of the second step overflows

    def train_step(x: torch.Tensor, y: torch.Tensor, overflow: bool) -> None:
        if not hasattr(wrapper["optimizer"], "_amp_stash"):  # ApexOptimWrapper.optim_context
            _, wrapper["optimizer"] = amp.initialize(model, wrapper["optimizer"], opt_level="O2",
                                                     loss_scale="dynamic", verbosity=0)
        loss = nn.functional.cross_entropy(model(x), y) / accumulative_counts
        if overflow:
            loss = loss * float("inf")
        with amp.scale_loss(loss, wrapper["optimizer"]) as scaled_loss:  # ApexOptimWrapper.backward
            scaled_loss.backward()
        wrapper["count"] += 1
        if wrapper["count"] % accumulative_counts == 0:  # OptimWrapper.update_params
            wrapper["optimizer"].step()
            wrapper["optimizer"].zero_grad()

    compiled = torch.compile(train_step, backend="eager")
    x, y = torch.randn(12, 8, 16), torch.randint(0, 4, (12, 8))
    changed = []
    for i in range(12):
        before = model[0].weight.detach().clone()
        compiled(x[i], y[i], i == poisoned)
        if i % accumulative_counts == accumulative_counts - 1:
            changed.append(not torch.equal(before, model[0].weight))
    assert changed == [True, False, True, True, True, True]  # the overflowed step alone is skipped
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 15, "unskipped": 9}
