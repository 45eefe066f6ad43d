"""AmpatchPrecision on code Lightning's users write, at every level: Lightning's own
`demos.Transformer` (a hand loop and its LightningModule), a step that calls a submodule on a
float batch and makes tensors inside (the LitAutoEncoder shape), the GAN recipe with
`toggle_optimizer`, fit then validate, manual-optimization schedulers, grad-norm logging in
`on_before_optimizer_step`, the precision Lightning reports, a policy choosing the level,
refused strategies, and the device the weights end on."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampatch as amp
from ampatch.model.default_dtype import default_dtype
from ampatch.model.forwards import cast_tree

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.demos import Transformer  # noqa: E402
from lightning.pytorch.demos.transformer import LightningTransformer  # noqa: E402

from ampatch.lightning import AmpatchPrecision  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
UNCAST = ("O0", "O1", "O4")
CAST = ("O2", "O3", "O5")
VOCAB, SEQ = 32, 8


def fit_trainer(plugin: object, steps: int = 3, **kwargs: object) -> L.Trainer:
    kwargs = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
              "enable_model_summary": False, **kwargs}
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], **kwargs)


def plugin(level: str | None = "O2", **kwargs: object) -> AmpatchPrecision:
    return AmpatchPrecision(level, **{"half_dtype": BF16, "verbosity": 0, **kwargs})


def assert_same_losses(level: str, got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) > 0
    if level in UNCAST:
        assert got == want
    else:
        assert got[0] == want[0]
        assert got == pytest.approx(want, rel=2e-2)


def token_batches(n: int = 3) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (n * 4, SEQ + 1), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)


# ------------------------------------------------------------------ Lightning's demos.Transformer
@pytest.mark.parametrize("level", LEVELS)
def test_demo_transformer_in_a_hand_loop(level: str) -> None:
    """Its positional encoding is built lazily, with torch.zeros, inside forward."""
    losses = []
    for run_level in ("O0", level):
        torch.manual_seed(0)
        model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=run_level, half_dtype=BF16, verbosity=0)
        run = []
        for inputs, target in token_batches():
            loss = F.nll_loss(model(inputs, target), target.reshape(-1))
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        amp.deinitialize()
        losses.append(run)
    assert all(math.isfinite(v) for v in losses[1])
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


class LocalTransformer(LightningTransformer):
    """Lightning's demo module as it is; only its data comes from the test (prepare_data
    downloads WikiText-2)."""

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.losses: list[float] = []

    def prepare_data(self) -> None:
        pass

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("level", LEVELS)
def test_demo_lightning_transformer_matches_the_hand_loop(level: str) -> None:
    torch.manual_seed(0)
    lit = LocalTransformer()
    fit_trainer(plugin(level)).fit(lit, token_batches())
    torch.manual_seed(0)
    hand = LocalTransformer()
    opt = hand.configure_optimizers()
    hand, opt = amp.initialize(hand, opt, opt_level=level, half_dtype=BF16, verbosity=0)
    for i, batch in enumerate(token_batches()):
        loss = hand.training_step(batch, i)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    amp.deinitialize()
    assert_same_losses(level, lit.losses, hand.losses)


# ------------------------------------------------------------------ a step calling submodules
class DenoisingAutoEncoder(L.LightningModule):
    """Lightning's LitAutoEncoder shape: training_step calls the encoder and decoder directly
    on the float batch, and makes the noise and a mask itself."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 16))
        self.losses: list[float] = []
        self.made: list[torch.dtype] = []

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        noise = 0.1 * torch.randn(x.shape)
        mask = torch.ones(x.shape[1])
        mask[::4] = 0.0
        self.made.append(noise.dtype)
        x_hat = self.decoder(self.encoder((x + noise) * mask))
        loss = F.mse_loss(x_hat, x)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def float_batches(n: int = 4) -> torch.utils.data.DataLoader:
    x = torch.randn(n * 8, 16, generator=torch.Generator().manual_seed(2))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)


@pytest.mark.parametrize("level", LEVELS)
def test_a_step_calling_submodules_on_a_float_batch(level: str) -> None:
    torch.manual_seed(0)
    lit = DenoisingAutoEncoder()
    fit_trainer(plugin(level), steps=4).fit(lit, float_batches())
    assert set(lit.made) == {BF16 if level in CAST else F32}
    # the hand loop: what the plugin does around the step, written out
    torch.manual_seed(0)
    hand = DenoisingAutoEncoder()
    opt = hand.configure_optimizers()
    hand, opt = amp.initialize(hand, opt, opt_level=level, half_dtype=BF16, verbosity=0)
    for i, batch in enumerate(float_batches()):
        if level in CAST:
            with default_dtype(BF16):
                loss = hand.training_step(cast_tree(batch, BF16), i)
        else:
            loss = hand.training_step(batch, i)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    amp.deinitialize()
    assert_same_losses(level, lit.losses, hand.losses)


