"""AmpatchTrainerMixin on a Trainer subclass users already have: `Seq2SeqTrainer` training a
tiny T5 built from its config (no downloads) gives the losses of the hand-written ampatch
loop at every level, and generates during evaluation at O2; the mixin refuses to sit after
the Trainer in the class's bases."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import ampatch as amp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from ampatch.huggingface import AmpatchTrainerMixin  # noqa: E402

BF16 = torch.bfloat16
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
UNCAST = ("O0", "O1", "O4")
STEPS, BATCH, SRC, TGT, VOCAB = 3, 4, 8, 5, 64


def t5() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config)


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    source = torch.randint(2, VOCAB, (n, SRC), generator=g)
    return [{"input_ids": row, "labels": (row[:TGT] + 1) % VOCAB} for row in source]  # a learnable mapping


class MySeq2SeqTrainer(AmpatchTrainerMixin, transformers.Seq2SeqTrainer):
    """A user's Seq2SeqTrainer with ampatch mixed in; it keeps each step's loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses = getattr(self, "losses", [])
        self.losses.append((out[0] if return_outputs else out).item())
        return out


def arguments(tmp_path: Path, **kwargs: object) -> transformers.Seq2SeqTrainingArguments:
    base = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
                lr_scheduler_type="constant", report_to="none", use_cpu=True, save_strategy="no",
                logging_strategy="no", train_sampling_strategy="sequential", seed=0, disable_tqdm=True,
                dataloader_num_workers=0)
    return transformers.Seq2SeqTrainingArguments(**{**base, **kwargs})


def hand_loop(level: str, trainer: MySeq2SeqTrainer) -> list[float]:
    """The Trainer's training written out (its optimizer groups, clipping, scheduler)."""
    args = trainer.args
    model = t5()
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(trainer.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    opt = cls([{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
               {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], **kwargs)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=BF16, verbosity=0)
    model.train()
    data = dataset(STEPS * BATCH)
    losses = []
    for i in range(0, len(data), BATCH):
        batch = {k: torch.stack([r[k] for r in data[i:i + BATCH]]) for k in data[0]}
        loss = model(**batch).loss
        losses.append(loss.item())
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(list(amp.master_params(opt)), args.max_grad_norm)
        opt.step()
        model.zero_grad()
    amp.deinitialize()
    return losses


@pytest.mark.parametrize("level", LEVELS)
def test_seq2seq_trainer_subclass_matches_the_hand_loop(level: str, tmp_path: Path) -> None:
    trainer = MySeq2SeqTrainer(model=t5(), args=arguments(tmp_path), train_dataset=dataset(STEPS * BATCH),
                               opt_level=level, initialize_kwargs={"half_dtype": BF16, "verbosity": 0})
    trainer.train()
    want = hand_loop(level, trainer)
    assert all(math.isfinite(v) for v in trainer.losses) and len(trainer.losses) == STEPS
    if level in UNCAST:
        assert trainer.losses == want
    else:
        assert trainer.losses[0] == want[0] and trainer.losses == pytest.approx(want, rel=2e-2)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # undone after train()


def test_generation_during_evaluation_at_o2(tmp_path: Path) -> None:
    """predict_with_generate inside train(): generate runs on the cast model."""
    seen = []

    def metrics(pred: transformers.EvalPrediction) -> dict[str, float]:
        seen.append(pred.predictions)
        return {"count": float(len(pred.predictions))}

    args = arguments(tmp_path, eval_strategy="steps", eval_steps=STEPS, predict_with_generate=True,
                     generation_max_length=TGT + 1, per_device_eval_batch_size=BATCH)
    trainer = MySeq2SeqTrainer(model=t5(), args=args, train_dataset=dataset(STEPS * BATCH),
                               eval_dataset=dataset(BATCH), compute_metrics=metrics, opt_level="O2",
                               initialize_kwargs={"half_dtype": BF16, "verbosity": 0})
    trainer.train()
    assert len(seen) == 1 and seen[0].shape[0] == BATCH
    assert seen[0].dtype.kind == "i"  # token ids


def test_the_mixin_goes_before_the_trainer() -> None:
    with pytest.raises(TypeError, match="AmpatchTrainerMixin goes first"):
        class Wrong(transformers.Seq2SeqTrainer, AmpatchTrainerMixin):  # the Trainer's methods would hide it
            pass
