"""One rank of the FSDP2 runs behind tests/model/test_sharded_states.py: optimizer_states
"bfloat16" and "int8" on `fully_shard` models.

    python tests/_fsdp_states_worker.py RANK WORLD RDZV_FILE OUT_FILE [SCENARIOS [DIR]]

The protocol of tests/_ranks.py: a gloo group through `file://RDZV_FILE`, the scenarios
named (comma-separated; all by default) in turn, a dict {scenario: results} saved to
OUT_FILE, `os._exit`. DIR holds the scenarios' checkpoints. A scenario's exception is saved
as its {"error": traceback}.

The model is a small MLP sharded the documented way (fully_shard on each layer, then the
root; then the optimizer; then amp.initialize), wide enough that one weight (fc2, 96 x 96)
is kept as int8 (4096 elements and more) and the others stay FP32 beside it; each rank
trains on its own half of every global batch.
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

STEPS = 6
WIDTH = 96  # fc2.weight: 9216 elements (int8 keeps it), 48 rows a rank
RUNS = {  # name: amp.initialize keywords
    "O5/bfloat16": {"opt_level": "O5", "optimizer_states": "bfloat16"},
    "O5/int8": {"opt_level": "O5", "optimizer_states": "int8"},
    "O2/int8": {"opt_level": "O2", "half_dtype": torch.float16, "loss_scale": "dynamic", "optimizer_states": "int8"},
    "O3/bfloat16": {"opt_level": "O3", "optimizer_states": "bfloat16"},
    "O1/int8": {"opt_level": "O1", "optimizer_states": "int8"},
    "stochastic/int8": {"opt_level": "O5", "master_weights": "stochastic", "optimizer_states": "int8"},
    "kahan/bfloat16": {"opt_level": "O5", "master_weights": "kahan", "optimizer_states": "bfloat16"},
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.fc3 = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def plain(seed: int = 0, mesh: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded FP32 model and its AdamW, before amp.initialize."""
    torch.manual_seed(seed)
    model = Net()
    for layer in (model.fc1, model.fc2, model.fc3, model):
        fully_shard(layer, **({} if mesh is None else {"mesh": mesh}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def initialize(model: nn.Module, opt: torch.optim.Optimizer, run: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """amp.initialize as `run` says; chunks of 512 elements, so parameters step in slices."""
    model, opt = amp.initialize(model, opt, verbosity=0, **RUNS[run])
    h = current().optimizers[0]
    h.states.chunk_numel = 512
    if run.startswith(("stochastic", "kahan")):
        h.masters.chunk_numel = 512
    return model, opt


def build(run: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    return initialize(*plain(seed), run)


def my_batches(n: int, rank: int, world: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's part of n global batches of 16 samples: a learnable regression task."""
    gen = torch.Generator().manual_seed(1000 * seed)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    size, out = 16 // world, []
    for _ in range(n):
        x = torch.randn(16, 16, generator=gen)
        out.append((x[rank * size:(rank + 1) * size], (x @ w)[rank * size:(rank + 1) * size]))
    return out


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t / dist.get_world_size())


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list, inject: int | None = None,
          rank: int = 0) -> list[float]:
    """A step per batch; at step `inject`, an inf in rank 1's shard of fc2's gradient."""
    losses = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if step == inject and rank == 1:
                with torch.no_grad():
                    model.fc2.weight.grad.to_local()[0, 0] = float("inf")
        opt.step()
        losses.append(mean_over_ranks(float(loss.detach())))
    return losses


def kept(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's kept state (values, codes, scales), copied, in the params' order."""
    store, out = current().optimizers[0].states, []
    for p in (p for g in opt.param_groups for p in g["params"]):
        for _, packed in sorted(store.kept.get(id(p), {}).items()):
            out += [packed.values.clone()] + ([] if packed.absmax is None else [packed.absmax.clone()])
    return out


def live(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def own_state(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items() if torch.is_tensor(v)}
            for st in opt.state.values()]


# ----------------------------------------------------------------------------- scenarios
def trains(rank: int, world: int, run: str) -> dict[str, Any]:
    """STEPS steps: the loss, what is kept where, the report, the state dict, deinitialize."""
    model, opt = build(run)
    data = my_batches(STEPS + 1, rank, world)
    x, y = data[-1]
    before = mean_over_ranks(float(F.mse_loss(model(x).float(), y)))
    losses = train(model, opt, data[:-1])
    after = mean_over_ranks(float(F.mse_loss(model(x).float(), y)))
    store = current().optimizers[0].states
    params = [p for g in opt.param_groups for p in g["params"]]
    kinds = {}
    for i, p in enumerate(params):
        n = p.to_local().numel()
        for name, packed in store.kept.get(id(p), {}).items():  # bf16: the local shard's shape; int8: its codes
            scales = None if packed.absmax is None else packed.absmax.numel() == -(-n // 256)
            kinds[f"{i}/{name}"] = (str(packed.values.dtype), packed.values.numel() == n, scales)
    sd = opt.state_dict()
    entries = {}
    for i, p in enumerate(params):
        for name, v in sd["state"][i].items():
            if name != "step" and not name.startswith("ampatch_"):  # (kahan: its compensation too)
                entries[f"{i}/{name}"] = (type(v).__name__, str(v.dtype), tuple(v.shape) == tuple(p.shape),
                                                       v.placements == p.placements and v.device_mesh == p.device_mesh)
    saved = [{k: v.to_local().clone() for k, v in sd["state"][i].items() if k != "step"} for i in range(len(params))]
    out = {"losses": losses, "eval": (before, after), "full": [p.full_tensor().float() for p in model.parameters()],
           "kinds": kinds, "entries": entries, "groups": sorted(sd["param_groups"][0]),
           "own": sorted({k for st in opt.state.values() for k in st}),
           "state_bytes": amp.report().optimizer_state_bytes,
           "local": [(p.numel(), p.to_local().numel()) for p in params]}
    amp.deinitialize()
    after_deinit = {}
    for i, p in enumerate(params):
        for name, v in opt.state[p].items():
            if name != "step":
                after_deinit[f"{i}/{name}"] = (
                    type(v).__name__, str(v.dtype), tuple(v.shape) == tuple(p.shape),
                    v.placements == p.placements, torch.equal(v.to_local(), saved[i][name]))
    out["after_deinit"] = after_deinit
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()  # plain FSDP2 trains on
    out["after_deinit_loss"] = float(F.mse_loss(model(x), y))
    return out


def replicas(rank: int, world: int) -> dict[str, Any]:
    """HSDP (2 replicas x 1 shard), the ranks seeded apart after the model is made: each rank
    holds the whole model, and stays bit-identical only if its bfloat16 state rounds alike."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model, opt = plain(mesh=mesh)
    torch.manual_seed(100 + rank)  # each rank's own seed: the rounding's default seed differs
    model, opt = initialize(model, opt, "O5/bfloat16")
    train(model, opt, my_batches(STEPS, rank, world))
    out = {"local": live(model), "kept": kept(opt)}
    amp.deinitialize()
    return out


def overflow(rank: int, world: int, run: str) -> dict[str, Any]:
    """An inf in rank 1's shard of fc2's gradient at the second step: every rank skips it,
    and its kept state, own state and weights stay bit for bit."""
    model, opt = build(run)
    data = my_batches(4, rank, world)
    train(model, opt, data[:1])
    before = (kept(opt), own_state(opt), live(model))
    train(model, opt, data[1:2], inject=0, rank=rank)
    after = (kept(opt), own_state(opt), live(model))
    train(model, opt, data[2:])
    out = {"skipped": amp.report().skipped_steps, "untouched": same(before, after), "kept": len(before[0]),
           "moved_on": not same(after[0], kept(opt))}
    amp.deinitialize()
    return out


HOWS = ("plain", "dcp_full", "dcp")


def save(model: nn.Module, opt: torch.optim.Optimizer, how: str, where: str) -> Any:
    """plain: each rank its own shards (torch.save of state_dict()); dcp_full: the full state
    dicts of torch.distributed.checkpoint's helpers; dcp: dcp.save of its sharded ones."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    if how != "dcp":
        buf = io.BytesIO()
        full = StateDictOptions(full_state_dict=True)
        ckpt = ({"model": model.state_dict(), "optim": opt.state_dict()} if how == "plain" else
                dict(zip(("model", "optim"), get_state_dict(model, opt, options=full))))
        torch.save(ckpt, buf)
        return buf.getvalue()
    import torch.distributed.checkpoint as dcp
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
    return where


def load(model: nn.Module, opt: torch.optim.Optimizer, saved: Any, how: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    if how != "dcp":
        ckpt = torch.load(io.BytesIO(saved), weights_only=False)
        if how == "plain":
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optim"])
        else:
            set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                           options=StateDictOptions(full_state_dict=True))
        return
    import torch.distributed.checkpoint as dcp
    msd, osd = get_state_dict(model, opt)  # the template dcp.load fills in
    ckpt = {"model": msd, "optim": osd}
    dcp.load(ckpt, checkpoint_id=saved)
    set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"])


def resume(rank: int, world: int, run: str, orders: tuple[str, ...], where: str) -> dict[str, Any]:
    """STEPS steps straight; then half of them, checkpointed (`HOWS`), and the other half from
    each checkpoint, loaded into a model of other weights after amp.initialize and/or before
    it (into the plain optimizer), as `orders` says."""
    data = my_batches(STEPS, rank, world)
    half = STEPS // 2
    model, opt = build(run)
    losses = train(model, opt, data)
    straight = {"losses": losses[half:], "live": live(model), "kept": kept(opt)}
    amp.deinitialize()
    model, opt = build(run)
    train(model, opt, data[:half])
    at_save = kept(opt)
    saved = {how: save(model, opt, how, os.path.join(where, f"resume-{run.replace('/', '-')}")) for how in HOWS}
    amp.deinitialize()
    out: dict[str, Any] = {}
    for how in HOWS:
        for order in orders:
            if order == "after":
                model, opt = build(run, seed=1)  # other weights: everything comes from the checkpoint
                load(model, opt, saved[how], how)
            else:
                model, opt = plain(seed=1)
                load(model, opt, saved[how], how)
                model, opt = initialize(model, opt, run)
            loaded = kept(opt)
            resumed = {"losses": train(model, opt, data[half:]), "live": live(model), "kept": kept(opt)}
            out[f"{how}/{order}"] = {"same": same(straight, resumed), "loaded": same(at_save, loaded),
                                     "close": max(abs(a - b) for a, b in zip(straight["losses"], resumed["losses"]))}
            amp.deinitialize()
    return out


def refused(rank: int, world: int) -> dict[str, Any]:
    """What optimizer_states cannot keep shard by shard: refused before anything changes; a
    malformed checkpoint on one rank: refused on every rank; forced from outside it applies."""
    out: dict[str, Any] = {}
    for name, make in (("adafactor", lambda ps: torch.optim.Adafactor(ps, lr=1e-2)),
                       ("lbfgs", lambda ps: torch.optim.LBFGS(ps))):
        model, _ = plain()
        opt = make(model.parameters())
        try:
            amp.initialize(model, opt, opt_level="O5", optimizer_states="int8", verbosity=0)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        out[name + "/untouched"] = all(p.dtype == torch.float32 for p in model.parameters()) and not opt.state
        amp.deinitialize()
    model, opt = build("O5/bfloat16")  # a malformed rounding count in rank 1's checkpoint: refused on every rank
    train(model, opt, my_batches(1, rank, world))
    sd = opt.state_dict()
    if rank == 1:
        sd["param_groups"][0]["ampatch_states_rounding"] = torch.tensor([5, -1])
    before = kept(opt)
    try:
        opt.load_state_dict(sd)
        out["malformed"] = None
    except ValueError as e:
        out["malformed"] = str(e)
    out["malformed/untouched"] = same(before, kept(opt))
    amp.deinitialize()
    os.environ["AMPATCH_OPTIMIZER_STATES"] = "int8"
    try:
        model, opt = plain()
        amp.initialize(model, opt, opt_level="O5", verbosity=0)
        out["forced"] = amp.report().optimizer_states
    finally:
        del os.environ["AMPATCH_OPTIMIZER_STATES"]
        amp.deinitialize()
    return out



SCENARIOS: list[tuple[str, Callable, tuple]] = (
    [(f"trains/{run}", trains, (run,)) for run in RUNS] + [("replicas", replicas, ())]
    + [(f"overflow/{run}", overflow, (run,)) for run in ("O5/bfloat16", "O2/int8", "stochastic/int8")]
    + [(f"resume/{run}", resume, (run, ("after", "before"))) for run in ("O5/bfloat16", "O5/int8")]
    # the weights' own rounding count ("stochastic") is lost where a plain optimizer loads the checkpoint
    + [("resume/stochastic/int8", resume, ("stochastic/int8", ("after",)))] + [("refused", refused, ())]
)
NEEDS_DIR = {resume}



if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _ranks import run_scenarios, worker_main

    worker_main(sys.argv, lambda rank, world, args: run_scenarios(SCENARIOS, NEEDS_DIR, rank, world, args,
                                                                  amp.deinitialize))