@pytest.mark.parametrize("level,precision", [("O0", "32-true"), ("O3", "bf16-true")])
def test_o0_and_o3_train_as_lightnings_own_precision(level: str, precision: str) -> None:
    """O0 is FP32 and O3 is pure bfloat16 without masters: the same training as Lightning's
    own "32-true" and "bf16-true", loss for loss."""
    runs = []
    for own in (False, True):
        torch.manual_seed(0)
        lit = DenoisingAutoEncoder()
        kwargs = {"precision": precision} if own else {"plugins": [plugin(level)]}
        L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, **kwargs).fit(lit, float_batches())
        runs.append(lit.losses)
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ the GAN recipe
class Generator(nn.Module):
    def __init__(self, latent: int = 8, shape: tuple[int, ...] = (1, 4, 4)) -> None:
        super().__init__()
        self.shape = shape
        self.model = nn.Sequential(nn.Linear(latent, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32),
                                   nn.BatchNorm1d(32, 0.8), nn.LeakyReLU(0.2), nn.Linear(32, 16), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z).view(z.size(0), *self.shape)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.model(img.view(img.size(0), -1))


class GAN(L.LightningModule):
    """Lightning's GAN template (examples/pytorch/domain_templates), small: manual
    optimization, `toggle_optimizer`, noise made in the step, `self(z)` fed to the
    discriminator."""

    def __init__(self, latent: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent)
        self.discriminator = Discriminator()
        self.losses: list[tuple[float, float]] = []

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real = F.binary_cross_entropy_with_logits(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()), fake)
        d_loss = (real + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.losses.append((g_loss.item(), d_loss.item()))

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)))


class DiscriminatorGrads(L.Callback):
    """Whether each backward changed the gradients of what the discriminator's optimizer
    steps (its params; at O2/O5 their FP32 masters); the first backward of a step is the
    generator's."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor | None] = []
        self.changed: list[bool] = []

    def grads(self, trainer: L.Trainer) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.clone() for p in amp.master_params(trainer.optimizers[1])]

    def on_before_backward(self, trainer: L.Trainer, module: GAN, loss: torch.Tensor) -> None:
        self.before = self.grads(trainer)

    def on_after_backward(self, trainer: L.Trainer, module: GAN) -> None:
        after = self.grads(trainer)
        self.changed.append(any((a is None) != (b is None) or (a is not None and not torch.equal(a, b))
                                for a, b in zip(self.before, after)))


def images(n: int = 3) -> torch.utils.data.DataLoader:
    x = torch.rand(n * 8, 1, 4, 4, generator=torch.Generator().manual_seed(3)) * 2 - 1
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(n * 8)), batch_size=8)


@pytest.mark.parametrize("level", LEVELS)
def test_gan_recipe_with_toggle_optimizer(level: str) -> None:
    torch.manual_seed(0)
    gan = GAN()
    before = [p.detach().clone() for p in gan.parameters()]
    grads = DiscriminatorGrads()
    fit_trainer(plugin(level), steps=2 * 3, callbacks=[grads]).fit(gan, images())
    assert len(gan.losses) == 3 and all(math.isfinite(v) for pair in gan.losses for v in pair)
    assert grads.changed[0::2] == [False] * 3  # the generator's backward left the discriminator alone
    assert grads.changed[1::2] == [True] * 3   # its own backward did not
    assert all(p.dtype == F32 and p.requires_grad for p in gan.parameters())  # untoggled, undone
    assert all(not torch.equal(a, b) for a, b in zip(before, gan.parameters()) if a.dim() > 1)


# ------------------------------------------------------------------ fit, then evaluate
class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.val_losses: list[float] = []
        self.val_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(F.cross_entropy(self(x), y).item())
        self.val_dtypes.append(self.net[0].weight.dtype)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def labelled(n: int = 3) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n * 8, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def test_fit_then_validate_keeps_the_training_report_and_the_cast_model(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    from ampatch.base.exit_json import exit_report

    path = tmp_path / "report.json"
    monkeypatch.setenv("AMPATCH_REPORT", str(path))
    monkeypatch.setattr(exit_report, "source", None)
    monkeypatch.setattr(exit_report, "final", None)
    monkeypatch.setattr(exit_report, "registered", True)  # no real atexit hook from a test
    torch.manual_seed(0)
    lit = Classifier()
    trainer = fit_trainer(plugin("O2"), steps=3, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(lit, labelled(), labelled(1))
    trained = [p.detach().clone() for p in lit.parameters()]
    trainer.validate(lit, labelled(1), verbose=False)
    assert lit.val_dtypes == [BF16, BF16]  # evaluated on the cast model, in and after fit
    assert lit.val_losses[0] == lit.val_losses[1]  # the same half weights
    assert all(torch.equal(a, b) and b.dtype == F32 for a, b in zip(trained, lit.parameters()))
    exit_report.write()
    saved = json.loads(path.read_text())
    assert saved["steps"] == 3 and saved["opt_level"] == "O2"


# ------------------------------------------------------------------ manual optimization, hooks
class ManualWithScheduler(Classifier):
    """Manual optimization with a scheduler the step advances itself; the first loss is
    made infinite (an overflow: that step is skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lrs: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt, sch = self.optimizers(), self.lr_schedulers()
        self.lrs.append(opt.param_groups[0]["lr"])
        loss = super().training_step(batch, batch_idx) * (float("inf") if batch_idx == 0 else 1.0)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sch.step()

    def configure_optimizers(self) -> object:
        opt = super().configure_optimizers()
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]


