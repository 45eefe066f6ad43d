"""Shared pieces of the built-in workloads: arguments, corpus, and the amp training loop."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from importlib import resources

import torch

import ampatch as amp
from ampatch import workloads
from ampatch.base.dtypes import HALF_NAMES
from ampatch.config.values import LOW_MEMORY_MODES

log = logging.getLogger("ampatch.workloads")

Batch = tuple[torch.Tensor, torch.Tensor]
MIN_STEPS = workloads.MIN_STEPS
EXIT_MARGIN_S = 0.3  # time kept, before the deadline, for writing the report and exiting


def parse_args(name: str, argv: Sequence[str] | None, default_steps: int) -> argparse.Namespace:
    """The command line every workload accepts."""
    p = argparse.ArgumentParser(prog=f"python -m ampatch.workloads.{name}",
                                description=f"ampatch built-in workload '{name}'.")
    p.add_argument("--steps", type=int, default=default_steps, help="optimizer steps to train")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    p.add_argument("--size", choices=workloads.SIZES, default=workloads.DEFAULT_SIZE,
                   help="model and batch size (this module's SIZES table; default %(default)s)")
    p.add_argument("--opt-level", default="O1", help="amp opt level (O0-O5)")
    p.add_argument("--master-weights", choices=LOW_MEMORY_MODES, default=None,
                   help="O2/O3/O5 without FP32 masters: bfloat16 weights rounded stochastically, or with a Kahan "
                        "compensation (default: the level's own master weights)")
    p.add_argument("--half-dtype", choices=HALF_NAMES, default=None,
                   help="half type (default: ampatch's auto choice)")
    p.add_argument("--log-every", type=int, default=0, help="log the loss every N steps")
    p.add_argument("--device", default="auto",
                   help="device to train on: auto (CUDA when available, else CPU), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads (0: torch's default; `ampatch compare` passes 1)")
    p.add_argument("--deadline", type=float, default=None, metavar="EPOCH",
                   help="stop early (after at least %d steps) when the next step would end after this "
                        "time.time() value; `ampatch compare --budget` sets it" % MIN_STEPS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.threads < 0:
        p.error("--threads must be 0 (torch's default) or a positive number")
    try:
        args.device = resolve_device(args.device)
    except (RuntimeError, ValueError) as exc:  # torch.device's message lists the device types
        p.error(f"--device: {exc}")
    return args


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else CPU; anything else as torch.device parses it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_corpus() -> str:
    """The text shipped in ``ampatch/workloads/data/corpus.txt``."""
    return resources.files("ampatch.workloads").joinpath("data/corpus.txt").read_text("ascii")


def encode_corpus() -> tuple[torch.Tensor, int]:
    """The corpus as a tensor of character ids, and the vocabulary size."""
    text = load_corpus()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(vocab)


def text_batches(ids: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[Batch]:
    """Random windows of the corpus: inputs and next-character targets, fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq - 1, (steps, batch), generator=gen)
    offsets = torch.arange(seq + 1)
    windows = ids[starts[..., None] + offsets]          # (steps, batch, seq + 1)
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-character cross entropy over every position."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch],
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          args: argparse.Namespace) -> float:
    """The standard amp loop; returns the last loss. With ``args.deadline`` it stops before
    the step that would end past it (estimated from the last steps), never before MIN_STEPS."""
    half = getattr(torch, args.half_dtype) if args.half_dtype else None
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, half_dtype=half,
                                      master_weights=args.master_weights)
    model.train()
    durations: list[float] = []
    for step, batch in enumerate(batches, start=1):
        if args.deadline is not None and step > MIN_STEPS:
            if time.time() + statistics.median(durations[-5:]) + EXIT_MARGIN_S > args.deadline:
                log.info("time budget reached: stopping after %d of %d steps", step - 1, len(batches))
                break
        start = time.perf_counter()
        loss = train_step(model, optimizer, batch, loss_fn, args.device)
        durations.append(time.perf_counter() - start)
        if args.log_every and (step % args.log_every == 0 or step == len(batches)):
            log.info("step %d/%d loss %.4f", step, len(batches), loss.item())
    return loss.item()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device) -> torch.Tensor:
    """One optimizer step of the standard amp recipe on ``batch``; the loss (not synchronized)."""
    x, y = (t.to(device, non_blocking=True) for t in batch)
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    return loss


def run(name: str, argv: Sequence[str] | None, default_steps: int,
        build: Callable[[argparse.Namespace], tuple[torch.nn.Module, torch.optim.Optimizer,
                                                    list[Batch], Callable]]) -> int:
    """Parse arguments, build model/optimizer/data from the seed, train; the exit code."""
    args = parse_args(name, argv, default_steps)
    if args.log_every:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, optimizer, batches, loss_fn = build(args)
    train(model, optimizer, batches, loss_fn, args)
    return 0
