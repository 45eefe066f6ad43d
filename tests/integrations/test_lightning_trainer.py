"""ampatch.lightning.AmpatchPrecision: a LightningModule trained by Lightning's Trainer at
each level gives the losses of the hand-written ampatch loop (same model, seed, data):
equal where the model is not cast (O0/O1/O4), close where it is (O2/O3/O5). Also: a
skipped step holds the LR scheduler back, clipping and accumulation act on the masters,
manual optimization with two optimizers, checkpoint/resume restores masters, optimizer
state and loss scaler bit for bit, teardown undoes, DDP on 2 CPU processes."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _cli import ampatch_main
from torch import nn
from torch.nn import functional as F

import ampatch as amp
from ampatch.session.session import current as live_session

L = pytest.importorskip("lightning.pytorch")
from ampatch.lightning import AmpatchPrecision  # noqa: E402

BF16 = torch.bfloat16
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
UNCAST = ("O0", "O1", "O4")
STEPS = 4


class MLP(L.LightningModule):
    """A tiny classifier; `inf_at` makes that step's loss infinite (an overflow)."""

    def __init__(self, lr: float = 0.1, inf_at: int | None = None, scheduler: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.lr, self.inf_at, self.scheduler = lr, inf_at, scheduler
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss * float("inf") if index == self.inf_at else loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch, batch_idx)

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def configure_optimizers(self) -> object:
        opt = self.optimizer()
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def data(n: int = STEPS * 8) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(level: str, steps: int = STEPS, **kwargs: object) -> L.Trainer:
    plugin = kwargs.pop("plugin", None) or AmpatchPrecision(level, half_dtype=BF16, verbosity=0)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     **kwargs)


def hand_loop(model: MLP, level: str, steps: int = STEPS, accumulate: int = 1, clip: float | None = None,
              **init: object) -> MLP:
    """The same training as the Trainer's, written with amp.initialize/scale_loss."""
    opt = model.optimizer()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if model.scheduler else None
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=BF16, verbosity=0, **init)
    for i, batch in enumerate(data(steps * 8 * accumulate)):
        if i % accumulate == 0:
            model.lrs.append(opt.param_groups[0]["lr"])
        loss = model.loss(batch, i) / accumulate
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None and not amp.last_step_skipped(opt):
            sched.step()
    amp.deinitialize()
    return model


