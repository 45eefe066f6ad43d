"""Hugging Face Transformers: ampatch's opt levels as a drop-in `Trainer`.

`AmpatchTrainer(..., opt_level="O2")` is `transformers.Trainer` with half weights, FP32
master weights and a dynamic loss scale (O2/O5), or any other level. Leave
`TrainingArguments(fp16=..., bf16=...)` off: the opt level is the precision. A tiny GPT-2
with random weights learns a toy sequence task here (no downloads).

    pip install 'ampatch[integrations]'
    python examples/hf_trainer.py --opt-level O2 --steps 30
    ampatch compare --levels O0,O2,O5 -- python examples/hf_trainer.py --steps 30
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import ampatch as amp  # noqa: E402
from ampatch.huggingface import AmpatchTrainer  # noqa: E402


class Level(transformers.TrainerCallback):
    """Notes the level that ran (`ampatch run/compare` may force one)."""
    level = "?"

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.level = amp.report().opt_level


def dataset(n: int, seq: int = 16, vocab: int = 64) -> list[dict[str, torch.Tensor]]:
    """Counting sequences (each token is the previous one plus one): easy to learn."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    ids = (start + torch.arange(seq)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_warning()
    logging.getLogger("accelerate").setLevel(logging.WARNING)

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=16, learning_rate=3e-3,
            warmup_steps=2, max_grad_norm=1.0, report_to="none", use_cpu=True, save_strategy="no",
            logging_strategy="no", disable_tqdm=True, seed=0)
        trainer = AmpatchTrainer(model=model, args=training, train_dataset=dataset(16 * args.steps),
                                 opt_level=args.opt_level, callbacks=[level := Level()])
        result = trainer.train()
    loss = result.training_loss
    print(f"final loss {loss:.4f}  ({level.level}, mean over {result.global_step} steps)")
    return loss


if __name__ == "__main__":
    main()
