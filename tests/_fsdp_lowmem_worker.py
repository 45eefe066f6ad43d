"""One rank of the FSDP2 runs behind tests/model/test_sharded_lowmem.py: master_weights
"stochastic" and "kahan" on `fully_shard` models.

    python tests/_fsdp_lowmem_worker.py RANK WORLD RDZV_FILE OUT_FILE [SCENARIOS [DIR]]

The protocol of tests/_ranks.py: a gloo group through `file://RDZV_FILE`, the scenarios
named (comma-separated; all by default) in turn, a dict {scenario: results} saved to
OUT_FILE, `os._exit`. DIR, shared by the runs of one test, holds the checkpoints that a run
on one world size writes and a run on another reads. A scenario's exception is saved as its
{"error": traceback}.

The model is a small MLP sharded the documented way (fully_shard on each layer, then the
root; then the optimizer; then amp.initialize); each rank trains on its own data, and a
run on one rank trains on what both ranks would have (the same global batch).
"""
from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import same
from torch import nn
from torch.distributed.fsdp import fully_shard

import ampatch as amp
from ampatch.session.session import current

MODES = ("stochastic", "kahan")
STEPS = 6
WIDTH = 48  # 48 x 48 weights: 2304 elements, 24 rows a rank


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.fc3 = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def shard(model: nn.Module, mesh: Any = None) -> nn.Module:
    kw = {} if mesh is None else {"mesh": mesh}
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9),
}


def build(mode: str | None, opt: str = "adamw", seed: int = 0, level: str = "O5", mesh: Any = None,
          chunk: int | None = 512, **kw: Any):
    """The sharded model, its optimizer, initialized with `mode` (None: `level` as it is).
    `chunk`: the low-memory step's chunk size (elements): small, so parameters step in slices."""
    torch.manual_seed(seed)
    model = shard(Net(), mesh)
    optimizer = OPTIMIZERS[opt](model.parameters())
    extra = {} if mode is None else {"master_weights": mode}
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0, **extra, **kw)
    if mode is not None and chunk is not None:
        current().optimizers[0].masters.chunk_numel = chunk
    return model, optimizer


def global_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches of 2 x 8 samples: a learnable regression task."""
    gen = torch.Generator().manual_seed(1000 * seed)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(n):
        x = torch.randn(16, 16, generator=gen)
        out.append((x, x @ w))
    return out


def my_batches(n: int, rank: int, world: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's part of each global batch (all of it on one rank)."""
    size = 16 // world
    return [(x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]) for x, y in global_batches(n, seed)]


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters, gathered from every rank (model.state_dict(): FP32)."""
    return {k: v.full_tensor().detach().clone() if hasattr(v, "full_tensor") else v.detach().clone()
            for k, v in model.state_dict().items()}


def live(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live sharded params, gathered, in their own dtype."""
    return {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list, clip: float | None = None,
          inject: int | None = None, rank: int = 0) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if step == inject and rank == 1:
                with torch.no_grad():
                    model.fc2.weight.grad.to_local()[0, 0] = float("inf")
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip).full_tensor()))
        opt.step()
        losses.append(mean_over_ranks(float(loss.detach())))
    return losses


norms: list[float] = []


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t / dist.get_world_size())


def lowmem():
    return current().optimizers[0].masters