def assert_same_losses(level: str, got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    if level in UNCAST:
        assert got == want
    else:
        assert got == pytest.approx(want, rel=2e-2)
        assert got[0] == want[0]


@pytest.mark.parametrize("level", LEVELS)
def test_losses_match_the_hand_written_loop(level: str) -> None:
    torch.manual_seed(0)
    lit = MLP()
    trainer(level).fit(lit, data())
    torch.manual_seed(0)
    hand = hand_loop(MLP(), level)
    assert_same_losses(level, lit.losses, hand.losses)
    for a, b in zip(lit.parameters(), hand.parameters()):  # after teardown: FP32 again, equal values
        assert a.dtype == torch.float32
        if level in UNCAST:
            assert torch.equal(a, b)


@pytest.mark.parametrize("inf_at,lrs", [(0, [0.1, 0.1, 0.05, 0.025]), (1, [0.1, 0.05, 0.05, 0.025])])
def test_an_overflow_skips_the_step_and_holds_the_scheduler_without_a_warning(inf_at: int, lrs: list) -> None:
    """A skipped first step is where torch warns that the scheduler stepped before the optimizer."""
    torch.manual_seed(0)
    lit = MLP(inf_at=inf_at, scheduler=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        trainer("O2").fit(lit, data())
    torch.manual_seed(0)
    hand = hand_loop(MLP(inf_at=inf_at, scheduler=True), "O2")
    assert lit.lrs == hand.lrs == lrs  # no halving after the skipped step
    assert_same_losses("O2", lit.losses, hand.losses)


def test_accumulation_and_clipping_act_on_the_masters() -> None:
    torch.manual_seed(0)
    lit = MLP(lr=1.0)
    trainer("O2", accumulate_grad_batches=2, gradient_clip_val=0.05).fit(lit, data(STEPS * 16))
    torch.manual_seed(0)
    hand = hand_loop(MLP(lr=1.0), "O2", accumulate=2, clip=0.05)
    assert len(lit.losses) == STEPS * 2
    assert_same_losses("O2", lit.losses, hand.losses)


class TwoOptimizers(MLP):
    """Manual optimization: each half of the net has its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> object:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.Adam(self.net[2].parameters(), lr=1e-2)]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        first, second = self.optimizers()
        loss = self.loss(batch, batch_idx)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_manual_optimization_with_two_optimizers(level: str) -> None:
    torch.manual_seed(0)
    lit = TwoOptimizers()
    trainer(level, steps=2 * STEPS).fit(lit, data())  # Lightning counts each optimizer's steps
    torch.manual_seed(0)
    hand = TwoOptimizers()
    opts = hand.configure_optimizers()
    hand, opts = amp.initialize(hand, opts, opt_level=level, half_dtype=BF16, verbosity=0)
    for i, batch in enumerate(data()):
        loss = hand.loss(batch, i)
        with amp.scale_loss(loss, opts) as scaled:
            scaled.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    amp.deinitialize()
    assert_same_losses(level, lit.losses, hand.losses)


class Snapshot(L.Callback):
    """Copies masters, optimizer state and loss scaler at step `at` (after its optimizer
    step), or once training starts after a resume (`at=None`); saves a checkpoint there."""

    def __init__(self, at: int | None, path: Path | None = None) -> None:
        self.at, self.path, self.taken = at, path, None

    def take(self, trainer: L.Trainer) -> None:
        opt = trainer.optimizers[0]
        state = opt.state_dict()
        self.taken = {"masters": [p.detach().clone() for p in amp.master_params(opt)],
                      "momentum": [s["momentum_buffer"].clone() for s in state["state"].values()],
                      "scaler": amp.state_dict(), "lr": opt.param_groups[0]["lr"],
                      "dtype": next(trainer.lightning_module.parameters()).dtype}

    def on_train_batch_end(self, trainer: L.Trainer, module: object, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if self.at is not None and trainer.global_step == self.at:
            self.take(trainer)
            trainer.save_checkpoint(self.path)

    def on_train_start(self, trainer: L.Trainer, module: object) -> None:
        if self.at is None:
            self.take(trainer)


def test_resume_restores_masters_optimizer_state_and_loss_scaler(tmp_path: Path) -> None:
    ckpt = tmp_path / "step2.ckpt"
    torch.manual_seed(0)
    before = Snapshot(at=2, path=ckpt)
    plugin = AmpatchPrecision("O2", half_dtype=torch.float16, verbosity=0)  # a dynamic loss scale
    lit = MLP(inf_at=0, scheduler=True)  # the first step overflows: the scale is not the initial one
    trainer("O2", plugin=plugin, callbacks=[before]).fit(lit, data())
    assert before.taken["scaler"]["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    torch.manual_seed(1)
    after = Snapshot(at=None)
    trainer("O2", plugin=AmpatchPrecision("O2", half_dtype=torch.float16, verbosity=0), callbacks=[after]).fit(
        MLP(inf_at=0, scheduler=True), data(), ckpt_path=ckpt)
    assert after.taken["dtype"] == torch.float16
    assert after.taken["scaler"] == before.taken["scaler"]
    assert after.taken["lr"] == before.taken["lr"] == 0.05  # two steps, the first skipped
    for key in ("masters", "momentum"):
        assert len(after.taken[key]) == len(before.taken[key]) > 0
        for a, b in zip(after.taken[key], before.taken[key]):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_teardown_undoes_everything() -> None:
    lit = MLP(scheduler=True)
    fit = trainer("O2")
    fit.fit(lit, data())
    opt, sched = fit.optimizers[0], fit.lr_scheduler_configs[0].scheduler
    assert all(p.dtype == torch.float32 for p in lit.parameters())
    assert "zero_grad" not in vars(opt) and "state_dict" not in vars(opt)  # (step: the scheduler's own)
    assert "step" not in vars(sched)
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], lit.parameters()))
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        amp.loss_scale()
    kept = fit.strategy.precision_plugin.last_report  # the session's report, kept past teardown
    assert kept.opt_level == "O2" and kept.steps == fit.global_step > 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="passes the model"):
        AmpatchPrecision("O2", optimizers=[])
    with pytest.raises(TypeError, match="level name"):
        AmpatchPrecision(2)


def test_lbfgs_is_refused_at_set_up_before_anything_changes() -> None:
    """LBFGS runs its closure's backward inside step(), out of the loss scale's reach: refused in
    connect, before a forward, and with no session left behind."""
    model = nn.Linear(4, 2)
    plugin = AmpatchPrecision("O2")
    with pytest.raises(TypeError, match="cannot drive LBFGS"):
        plugin.connect(model, [torch.optim.LBFGS(model.parameters())], [])
    assert live_session() is None and model.weight.dtype == torch.float32


def test_importing_ampatch_imports_neither_lightning_nor_transformers() -> None:
    code = ("import sys, ampatch, ampatch.cli; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.distributed
def test_ddp_on_two_cpu_processes_keeps_ranks_identical(tmp_path: Path) -> None:
    worker = Path(__file__).resolve().parents[1] / "_lightning_ddp_worker.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(worker), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["world"] == ranks[1]["world"] == 2
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank saw its own batches
    for key in ("masters", "params"):
        assert len(ranks[0][key]) > 0
        for a, b in zip(ranks[0][key], ranks[1][key]):
            assert torch.equal(a, b), key
    assert ranks[0]["masters"][0].dtype == torch.float32 and ranks[0]["params"][0].dtype == torch.bfloat16


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_mlp.py"


def test_the_example_runs(capsys: pytest.CaptureFixture) -> None:
    """In-process (the imports are paid already); compare/diagnose below run it as a script."""
    spec = importlib.util.spec_from_file_location("ampatch_example_{}".format(EXAMPLE.stem), EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss = module.main(["--steps", "3", "--opt-level", "O5"])
    out = capsys.readouterr().out
    assert "final loss" in out and "(O5, 3 steps)" in out and loss == loss


@pytest.mark.slow
def test_compare_runs_the_unmodified_example_at_each_level(capfd: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the command through cli.main in this process (tests/_cli.py), the example its runs' child process
    done = ampatch_main(capfd, monkeypatch, "compare", "--levels", "O0,O2", "--", sys.executable, str(EXAMPLE),
                        "--steps", "4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line[:2] in ("O0", "O2")}
    assert rows["O0"][1] == "-" and rows["O2"][1] == "bfloat16"  # the level forced from outside
    assert rows["O0"][-1] == rows["O2"][-1] == "4"  # steps


def test_policy_reaches_initialize(monkeypatch: pytest.MonkeyPatch) -> None:
    """`policy=` (ampatch tune's file) goes to amp.initialize, only when given."""
    seen = []
    real = amp.initialize

    def initialize(*args: object, **kwargs: object) -> object:
        seen.append(kwargs.pop("policy", None))
        return real(*args, **kwargs)

    monkeypatch.setattr(amp, "initialize", initialize)
    trainer("O2", steps=1, plugin=AmpatchPrecision("O2", policy="tuned.json", verbosity=0)).fit(MLP(), data())
    trainer("O2", steps=1, plugin=AmpatchPrecision("O2", verbosity=0)).fit(MLP(), data())
    assert seen == ["tuned.json", None]
