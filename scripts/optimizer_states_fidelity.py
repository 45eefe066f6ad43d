#!/usr/bin/env python3
"""Does a fine-tune with optimizer_states "bfloat16" / "int8" train like FP32 state? The table of
docs/optimizer_states.md (issue 46), on CPU.

Two fine-tunes, each at each learning rate of `--lrs` (1e-5 to 1e-3), every run from the same
start on the same batches, AdamW:
- the tune grid's family (scripts/tune_grid.py: a wide MLP with LayerNorms at a trained
  model's scale, fine-tuned toward the same network with its head shifted, targets with noise
  9x the learnable loss): what counts is the learnable loss, the error against the
  noiseless teacher on 4096 held-out inputs;
- a 2-layer `LlamaForCausalLM` (from a `LlamaConfig`, no download) pretrained here on the
  first half of the package's corpus (characters as tokens), then fine-tuned on the second
  half: what counts is the loss on held-out text of the second half.
Rows: O0 (the reference), O0 and O5 with FP32 state (the optimizer's own), "bfloat16" and
"int8" state, O5 + "stochastic" + "int8", and torchao's `AdamW8bit` at O0 as a reference
(block-wise 8-bit state as bitsandbytes keeps it; on CPU it runs through torch.compile).
Each figure: (its held-out loss - O0's) / (what O0's run gained): 0 trains as O0 does,
+1% ends 1% of O0's progress behind it. The column "vs own FP32" is the same against the
run's own level with FP32 state (what optimizer_states changes).

    python scripts/optimizer_states_fidelity.py                       # both families, 3 lrs
    python scripts/optimizer_states_fidelity.py --only grid --steps 100 --no-torchao
"""
from __future__ import annotations

import argparse
import datetime
import importlib.resources
import json
import math
import time

import torch
from torch import nn
from tune_grid import D_IN, pretrained  # this directory's: the tune grid's network and its start

import ampatch as amp

# label -> (level, initialize keywords); "torchao" is torchao's AdamW8bit at O0
CONFIGS = {"O0": ("O0", {}), "O0 bfloat16": ("O0", {"optimizer_states": "bfloat16"}),
           "O0 int8": ("O0", {"optimizer_states": "int8"}), "O0 torchao AdamW8bit": ("O0", {}),
           "O5": ("O5", {}), "O5 bfloat16": ("O5", {"optimizer_states": "bfloat16"}),
           "O5 int8": ("O5", {"optimizer_states": "int8"}),
           "O5 stochastic+int8": ("O5", {"master_weights": "stochastic", "optimizer_states": "int8"})}
D_OUT, BATCH, EVAL, NOISE = 256, 512, 4096, 9.0


