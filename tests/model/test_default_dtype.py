"""Tensors a model creates inside its own forward (a lazily built positional encoding, a
mask, noise) reach its half modules as half at O2/O3/O5, as under torch.autocast and
Lightning's bf16-true: a cast model's forward runs with the half dtype as torch's default
(ampatch.model.default_dtype). Kept-FP32 modules make FP32 tensors; the default is given
back after the forward, after an exception, across nesting and threads; compiled forwards
do the same."""
from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.model.default_dtype import DEFAULT_DTYPE, default_dtype

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
CAST = ("O2", "O3", "O5")


class LazyPositions(nn.Module):
    """The shape of Lightning's demos.Transformer PositionalEncoding: built on the first
    forward with torch.zeros (the default dtype), added to the activations."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.pe: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pe is None:
            pe = torch.zeros(64, self.dim)
            position = torch.arange(0, 64, dtype=torch.float).unsqueeze(1)
            div = torch.exp(torch.arange(0, self.dim, 2).float() * (-math.log(10000.0) / self.dim))
            pe[:, 0::2] = torch.sin(position * div)
            pe[:, 1::2] = torch.cos(position * div)
            self.pe = pe
        return x + self.pe[: x.shape[1]]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.pos = LazyPositions(8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.pos(self.embed(ids))
        noise = torch.randn(h.shape) * 1e-3        # made inside the forward
        mask = torch.ones(h.shape[1], 1)             # another one
        self.seen.append(noise.dtype)
        return self.head(torch.relu(self.body(h + noise)) * mask)


def train(level: str, steps: int = 3, **init: object) -> tuple[list[float], Net]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=BF16, verbosity=0, **init)
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(ids).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    amp.deinitialize()
    return losses, model


@pytest.mark.parametrize("level", LEVELS)
def test_tensors_made_inside_the_forward_reach_half_modules(level: str) -> None:
    losses, model = train(level)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    made = BF16 if level in CAST else F32
    assert set(model.seen) == {made}
    assert model.pos.pe.dtype == made  # cached as made (bf16-true caches it in half too)
    assert torch.get_default_dtype() == F32


def test_outside_the_forward_the_default_is_untouched() -> None:
    model = amp.initialize(nn.Linear(2, 2), opt_level="O2", half_dtype=BF16, verbosity=0)
    assert torch.get_default_dtype() == F32 and torch.zeros(1).dtype == F32
    model(torch.ones(1, 2))
    assert torch.zeros(1).dtype == F32
    amp.deinitialize()


def test_a_forward_that_raises_gives_the_default_back() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert torch.get_default_dtype() == BF16
            raise ValueError("boom")

    model = amp.initialize(Bad(), opt_level="O5", verbosity=0)
    with pytest.raises(ValueError, match="boom"):
        model(torch.ones(1, 2))
    assert torch.get_default_dtype() == F32 and not DEFAULT_DTYPE.active()
    amp.deinitialize()


def test_a_kept_module_makes_fp32_tensors_inside_a_half_model() -> None:
    made = {}

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bias = torch.zeros(2)  # meets the FP32 head: must be FP32
            made["head"] = bias.dtype
            return self.lin(x) + bias

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 4), Head()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.head(self.body(x))
            made["after"] = torch.zeros(1).dtype  # the model's own half again after the kept module
            return out

    model = amp.initialize(Model(), opt_level="O2", half_dtype=BF16, keep_fp32="head", verbosity=0)
    model(torch.ones(3, 4))
    assert made == {"head": F32, "after": BF16}
    amp.deinitialize()


def test_nesting_and_a_user_default() -> None:
    torch.set_default_dtype(torch.float64)
    try:
        with default_dtype(BF16):
            with default_dtype(F32, weak=True):
                assert torch.get_default_dtype() == F32
                with default_dtype(BF16):
                    assert torch.get_default_dtype() == BF16
                assert torch.get_default_dtype() == F32
            assert torch.get_default_dtype() == BF16
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(F32)


def test_threads_running_cast_models_keep_the_half_default_until_the_last_leaves() -> None:
    """nn.DataParallel runs the replicas of one cast model in threads: the first thread to
    finish must not give FP32 back under the others, nor the last leave half behind; a kept
    module's weak FP32 request does not reach another thread's cast model."""
    first_in, release = threading.Event(), threading.Event()
    seen = []

    def slow() -> None:
        with default_dtype(BF16):
            first_in.set()
            release.wait(10)
            seen.append(torch.zeros(1).dtype)

    worker = threading.Thread(target=slow)
    worker.start()
    first_in.wait(10)
    with default_dtype(BF16):
        with default_dtype(F32, weak=True):  # another thread is inside: the half default stays
            assert torch.get_default_dtype() == BF16
    assert torch.get_default_dtype() == BF16  # the worker is still inside
    release.set()
    worker.join(10)
    assert seen == [BF16] and torch.get_default_dtype() == F32


def test_dataparallel_replicas_in_threads() -> None:
    model = Net()
    model = amp.initialize(model, opt_level="O2", half_dtype=BF16, verbosity=0)
    parallel = nn.DataParallel(model, device_ids=None)  # CPU: runs the module itself; threads below
    out = []
    threads = [threading.Thread(target=lambda: out.append(parallel(torch.randint(0, 16, (2, 6)))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 4 and all(o.dtype == F32 for o in out)
    assert torch.get_default_dtype() == F32
    amp.deinitialize()


@pytest.mark.parametrize("level", CAST)
def test_compiled_cast_model_makes_half_tensors_inside(level: str) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = amp.initialize(Net(), opt_level=level, half_dtype=BF16, verbosity=0)
        ids = torch.randint(0, 16, (2, 6))
        eager = model(ids)
        model.pos.pe = None  # built again inside the compiled forward
        out = torch.compile(model, backend="eager")(ids)
        assert out.dtype == F32 and model.pos.pe.dtype == BF16
        assert torch.get_default_dtype() == F32
        torch.testing.assert_close(out, eager, rtol=0.05, atol=0.05)
    finally:
        torch._dynamo.reset()
        amp.deinitialize()


@pytest.mark.parametrize("level,masters", [("O2", True), ("O5", True), ("O5", "kahan"), ("O3", False)])
def test_a_step_taken_while_the_default_is_half(level: str, masters: object) -> None:
    """A framework's step context (Lightning's manual optimization) may call scale_loss and
    optimizer.step() while the default dtype is half: ampatch's own bookkeeping tensors (the
    overflow flag, the masters' checks) are FP32 whatever the default, and the step applies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, master_weights=masters, loss_scale="dynamic",
                                verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    with default_dtype(torch.bfloat16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert torch.get_default_dtype() == torch.float32
    assert not amp.last_step_skipped(opt)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    amp.deinitialize()

