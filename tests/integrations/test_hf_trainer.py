"""ampatch.huggingface.AmpatchTrainer: tiny random GPT-2 and BERT models trained by the
Transformers Trainer at each level give the losses of the hand-written ampatch loop (same
model, seed, data, optimizer): equal where the model is not cast (O0/O1/O4), close where it
is. Also: an overflow skips the step and holds the scheduler, accumulation and clipping act
on the masters, resume_from_checkpoint continues loss for loss (loss scaler included), the
model is FP32 after train(), and fp16=True/bf16=True beside ampatch is refused, as are mixed
precision, DeepSpeed and FSDP switched on through Accelerate's environment; a policy alone
decides the level; load_best_model_at_end gives the best checkpoint's exact masters; an
auto_find_batch_size retry holds the scheduler once."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from _cli import ampatch_main

import ampatch as amp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from ampatch.huggingface import SCALER_FILE, AmpatchTrainer  # noqa: E402

BF16 = torch.bfloat16
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
UNCAST = ("O0", "O1", "O4")
STEPS, BATCH, SEQ, VOCAB = 4, 4, 8, 64


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                     num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def dataset(kind: str, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    if kind == "gpt2":
        return [{"input_ids": row, "labels": row} for row in ids]
    return [{"input_ids": row, "labels": row[0] % 3} for row in ids]


class Recording(AmpatchTrainer):
    """Keeps each micro-batch's loss (before the Trainer divides it for accumulation);
    the loss of micro-batch `inf_at` is made infinite (an overflow)."""

    inf_at: int | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses = getattr(self, "losses", [])
        self.losses.append((out[0] if return_outputs else out).item())
        self.lrs = getattr(self, "lrs", [])
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        if len(self.losses) - 1 == self.inf_at:
            return out * float("inf")
        return out


def arguments(tmp_path: Path, steps: int = STEPS, **kwargs: object) -> transformers.TrainingArguments:
    base = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-2,
                lr_scheduler_type="constant", report_to="none", use_cpu=True, save_strategy="no",
                logging_strategy="no", train_sampling_strategy="sequential", seed=0, disable_tqdm=True,
                dataloader_num_workers=0)
    return transformers.TrainingArguments(**{**base, **kwargs})


def trained(kind: str, level: str, tmp_path: Path, steps: int = STEPS, data: list | None = None,
            initialize_kwargs: dict | None = None, inf_at: int | None = None, **kwargs: object) -> Recording:
    model = gpt2() if kind == "gpt2" else bert()
    accumulate = int(kwargs.get("gradient_accumulation_steps", 1))
    trainer = Recording(model=model, args=arguments(tmp_path, steps, **kwargs), opt_level=level,
                        train_dataset=data or dataset(kind, steps * BATCH * accumulate),
                        initialize_kwargs={"half_dtype": BF16, "verbosity": 0, **(initialize_kwargs or {})})
    trainer.inf_at = inf_at
    trainer.train()
    return trainer


def hand_loop(kind: str, level: str, trainer: Recording, data: list, scheduler: str = "constant",
              inf_at: int | None = None, **init: object) -> tuple[list[float], list[float], torch.nn.Module]:
    """The Trainer's training written out with amp.initialize/scale_loss. The loss is
    normalized as the Trainer does: by the label count of the whole accumulation group
    where the model takes `num_items_in_batch` (GPT-2), else divided by the group size."""
    args = trainer.args
    model = gpt2() if kind == "gpt2" else bert()
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(trainer.get_decay_parameter_names(model))  # the Trainer's two groups, in its order
    named = list(model.named_parameters())
    opt = cls([{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
               {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], **kwargs)
    sched = transformers.get_scheduler(scheduler, opt, num_warmup_steps=0, num_training_steps=args.max_steps)
    model, opt = amp.initialize(model, opt, opt_level=level, **{"half_dtype": BF16, "verbosity": 0, **init})
    model.train()
    losses, lrs, k = [], [], args.gradient_accumulation_steps
    batches = [{key: torch.stack([torch.as_tensor(r[key]) for r in data[i:i + BATCH]]) for key in data[0]}
               for i in range(0, len(data), BATCH)]
    for i, batch in enumerate(batches):
        if trainer.model_accepts_loss_kwargs:
            group = batches[i - i % k:i - i % k + k]
            loss = model(**batch, num_items_in_batch=trainer._get_num_items_in_batch(group, "cpu")).loss
            losses.append(loss.item())
        else:
            loss = model(**batch).loss
            losses.append(loss.item())
            loss = loss / k
        lrs.append(opt.param_groups[0]["lr"])
        if i == inf_at:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if (i + 1) % k:
            continue
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(amp.master_params(opt)), args.max_grad_norm)
        opt.step()
        if not amp.last_step_skipped(opt):
            sched.step()
        model.zero_grad()
    amp.deinitialize()
    return losses, lrs, model


def assert_same(level: str, got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    if level in UNCAST:
        assert got == want
    else:
        assert got[0] == want[0]
        assert got == pytest.approx(want, rel=2e-2)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("level", LEVELS)
def test_losses_match_the_hand_written_loop(kind: str, level: str, tmp_path: Path) -> None:
    trainer = trained(kind, level, tmp_path)
    losses, _, hand = hand_loop(kind, level, trainer, dataset(kind, STEPS * BATCH))
    assert_same(level, trainer.losses, losses)
    params = dict(trainer.model.named_parameters())
    for name, p in hand.named_parameters():  # after train(): FP32 again
        assert params[name].dtype == torch.float32
        if level in UNCAST:
            assert torch.equal(params[name], p), name


def test_an_overflow_skips_the_step_and_holds_the_scheduler(tmp_path: Path) -> None:
    trainer = trained("bert", "O2", tmp_path, inf_at=1, lr_scheduler_type="linear")
    losses, lrs, _ = hand_loop("bert", "O2", trainer, dataset("bert", STEPS * BATCH), scheduler="linear", inf_at=1)
    assert trainer.lrs == lrs == [1e-2, 7.5e-3, 7.5e-3, 5e-3]  # the skipped step did not advance the schedule
    assert_same("O2", trainer.losses, losses)


def test_accumulation_and_clipping_act_on_the_masters(tmp_path: Path) -> None:
    kwargs = {"gradient_accumulation_steps": 2, "max_grad_norm": 0.05}
    trainer = trained("gpt2", "O2", tmp_path, **kwargs)
    losses, _, _ = hand_loop("gpt2", "O2", trainer, dataset("gpt2", STEPS * BATCH * 2))
    assert len(losses) == 2 * STEPS
    assert_same("O2", trainer.losses, losses)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_resume_from_checkpoint_continues_loss_for_loss(level: str, tmp_path: Path) -> None:
    init = {"half_dtype": torch.float16} if level == "O2" else {}
    kwargs = {"save_strategy": "steps", "save_steps": 3, "lr_scheduler_type": "linear"}
    whole = trained("gpt2", level, tmp_path / "whole", steps=6, initialize_kwargs=init, **kwargs)
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / SCALER_FILE).is_file()
    saved = torch.load(checkpoint / SCALER_FILE, weights_only=True)
    assert saved["loss_scaler0"]["loss_scale"] == (65536.0 if level == "O2" else 1.0)
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "float32"  # saved mid-run, cast
    model = gpt2()
    resumed = Recording(model=model, args=arguments(tmp_path / "resumed", 6, **kwargs), opt_level=level,
                        train_dataset=dataset("gpt2", 6 * BATCH),
                        initialize_kwargs={"half_dtype": BF16, "verbosity": 0, **init})
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.losses == whole.losses[3:]
    for (name, a), b in zip(resumed.model.named_parameters(), whole.model.parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


def test_save_model_writes_the_fp32_model(tmp_path: Path) -> None:
    trainer = trained("gpt2", "O2", tmp_path, steps=2)
    assert trainer.ampatch_report.opt_level == "O2" and trainer.ampatch_report.steps == 2  # kept past train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final")
    assert loaded.dtype == torch.float32
    for (name, a), b in zip(loaded.named_parameters(), trainer.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_trainer_mixed_precision_beside_ampatch_is_refused(flag: str, tmp_path: Path) -> None:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                          **({flag: True} if flag == "bf16" else {}))
    if flag == "fp16":  # TrainingArguments itself refuses fp16 on CPU: set it after
        args.fp16 = True
    with pytest.raises(ValueError, match="two AMPs at once"):
        AmpatchTrainer(model=gpt2(), args=args, opt_level="O2")
    with pytest.raises(TypeError, match="among amp.initialize.s keywords"):
        AmpatchTrainer(model=gpt2(), args=arguments(tmp_path), initialize_kwargs={"optimizers": None})


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"


def test_the_example_runs(capsys: pytest.CaptureFixture) -> None:
    """In-process (the imports are paid already); compare/diagnose below run it as a script."""
    spec = importlib.util.spec_from_file_location("ampatch_example_{}".format(EXAMPLE.stem), EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss = module.main(["--steps", "2", "--opt-level", "O5"])
    out = capsys.readouterr().out
    assert "final loss" in out and "(O5, mean over 2 steps)" in out and loss == loss


@pytest.mark.slow
def test_diagnose_runs_the_unmodified_example(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # the command through cli.main in this process (tests/_cli.py), the example its runs' child process
    done = ampatch_main(capfd, monkeypatch, "diagnose", "--opt-level", "O2", "--steps", "2", "--", sys.executable,
                        str(EXAMPLE), "--steps", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "level O2, half dtype bfloat16, 2 optimizer steps recorded" in done.stdout
    assert "transformer.h.0.mlp.c_fc" in done.stdout  # the GPT-2's own modules were diagnosed


def accelerator(mixed_precision: str) -> object:
    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(True)  # one process, one state: tests set their own
    return accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True)


def test_accelerate_recipe_initialize_then_prepare() -> None:
    """docs/integrations.md: Accelerator(mixed_precision="no"), amp.initialize on the bare
    model and optimizer, then prepare; the same losses as the loop without Accelerate."""
    data = dataset("gpt2", STEPS * BATCH)
    batches = [{k: torch.stack([r[k] for r in data[i:i + BATCH]]) for k in data[0]} for i in range(0, len(data), BATCH)]
    runs = []
    for use_accelerate in (True, False):
        model = gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
        stepper, loader = optimizer, batches
        if use_accelerate:
            acc = accelerator("no")
            model, stepper, loader = acc.prepare(model, optimizer, torch.utils.data.DataLoader(
                data, batch_size=BATCH))
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            with amp.scale_loss(loss, optimizer) as scaled:  # the initialized optimizer, not the wrapper
                (acc.backward if use_accelerate else torch.Tensor.backward)(scaled)
            stepper.step()
            stepper.zero_grad()
            losses.append(loss.item())
        amp.deinitialize()
        runs.append(losses)
    assert runs[0] == runs[1] and len(runs[0]) == STEPS


def test_accelerate_mixed_precision_or_a_prepared_optimizer_is_refused() -> None:
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, prepared = accelerator("bf16").prepare(model, optimizer)
    with pytest.raises(ValueError, match="two mixed-precision schemes at once"):
        amp.initialize(model, optimizer, opt_level="O2")
    with pytest.raises(ValueError, match="call amp.initialize on the bare model and optimizer first"):
        amp.initialize(gpt2(), prepared, opt_level="O2")
    accelerator("no")


def test_policy_reaches_initialize(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`policy=` (ampatch tune's file) goes to amp.initialize, only when given."""
    seen = []
    real = amp.initialize

    def initialize(*args: object, **kwargs: object) -> object:
        seen.append(kwargs.pop("policy", None))
        return real(*args, **kwargs)

    monkeypatch.setattr(amp, "initialize", initialize)
    for policy in ("tuned.json", None):
        AmpatchTrainer(model=gpt2(), args=arguments(tmp_path, 1), train_dataset=dataset("gpt2", BATCH),
                       opt_level="O2", policy=policy).train()
    assert seen == ["tuned.json", None]