class Grid:
    """One case of the tune grid's family (AdamW, noise 9x)."""

    name = "tune grid family (MLP 32-256-256-256, AdamW)"

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.teacher = pretrained(0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            self.teacher.head.weight.add_(0.1 * torch.randn(self.teacher.head.weight.shape, generator=gen))
            self.x_eval = torch.randn(EVAL, D_IN, generator=gen)
            self.y_eval = self.teacher(self.x_eval)
            self.sigma = math.sqrt(NOISE * float(((pretrained(0)(self.x_eval) - self.y_eval) ** 2).mean()))

    def model(self) -> nn.Module:
        return pretrained(0)

    def batches(self):
        gen = torch.Generator().manual_seed(2)
        for _ in range(self.steps):
            x = torch.randn(BATCH, D_IN, generator=gen)
            with torch.no_grad():
                y = self.teacher(x) + self.sigma * torch.randn(BATCH, D_OUT, generator=gen)
            yield lambda model, x=x, y=y: nn.functional.mse_loss(model(x).float(), y)

    def held_out(self, model: nn.Module) -> float:
        with torch.no_grad(), amp.disable_casts():
            return float(((model.float()(self.x_eval) - self.y_eval) ** 2).mean())


class Llama:
    """A 2-layer LlamaForCausalLM, pretrained on the corpus's first half, fine-tuned on its second."""

    name = "Transformers LlamaForCausalLM (2 layers, hidden 128), pretrained here, fine-tuned on new text"
    SEQ, BATCH, PRETRAIN_STEPS = 64, 16, 150

    def __init__(self, steps: int) -> None:
        import transformers
        self.steps = steps
        text = (importlib.resources.files("ampatch.workloads") / "data" / "corpus.txt").read_text()
        chars = sorted(set(text))
        ids = torch.tensor([chars.index(c) for c in text])
        half = len(ids) // 2
        self.first, tune = ids[:half], ids[half:]
        cut = int(len(tune) * 0.8)
        self.tune, self.held = tune[:cut], tune[cut:]
        self.config = transformers.LlamaConfig(vocab_size=len(chars), hidden_size=128, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                               max_position_embeddings=self.SEQ)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(self.config)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        for ids_ in self._draw(self.first, self.PRETRAIN_STEPS, seed=3):
            opt.zero_grad()
            model(input_ids=ids_, labels=ids_).loss.backward()
            opt.step()
        self.start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gen = torch.Generator().manual_seed(5)
        starts = torch.arange(0, len(self.held) - self.SEQ - 1, self.SEQ)
        self.eval_ids = torch.stack([self.held[s:s + self.SEQ] for s in starts.tolist()])
        del gen

    def _draw(self, ids: torch.Tensor, steps: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - self.SEQ - 1, (self.BATCH,), generator=gen)
            yield torch.stack([ids[s:s + self.SEQ] for s in starts.tolist()])

    def model(self) -> nn.Module:
        import transformers
        model = transformers.LlamaForCausalLM(self.config)
        model.load_state_dict(self.start)
        return model

    def batches(self):
        for ids in self._draw(self.tune, self.steps, seed=4):
            yield lambda model, ids=ids: model(input_ids=ids, labels=ids).loss

    def held_out(self, model: nn.Module) -> float:
        model = model.float().eval()
        with torch.no_grad(), amp.disable_casts():
            return float(model(input_ids=self.eval_ids, labels=self.eval_ids).loss)


def run(family, label: str, lr: float) -> tuple[float, float]:
    """(held-out loss after the fine-tune, median step seconds) of one configuration."""
    level, kw = CONFIGS[label]
    model = family.model()
    if "torchao" in label:
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(model.parameters(), lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    model.train()
    times = []
    for loss_of in family.batches():
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    amp.deinitialize()
    times.sort()
    return family.held_out(model), times[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lrs", default="1e-5,1e-4,1e-3")
    p.add_argument("--only", choices=("grid", "llama"))
    p.add_argument("--no-torchao", action="store_true", help="leave torchao's AdamW8bit out (it compiles on CPU)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    labels = [c for c in CONFIGS if not (a.no_torchao and "torchao" in c)]
    print(f"optimizer_states fidelity, torch {torch.__version__}, {a.steps} fine-tuning steps, {a.threads} thread(s), "
          f"{datetime.date.today()}: (held-out loss - O0's) / O0's progress; 'vs own FP32': against the same level "
          "with FP32 state")
    out: dict[str, dict] = {}
    families = [f for f in (("grid", Grid), ("llama", Llama)) if a.only in (None, f[0])]
    for key, cls in families:
        family = cls(a.steps)
        print(f"\n{family.name}")
        print(f"  {'lr':>6} {'run':<22} {'held-out':>9} {'vs O0':>8} {'vs own FP32':>12} {'step ms':>8}")
        for lr in (float(x) for x in a.lrs.split(",")):
            start = family.held_out(family.model())
            results = {}
            for label in labels:
                try:
                    results[label] = run(family, label, lr)
                except Exception as exc:  # torchao's compile, say: a row that says why
                    print(f"  {lr:6.0e} {label:<22} failed: {type(exc).__name__}: {str(exc)[:80]}")
            o0 = results["O0"][0]
            progress = start - o0
            for label, (loss, step_s) in results.items():
                own = results["O0" if CONFIGS[label][0] == "O0" else "O5"][0]
                print(f"  {lr:6.0e} {label:<22} {loss:9.5f} {(loss - o0) / progress:+8.2%} "
                      f"{(loss - own) / progress:+12.2%} {step_s * 1e3:8.1f}")
            print(f"  {lr:6.0e} (start {start:.5f}, O0's progress {progress:.5f})")
            per_level = {k: {"held_out": v[0], "step_s": v[1]} for k, v in results.items()}
            out.setdefault(key, {})[f"{lr:g}"] = {"start": start, "progress": progress, **per_level}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
