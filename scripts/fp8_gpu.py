"""FP8 on a GPU with FP8 tensor cores (issue 36): O5+fp8 against O5, both under torch.compile,
on a GPT-2-medium-shaped model; then the real FP8 loss curve against the emulated one.

    python scripts/fp8_gpu.py [--layers 24] [--batch 0] [--steps 12] [--curve-steps 20] [--json PATH]

The model: d_model 1024, 16 heads, MLP 4096, sequence 1024, `--layers` blocks (GPT-2 medium:
24), plain `nn.Linear` layers, causal `scaled_dot_product_attention`, on synthetic tokens
that follow a fixed rule (so the loss falls). `--batch 0` fills the device: one eager O5
step at batch 4 measures the peak memory, and the batch is scaled to about 60% of the
device (a multiple of 4, at most 64). Each block is compiled (`torch.compile` on each, as
torchtitan does: one compilation serves every block), after `amp.initialize`.

Timing: for O5 and O5+fp8 (tensorwise), 3 warm-up steps then `--steps` timed steps; the
median step time, tokens per second, and the speed-up of FP8 (target: at least 1.2x on an
H200). Curves: `--curve-steps` eager steps from the same weights and batches, real FP8
kernels against torchao's emulation (`Float8LinearConfig(emulate=True)`); the largest
relative difference of the two loss curves. Untested on a GPU when written (no device was
lent): run by `scripts/gpu_check.sh`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

D, HEADS, FF, SEQ, VOCAB = 1024, 16, 4096, 1024, 8192


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(n: int, batch: int, seed: int = 1) -> list[torch.Tensor]:
    """Token sequences x[t+1] = (5 x[t] + 3) mod VOCAB from random starts: learnable."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = torch.empty(batch, SEQ + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
        for t in range(SEQ):
            seq[:, t + 1] = (5 * seq[:, t] + 3) % VOCAB
        out.append(seq.cuda(non_blocking=True))
    return out


def session(layers: int, fp8, compile_blocks: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O5", fp8=fp8, verbosity=0)
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, seq: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    logits = model(seq[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, VOCAB), seq[:, 1:].reshape(-1))
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


def fill_batch(layers: int) -> int:
    """A batch of about 60% of the device, from one eager O5 step at batch 4."""
    model, opt = session(layers, None, False)
    torch.cuda.reset_peak_memory_stats()
    step(model, opt, batches(1, 4)[0])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    amp.deinitialize()
    del model, opt
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    return max(4, min(64, int(4 * 0.6 * total / peak) // 4 * 4))


def timed(layers: int, fp8, batch: int, steps: int) -> dict[str, float]:
    torch._dynamo.reset()
    model, opt = session(layers, fp8, True)
    data = batches(3 + steps, batch)
    start = time.perf_counter()
    for seq in data[:3]:
        step(model, opt, seq)
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    times = []
    torch.cuda.reset_peak_memory_stats()
    for seq in data[3:]:
        t0 = time.perf_counter()
        loss = step(model, opt, seq)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    report = amp.report()
    amp.deinitialize()
    median = statistics.median(times)
    return {"step_ms": median * 1e3, "tokens_per_s": batch * SEQ / median, "warmup_s": warm,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30, "final_loss": loss.item(),
            "fp8": report.fp8_label}


def curve(layers: int, fp8, batch: int, n: int) -> list[float]:
    model, opt = session(layers, fp8, False)
    losses = [step(model, opt, seq).item() for seq in batches(n, batch, seed=2)]
    amp.deinitialize()
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=0, help="0: fill the device")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--curve-steps", type=int, default=20)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_gpu: no CUDA device here; nothing to measure")
        return 0
    from ampatch.model import fp8 as fp8_layers
    try:
        float8 = fp8_layers.require()
    except ImportError as exc:
        print(f"fp8_gpu: {exc}")
        return 1
    name = torch.cuda.get_device_name(0)
    cap = torch.cuda.get_device_capability(0)
    real = fp8_layers.has_fp8_kernels("cuda")
    print(f"fp8_gpu: {name} (capability {cap[0]}.{cap[1]}), torch {torch.__version__}, FP8 tensor cores: {real}")
    batch = args.batch or fill_batch(args.layers)
    print(f"model: GPT-2-medium shape, d_model {D}, {args.layers} layers, seq {SEQ}, batch {batch}; "
          "O5, AdamW (fused), each block compiled")
    out: dict[str, object] = {"device": name, "capability": list(cap), "batch": batch, "layers": args.layers}
    rows = {}
    for label, fp8 in (("O5", None), ("O5+fp8:tensorwise", "tensorwise")):
        rows[label] = r = timed(args.layers, fp8, batch, args.steps)
        print(f"  {label:<18} {r['step_ms']:8.1f} ms/step  {r['tokens_per_s']:10.0f} tok/s  peak "
              f"{r['peak_gib']:.1f} GiB  warm-up {r['warmup_s']:.0f}s  {r['fp8']}")
    speedup = rows["O5"]["step_ms"] / rows["O5+fp8:tensorwise"]["step_ms"]
    verdict = "meets" if speedup >= 1.2 else "BELOW"
    print(f"  speed-up of O5+fp8 over O5 (compiled): {speedup:.2f}x ({verdict} the 1.2x target)")
    out.update(timing=rows, speedup=speedup)
    n = args.curve_steps
    emulated_config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    real_curve = curve(args.layers, "tensorwise", min(batch, 8), n)
    emulated_curve = curve(args.layers, emulated_config, min(batch, 8), n)
    gaps = [abs(a - b) / abs(b) for a, b in zip(real_curve, emulated_curve)]
    worst = max(gaps) if gaps else math.nan
    print(f"curves ({n} eager steps, batch {min(batch, 8)}): real FP8 {real_curve[0]:.4f} -> {real_curve[-1]:.4f}, "
          f"emulated {emulated_curve[0]:.4f} -> {emulated_curve[-1]:.4f}; largest relative gap {worst:.2%}")
    out.update(real_curve=real_curve, emulated_curve=emulated_curve, largest_gap=worst)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