# ----------------------------------------------------------------------------- scenarios
def trains(rank: int, world: int, mode: str, opt: str) -> dict[str, Any]:
    """STEPS steps: what the mode did to the sharded model, the optimizer and the report."""
    model, optimizer = build(mode, opt)
    data = my_batches(STEPS + 1, rank, world)
    x, y = data[-1]
    before = mean_over_ranks(float(F.mse_loss(model(x), y)))
    losses = train(model, optimizer, data[:-1])
    after = mean_over_ranks(float(F.mse_loss(model(x), y)))
    m = lowmem()
    out = {"losses": losses, "eval": (before, after), "live": live(model),
           "sharded_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
           "param_types": sorted({type(p).__name__ for p in model.parameters()}),
           "state": sorted({f"{k}:{type(v).__name__}:{v.dtype}" for st in optimizer.state.values()
                            for k, v in st.items() if torch.is_tensor(v) and k != "step"}),
           "comp_shapes": sorted({str(tuple(c.shape) == tuple(p.to_local().shape)) for p in model.parameters()
                                  for c in [m.comp.get(id(p))] if c is not None}),
           "master_types": sorted({f"{type(p).__name__}:{p.dtype}" for p in amp.master_params(optimizer)}),
           "report": amp.report().to_dict(),
           "local_numel": sum(p.to_local().numel() for p in model.parameters()),
           "state_keys": sorted(optimizer.state_dict()["state"][0]),
           "group_keys": sorted(optimizer.state_dict()["param_groups"][0])}
    weights = {k: p.to_local().float() + (m.comp[id(p)].float() if id(p) in m.comp else 0)
               for k, p in model.named_parameters()}
    amp.deinitialize()
    out["restored"] = all(torch.equal(p.to_local(), weights[k]) for k, p in model.named_parameters())
    out["restored_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    out["after_deinit_losses"] = [float(F.mse_loss(model(x), y))]  # plain FSDP2 trains on
    return out


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's weights, compensations, optimizer state and rounding state, copied."""
    m = lowmem()
    return {"weights": [p.to_local().clone() for p in model.parameters()],
            "comp": [c.clone() for c in m.comp.values()],
            "state": [{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items()}
                      for st in opt.state.values()],
            "rounding": (m.seed, m.rounds)}


def replicas(rank: int, world: int, mode: str) -> dict[str, Any]:
    """HSDP: each rank a replica of the whole model (mesh: 2 replicas x 1 shard). Each trains
    on its own data; the gradients are averaged, so the ranks stay identical only if they
    round each element alike."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model, opt = build(mode, mesh=mesh)
    train(model, opt, my_batches(STEPS, rank, world))
    out = {"local": [p.to_local().clone() for p in model.parameters()],
           "placements": sorted({str(p.placements) for p in model.parameters()}),
           "changed": lowmem().rounds}
    amp.deinitialize()
    return out


def draws(rank: int, world: int) -> dict[str, Any]:
    """The thresholds of this rank's shard of fc2.weight, and of the whole of it."""
    from ampatch.optim.rounding import stream, thresholds_
    model, opt = build("stochastic")
    m, p = lowmem(), model.fc2.weight
    keys, n = stream(m.seed, m.ordinal[id(p)]), p.to_local().numel()
    mine = thresholds_(torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32),
                       [(n, keys, m.offset[id(p)])])
    whole = thresholds_(torch.empty(p.numel(), dtype=torch.int32), torch.empty(p.numel(), dtype=torch.int32),
                        [(p.numel(), keys, 0)])
    amp.deinitialize()
    return {"mine": mine, "whole": whole, "offset": m.offset[id(p)], "seed": m.seed}


def overflow(rank: int, world: int, mode: str) -> dict[str, Any]:
    """An inf in rank 1's shard of fc2's gradient at step 1: every rank skips that step."""
    model, opt = build(mode)
    data = my_batches(4, rank, world)
    train(model, opt, data[:1])
    before = snapshot(model, opt)
    train(model, opt, data[1:2], inject=0, rank=rank)
    after_skip = snapshot(model, opt)
    train(model, opt, data[2:])
    out = {"skipped": amp.report().skipped_steps, "untouched": same(before, after_skip),
           "moved_on": not same(after_skip["weights"], snapshot(model, opt)["weights"])}
    amp.deinitialize()
    return out


def clipping(rank: int, world: int, mode: str) -> dict[str, Any]:
    """clip_grad_norm_ over amp.master_params (the sharded params, their DTensor grads)."""
    norms.clear()
    model, opt = build(mode)
    train(model, opt, my_batches(STEPS, rank, world), clip=0.5)
    clipped = live(model)
    amp.deinitialize()
    model, opt = build(mode)
    train(model, opt, my_batches(STEPS, rank, world))
    free = live(model)
    amp.deinitialize()
    return {"norms": list(norms), "differs": not same(clipped, free), "clipped": clipped}