def test_manual_optimization_schedulers_hold_after_a_skipped_step() -> None:
    lit = ManualWithScheduler()
    fit_trainer(plugin("O2", half_dtype=torch.float16), steps=3).fit(lit, labelled())
    assert lit.lrs == [0.5, 0.5, 0.25]


class LogsGradNorms(Classifier):
    """Logs grad norms in on_before_optimizer_step, as Lightning's docs show; `zero` also
    zeroes the grads there (a hook that changes them)."""

    def __init__(self, zero: bool = False) -> None:
        super().__init__()
        self.zero = zero
        self.norms: list[dict] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm
        self.norms.append(grad_norm(self, norm_type=2))
        if self.zero:
            for p in self.parameters():
                p.grad.zero_()


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_grad_norms_in_on_before_optimizer_step(level: str) -> None:
    lit = LogsGradNorms()
    fit_trainer(plugin(level), steps=2, gradient_clip_val=1e-3).fit(lit, labelled())
    assert len(lit.norms) == 2 and all(n and all(math.isfinite(float(v)) for v in n.values()) for n in lit.norms)
    total = lit.norms[0]["grad_2.0_norm_total"]
    assert float(total) > 0
    torch.manual_seed(0)
    zeroed = LogsGradNorms(zero=True)
    before = [p.detach().clone() for p in zeroed.parameters()]
    fit_trainer(plugin(level), steps=2).fit(zeroed, labelled())
    assert all(torch.equal(a, b) for a, b in zip(before, zeroed.parameters()))  # the zeroed grads were stepped


# ------------------------------------------------------------------ what Lightning is told
@pytest.mark.parametrize("level,precision,compute", [("O0", "32-true", F32), ("O1", "32-true", BF16),
                                                     ("O2", "bf16-true", BF16), ("O3", "16-true", torch.float16)])
def test_precision_reported_to_lightning(level: str, precision: str, compute: torch.dtype) -> None:
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
    from lightning.pytorch.utilities.model_summary import ModelSummary

    seen = {}

    class Look(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            seen["precision"] = trainer.precision
            seen["compute"] = _plugin_to_compute_dtype(trainer.precision_plugin)
            seen["size"] = ModelSummary(module).model_size

    half = torch.float16 if level == "O3" else BF16
    fit_trainer(plugin(level, half_dtype=half), steps=1, callbacks=[Look()]).fit(Classifier(), labelled())
    params = sum(p.numel() for p in Classifier().parameters())
    assert seen["precision"] == precision and seen["compute"] == compute
    assert seen["size"] == pytest.approx(params * (2 if precision != "32-true" else 4) / 1e6)


@pytest.mark.parametrize("policy,level", [({"opt_level": "O1", "half_dtype": "bfloat16"}, "O1"),
                                          ({"opt_level": "O0"}, "O0"), (None, "O2")])
def test_a_policy_alone_decides_the_level(policy: dict | None, level: str) -> None:
    seen = []

    class Level(L.Callback):
        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            seen.append(amp.report().opt_level)

    fit_trainer(AmpatchPrecision(policy=policy, verbosity=0), steps=1, callbacks=[Level()]).fit(Classifier(),
                                                                                                 labelled())
    assert seen == [level]


@pytest.mark.parametrize("name", ["DeepSpeedStrategy", "FSDPStrategy"])
def test_strategies_that_own_precision_are_refused(name: str) -> None:
    strategy_cls = getattr(L.strategies, name)
    lit = Classifier()
    lit.trainer = SimpleNamespace(strategy=strategy_cls.__new__(strategy_cls))  # no set-up needed to refuse
    with pytest.raises(ValueError, match=f"cannot run with {name}"):
        AmpatchPrecision("O2").convert_module(lit)


# ------------------------------------------------------------------ where the weights end
def test_restore_puts_the_weights_on_the_device_the_model_is_on_now() -> None:
    """Lightning moves the module to the CPU before the plugin's teardown: the masters (on
    the training device) go back onto the params' device, not theirs (here: 'meta')."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    model.to("meta")
    amp.deinitialize()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert all(p.dtype == F32 for p in model.parameters())


@pytest.mark.cuda
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_after_fit_on_a_gpu_the_fp32_weights_are_on_the_cpu(level: str) -> None:
    masters = {}

    class Keep(L.Callback):
        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            masters["values"] = [p.detach().cpu().clone() for p in amp.master_params(trainer.optimizers[0])]

    lit = Classifier()
    L.Trainer(accelerator="gpu", devices=1, max_steps=2, plugins=[plugin(level)], logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[Keep()]).fit(lit, labelled())
    assert {t.device.type for t in [*lit.parameters(), *lit.buffers()]} == {"cpu"}
    assert all(p.dtype == F32 for p in lit.parameters())
    for p, m in zip(lit.parameters(), masters["values"]):
        assert torch.equal(p, m)