# ------------------------------------------------------------------ the level, the environment, the best model
class Level(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.levels: list[str] = []

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.levels.append(amp.report().opt_level)


@pytest.mark.parametrize("policy,level", [({"opt_level": "O1", "half_dtype": "bfloat16"}, "O1"),
                                          ({"opt_level": "O0"}, "O0"), (None, "O2")])
def test_a_policy_alone_decides_the_level(policy: dict | None, level: str, tmp_path: Path) -> None:
    seen = Level()
    AmpatchTrainer(model=gpt2(), args=arguments(tmp_path, 1), train_dataset=dataset("gpt2", BATCH), policy=policy,
                   initialize_kwargs={"verbosity": 0}, callbacks=[seen]).train()
    assert seen.levels == [level]


@pytest.mark.parametrize("name,value,what", [("ACCELERATE_MIXED_PRECISION", "bf16", "two AMPs at once"),
                                             ("ACCELERATE_USE_DEEPSPEED", "true", "DeepSpeed"),
                                             ("ACCELERATE_USE_FSDP", "true", "FSDP")])
def test_accelerate_switches_from_the_environment_are_refused(name: str, value: str, what: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`accelerate launch --mixed_precision bf16 / --use_deepspeed / --use_fsdp` sets these."""
    args = arguments(tmp_path)  # made before: TrainingArguments itself would set DeepSpeed up (not installed)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}={value}.*{what}.*Unset it"):
        AmpatchTrainer(model=gpt2(), args=args)


def test_mixed_precision_read_into_the_arguments_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = arguments(tmp_path)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    with pytest.raises(ValueError, match="mixed_precision='bf16'.*ACCELERATE_MIXED_PRECISION"):
        AmpatchTrainer(model=gpt2(), args=args)


def test_what_the_accelerator_turned_on_is_refused() -> None:
    from types import SimpleNamespace

    from ampatch.huggingface import check_accelerator

    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        check_accelerator(SimpleNamespace(accelerator=SimpleNamespace(mixed_precision="fp16")))
    with pytest.raises(ValueError, match="DeepSpeed or FSDP"):
        check_accelerator(SimpleNamespace(accelerator=SimpleNamespace(mixed_precision="no"), is_fsdp_enabled=True))


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_load_best_model_at_end_restores_the_exact_masters(level: str, tmp_path: Path) -> None:
    """The first evaluation scores best (a score that falls with every evaluation): the model
    after train() is checkpoint-2's FP32 masters, not its half weights cast up."""
    from ampatch.optim.masters import MASTERS_KEY

    calls = []

    def score(pred: transformers.EvalPrediction) -> dict[str, float]:
        calls.append(1)
        return {"score": -float(len(calls))}

    args = arguments(tmp_path, 6, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True,
                     per_device_eval_batch_size=BATCH)
    trainer = AmpatchTrainer(model=gpt2(), args=args, train_dataset=dataset("gpt2", 6 * BATCH),
                             eval_dataset=dataset("gpt2", BATCH), compute_metrics=score, opt_level=level,
                             initialize_kwargs={"half_dtype": BF16, "verbosity": 0})
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2") and len(calls) == 3
    saved = torch.load(Path(trainer.state.best_model_checkpoint) / "optimizer.pt", weights_only=True)[MASTERS_KEY]
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert len(saved) == len(params) and all(m is not None for m in saved)
    for p, m in zip(params, saved):
        assert p.dtype == torch.float32 and torch.equal(p, m)
    assert any(not torch.equal(m, m.to(BF16).float()) for m in saved)  # exact values, not half ones


def test_auto_find_batch_size_retries_hold_the_scheduler_once(tmp_path: Path) -> None:
    """An out-of-memory error makes the Trainer run its loop again with half the batch; a
    scheduler passed in is asked for again (it was held twice: "already patched")."""
    class OutOfMemoryOnce(AmpatchTrainer):
        raised = False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            if not self.raised:
                self.raised = True
                raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = OutOfMemoryOnce(model=model, args=arguments(tmp_path, 2, auto_find_batch_size=True),
                              train_dataset=dataset("gpt2", 4 * BATCH), optimizers=(opt, sched),
                              initialize_kwargs={"half_dtype": BF16, "verbosity": 0})
    result = trainer.train()
    assert trainer.raised and result.global_step == 2 and trainer._train_batch_size < BATCH
    assert "step" not in vars(sched)  # released after train()