def param_group(rank: int, world: int, mode: str) -> dict[str, Any]:
    """fc3 joins the optimizer after initialize (add_param_group): its weights train too."""
    torch.manual_seed(0)
    model = shard(Net())
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("fc3")], lr=2e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, verbosity=0)
    lowmem().chunk_numel = 512
    opt.add_param_group({"params": list(model.fc3.parameters()), "lr": 1e-2})
    start = model.fc3.weight.full_tensor().clone()
    train(model, opt, my_batches(STEPS, rank, world))
    out = {"fc3_moved": not torch.equal(start, model.fc3.weight.full_tensor()),
           "fc3_dtype": str(model.fc3.weight.dtype), "stepped": len(opt.state) == len(list(model.parameters())),
           "comp": mode != "kahan" or id(model.fc3.weight) in lowmem().comp,
           "groups": [len(g["params"]) for g in opt.param_groups]}
    amp.deinitialize()
    return out


def _save(model: nn.Module, opt: torch.optim.Optimizer, how: str, where: str | None = None) -> Any:
    if how == "plain":  # each rank its own shard: plain state_dict() calls
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
        return buf.getvalue()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    full = how == "dcp_full"
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full))
    if full:
        buf = io.BytesIO()
        torch.save({"model": msd, "optim": osd}, buf)
        return buf.getvalue()
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
    return where


def _load(model: nn.Module, opt: torch.optim.Optimizer, saved: Any, how: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    if how == "plain":
        ckpt = torch.load(io.BytesIO(saved), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        return
    if how == "dcp_full":
        ckpt = torch.load(io.BytesIO(saved), weights_only=False)
        set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                       options=StateDictOptions(full_state_dict=True))
        return
    import torch.distributed.checkpoint as dcp
    msd, osd = get_state_dict(model, opt)  # the template dcp.load fills in, resharded to this world
    ckpt = {"model": msd, "optim": osd}
    dcp.load(ckpt, checkpoint_id=saved)
    set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"])


def resume(rank: int, world: int, mode: str, how: str, where: str | None = None,
           before: bool = False) -> dict[str, Any]:
    """STEPS steps straight, or half of them, a checkpoint, a restart from other weights, the
    checkpoint loaded (`before`: into the plain model and optimizer, then amp.initialize),
    the other half: the same bits."""
    data = my_batches(STEPS, rank, world)
    model, opt = build(mode)
    train(model, opt, data)
    straight = {"live": live(model), "comp": [c.clone() for c in lowmem().comp.values()], "rounds": lowmem().rounds}
    amp.deinitialize()
    model, opt = build(mode)
    train(model, opt, data[:STEPS // 2])
    saved = _save(model, opt, how, os.path.join(where or ".", f"resume-{mode}") if how == "dcp" else None)
    amp.deinitialize()
    if before:
        torch.manual_seed(1)  # other weights: everything must come from the checkpoint
        model = shard(Net())
        opt = OPTIMIZERS["adamw"](model.parameters())
        _load(model, opt, saved, how)
        model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=mode, verbosity=0)
        current().optimizers[0].masters.chunk_numel = 512
    else:
        model, opt = build(mode, seed=1)
        _load(model, opt, saved, how)
    train(model, opt, data[STEPS // 2:])
    resumed = {"live": live(model), "comp": [c.clone() for c in lowmem().comp.values()], "rounds": lowmem().rounds}
    fp32 = sorted({f"{type(v).__name__}:{v.dtype}" for st in opt.state.values() for k, v in st.items()
                   if torch.is_tensor(v) and k != "step"})
    amp.deinitialize()
    if mode == "kahan":  # no rounding state: the compensations carry what rounding dropped
        straight.pop("rounds"), resumed.pop("rounds")
    return {"same": same(straight, resumed), "state": fp32, "comp": resumed["comp"]}


def resume_before(rank: int, world: int, how: str, where: str | None = None) -> dict[str, Any]:
    """`resume` with the checkpoint loaded into the plain model and optimizer before initialize."""
    return resume(rank, world, "stochastic", how, where, before=True)


def malformed(rank: int, world: int, mode: str) -> dict[str, Any]:
    """A corrupted entry in one rank's checkpoint: every rank refuses it, and nothing loads."""
    model, opt = build(mode)
    data = my_batches(3, rank, world)
    train(model, opt, data[:2])
    sd = opt.state_dict()
    blob = io.BytesIO()
    torch.save(sd, blob)
    sd = torch.load(io.BytesIO(blob.getvalue()), weights_only=False)
    if mode == "kahan":
        if rank == 1:  # a NaN in rank 1's shard of fc2.weight's compensation (param 2)
            sd["state"][2]["ampatch_compensation"].to_local()[0, 0] = float("nan")
    else:
        sd["param_groups"][0]["ampatch_rounds"] = -1
    train(model, opt, data[2:])  # the live state moves on: a load would show
    before = snapshot(model, opt)
    try:
        opt.load_state_dict(sd)
        error = None
    except ValueError as e:
        error = str(e)
    out = {"error": error, "untouched": same(before, snapshot(model, opt))}
    if mode != "kahan":  # a checkpoint of an older ampatch, whose seed and count were plain ints, loads
        sd["param_groups"][0]["ampatch_rounds"] = 2
        sd["param_groups"] = [{**g, "ampatch_seed": int(g["ampatch_seed"])} for g in sd["param_groups"]]
        opt.load_state_dict(sd)
        out["old_format"] = (lowmem().rounds, lowmem().seed == int(sd["param_groups"][0]["ampatch_seed"]))
    amp.deinitialize()
    return out


def refused(rank: int, world: int) -> dict[str, Any]:
    """Optimizers the low-memory modes cannot step shard by shard: refused before anything changes."""
    out = {}
    for name, make in (("adafactor", lambda ps: torch.optim.Adafactor(ps, lr=1e-2)),
                       ("lbfgs", lambda ps: torch.optim.LBFGS(ps))):
        torch.manual_seed(0)
        model = shard(Net())
        opt = make(model.parameters())
        try:
            amp.initialize(model, opt, opt_level="O5", master_weights="stochastic", verbosity=0)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        out[name + "/untouched"] = (all(p.dtype == torch.float32 for p in model.parameters())
                                    and not any(k.startswith("ampatch") for g in opt.state_dict()["param_groups"]
                                                for k in g))
        amp.deinitialize()
    torch.manual_seed(0)  # the optimizer built before fully_shard: initialize refuses, as at every level
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard(model)
    try:
        amp.initialize(model, opt, opt_level="O5", master_weights="kahan", verbosity=0)
        out["optimizer_before_shard"] = None
    except RuntimeError as e:
        out["optimizer_before_shard"] = str(e)
    amp.deinitialize()
    return out


def reshard_save(rank: int, world: int, mode: str, where: str) -> dict[str, Any]:
    """STEPS steps on one global batch on this world size, checkpointed half-way
    (torch.distributed.checkpoint, each rank its shards)."""
    data = my_batches(1, rank, world) * STEPS
    model, opt = build(mode)
    losses = train(model, opt, data[:STEPS // 2])
    _save(model, opt, "dcp", os.path.join(where, f"{mode}-{world}"))
    losses += train(model, opt, data[STEPS // 2:])
    amp.deinitialize()
    return {"losses": losses}


def reshard_load(rank: int, world: int, mode: str, where: str) -> dict[str, Any]:
    """The checkpoint of the other world size (1 <-> 2) loaded here, the second half trained on
    the same global batches."""
    data = my_batches(1, rank, world) * STEPS
    model, opt = build(mode, seed=1)
    _load(model, opt, os.path.join(where, f"{mode}-{3 - world}"), "dcp")
    losses = train(model, opt, data[STEPS // 2:])
    rounds = lowmem().rounds
    amp.deinitialize()
    return {"losses": losses, "rounds": rounds}


FT_D, FT_OUT, FT_N, FT_STEPS, FT_EPS = 32, 16, 512, 200, 0.03


def finetune(rank: int, world: int, opt: str, runs: tuple[str, ...] = ("O0", "O3", "O5", "stochastic", "kahan"),
             seed: int = 0) -> dict[str, Any]:
    """tests/optim/test_lowmem.py's fine-tuning case, sharded: a pretrained-like start (weights
    of magnitude 0.5-1, one bfloat16 ulp 2**-8) fine-tuned by updates of ~0.1 ulp (AdamW lr 4e-4;
    SGD lr 0.3, momentum 0.9), each rank half of each batch of 64. Per run: the FP32 loss of the
    final weights (gathered, after deinitialize), the share of weights left unchanged, the mean
    loss of the last 40 steps, and a checksum of the full weights on this rank."""
    g = torch.Generator().manual_seed(1)
    sign = torch.randint(0, 2, (FT_OUT, FT_D), generator=g) * 2 - 1
    teacher = sign * (0.5 + 0.5 * torch.rand(FT_OUT, FT_D, generator=g))
    x = torch.randn(FT_N, FT_D, generator=g) / FT_D ** 0.5
    y = x @ teacher.T + 0.01 * torch.randn(FT_N, FT_OUT, generator=g)
    start = teacher + FT_EPS * torch.randn(FT_OUT, FT_D, generator=g)
    out: dict[str, Any] = {"start": float(((x @ start.T - y) ** 2).mean())}
    per = 64 // world
    for run in runs:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(FT_D, FT_OUT, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(start)
        fully_shard(model)
        optimizer = (torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.0) if opt == "adamw"
                     else torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9))
        level, kw = (run, {}) if run.startswith("O") else ("O5", {"master_weights": run})
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0, **kw)
        first = model[0].weight.full_tensor().detach().clone()
        curve = []
        for i in range(FT_STEPS):
            j = (i * 64) % FT_N + rank * per
            optimizer.zero_grad()
            loss = ((model(x[j:j + per]) - y[j:j + per]) ** 2).mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            curve.append(mean_over_ranks(float(loss.detach())))
        w = model[0].weight.full_tensor().detach().clone()
        unchanged = (w == first).float().mean().item()
        amp.deinitialize()
        with torch.no_grad():
            final = model[0].weight.full_tensor().detach()
            out[run] = {"final": float(((x @ final.T - y) ** 2).mean()), "unchanged": unchanged,
                        "curve": sum(curve[-40:]) / 40, "checksum": float(w.double().sum()), "weights": w}
    return out



SCENARIOS: list[tuple[str, Callable, tuple]] = (
    [(f"trains/{mode}/{opt}", trains, (mode, opt)) for mode in MODES for opt in OPTIMIZERS]
    + [(f"replicas/{mode}", replicas, (mode,)) for mode in MODES] + [("draws", draws, ())]
    + [(f"{name}/{mode}", fn, (mode,)) for name, fn in (("overflow", overflow), ("clipping", clipping),
                                                       ("param_group", param_group), ("malformed", malformed))
       for mode in MODES]
    + [(f"resume/{mode}/{how}", resume, (mode, how)) for mode in MODES for how in ("plain", "dcp_full", "dcp")]
    # a plain optimizer loads the checkpoint before initialize: the rounding's seed and count pass through it
    # (not dcp.load's: it fills only the keys of the plain optimizer's own state dict)
    + [(f"resume_before/stochastic/{how}", resume_before, (how,)) for how in ("plain", "dcp_full")]
    + [("refused", refused, ())] + [(f"finetune/{opt}", finetune, (opt,)) for opt in OPTIMIZERS]
    + [(f"{name}/{mode}", fn, (mode,)) for name, fn in (("reshard_save", reshard_save),
                                                       ("reshard_load", reshard_load)) for mode in MODES]
)
NEEDS_DIR = {resume, resume_before, reshard_save, reshard_load}



if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _ranks import run_scenarios, worker_main

    worker_main(sys.argv, lambda rank, world, args: run_scenarios(SCENARIOS, NEEDS_DIR, rank, world, args,
                                                                  amp.deinitialize))
