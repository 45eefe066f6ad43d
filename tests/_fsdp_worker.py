"""One rank of the two-process FSDP2 run behind tests/model/test_sharded.py.

    python tests/_fsdp_worker.py RANK WORLD RDZV_FILE OUT_FILE

Same protocol as tests/_dist_worker.py: a gloo group through `file://RDZV_FILE`, every
scenario below in turn (one process pair for the whole test file), a dict {scenario name:
results} saved to OUT_FILE with `torch.save`, then `os._exit` after
`destroy_process_group()`. An exception inside a scenario is saved as that scenario's
{"error": traceback} (the others still run); a failure of the run itself exits with 1.

The model is a tiny MLP sharded the documented way: `fully_shard` on each block, then on
the root; then the optimizer; then `amp.initialize`. Each rank trains on its own data.
"""
from __future__ import annotations

import io
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ampatch as amp

LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
STEPS = 5
INJECT_STEP = 1          # the step whose grads get an inf on rank 1 only
START_SCALE = 2.0 ** 10  # low enough that tiny float16 grads never overflow by themselves


class Net(nn.Module):
    """Linear -> ReLU -> Linear -> ReLU -> Linear; `norm="batch"` puts a batch norm after
    the first layer, inside its block unless `bn_unit` makes it a unit of its own."""

    def __init__(self, norm: str | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32) if norm == "batch" else nn.Identity()
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.norm(self.fc1(x))))))


def shard(model: Net, mp_policy: MixedPrecisionPolicy | None = None, bn_unit: bool = False) -> Net:
    """Each linear layer a unit, then the root (which holds the batch norm's parameters,
    alone, unless `bn_unit` is False and there is one: then fc1 joins the root's unit too)."""
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    if bn_unit:
        fully_shard(model.norm)
    for layer in (model.fc1, model.fc2, model.fc3):
        if layer is not model.fc1 or bn_unit or isinstance(model.norm, nn.Identity):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def batches(rank: int, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable regression task; each rank its own samples."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(n):
        x = torch.randn(16, 16, generator=gen)
        out.append((x, x @ w))
    return out


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters, gathered from every rank."""
    return {k: v.full_tensor().detach().clone() if hasattr(v, "full_tensor") else v.detach().clone()
            for k, v in model.state_dict().items()}


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list, use_amp: bool = True,
          inject: int | None = None, rank: int = 0) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if use_amp:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if step == inject and rank == 1:
                    with torch.no_grad():
                        model.fc1.weight.grad._local_tensor[0, 0] = float("inf")
        else:
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def build(level: str | None, half: torch.dtype = torch.bfloat16, seed: int = 0, norm: str | None = None,
          bn_unit: bool = False, mp_policy: MixedPrecisionPolicy | None = None, sgd: bool = False, **kw: Any):
    torch.manual_seed(seed)
    model = shard(Net(norm), mp_policy, bn_unit)
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=2e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)
    return model, opt


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ----------------------------------------------------------------------------- scenarios

def each_level(rank: int, level: str) -> dict[str, Any]:
    """Train STEPS steps in the documented order; what the level did to the sharded model."""
    model, opt = build(level)
    seen: dict[str, str] = {}

    def spy(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen.setdefault("fc2.input", str(args[0].dtype))
        seen.setdefault("fc2.output", str(out.dtype))

    def weight_spy(module: nn.Module, args: tuple) -> None:  # after FSDP's pre-forward: the unsharded weight
        seen.setdefault("fc2.weight", str(module.weight.dtype))

    handles = [model.fc2.register_forward_hook(spy), model.fc2.register_forward_pre_hook(weight_spy)]
    data = batches(rank, STEPS)
    eval_x, eval_y = batches(rank, 1, seed=9)[0]
    with torch.no_grad():
        before = F.mse_loss(model(eval_x), eval_y).item()
    losses = train(model, opt, data)
    with torch.no_grad():
        out = model(eval_x)
        after = F.mse_loss(out, eval_y).item()
    for h in handles:
        h.remove()
    masters = list(amp.master_params(opt))
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    res = {
        "losses": mean_over_ranks(losses), "eval": mean_over_ranks([before, after]),
        "seen": seen, "output_dtype": str(out.dtype),
        "sharded_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "master_types": sorted({f"{type(p).__name__}:{p.dtype}" for p in masters}),
        "state_dtypes": sorted({str(v.dtype) for v in state}),
        "state_dict_dtypes": sorted({str(v.dtype) for v in model.state_dict().values()}),
        "full": full(model), "report": amp.report().to_dict(),
    }
    amp.deinitialize()
    res["restored_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    res["after_deinit_losses"] = train(model, opt, batches(rank, 2, seed=3), use_amp=False)  # plain FSDP again
    res["after_deinit_dtype"] = str(model(eval_x).dtype)
    return res


def native(rank: int) -> dict[str, Any]:
    """FSDP2's own mixed precision, no ampatch: the reference for O1 and O2."""
    model, opt = build(None, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    losses = train(model, opt, batches(rank, STEPS), use_amp=False)
    return {"losses": mean_over_ranks(losses), "full": full(model)}


def overflow(rank: int, level: str) -> dict[str, Any]:
    """float16 with a dynamic scale; rank 1 alone sees an inf in its shard of one step's grads."""
    model, opt = build(level, torch.float16, loss_scale="dynamic")
    amp.load_state_dict({"loss_scaler0": {"loss_scale": START_SCALE, "unskipped": 0}})
    scales, fulls = [], []
    for step, batch in enumerate(batches(rank, 4)):
        train(model, opt, [batch], inject=0 if step == INJECT_STEP else None, rank=rank)
        scales.append(amp.loss_scale())
        fulls.append(full(model))
    res = {"scales": scales, "skipped": list(amp.report().skipped_steps), "fulls": fulls}
    amp.deinitialize()
    return res


def no_sync(rank: int, level: str) -> dict[str, Any]:
    """Two micro-batches, the first with gradient sync off, against the whole batch at once;
    then a step with sync still off must raise. The scale is one clean step from growing:
    it must grow after the step, not between the micro-batches of one step."""
    out: dict[str, Any] = {}
    for mode in ("accumulated", "whole"):
        model, opt = build(level, torch.float16, loss_scale="dynamic", sgd=True)
        amp.load_state_dict({"loss_scaler0": {"loss_scale": START_SCALE, "unskipped": 1999}})
        grads = []
        for x, y in batches(rank, 3):
            opt.zero_grad()
            if mode == "whole":
                with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
                    scaled.backward()
            else:
                model.set_requires_gradient_sync(False)
                with amp.scale_loss(F.mse_loss(model(x[:8]), y[:8]) / 2, opt) as scaled:
                    scaled.backward()
                model.set_requires_gradient_sync(True)
                with amp.scale_loss(F.mse_loss(model(x[8:]), y[8:]) / 2, opt) as scaled:
                    scaled.backward()
            grads.append([p.grad.full_tensor() for p in amp.master_params(opt)])
            opt.step()
        out[mode] = {"grads": grads, "scale": amp.loss_scale(), "report_scale_changes":
                     amp.report().loss_scale_history["loss_scaler0"], "skipped": amp.report().skipped_steps}
        if mode == "accumulated":
            x, y = batches(rank, 1, seed=5)[0]
            opt.zero_grad()
            model.set_requires_gradient_sync(False)
            with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
                scaled.backward()
            try:
                opt.step()
                out["step_with_sync_off"] = None
            except RuntimeError as e:
                out["step_with_sync_off"] = str(e)
            model.set_requires_gradient_sync(True)
        amp.deinitialize()
    return out


def _save(model: nn.Module, opt: torch.optim.Optimizer, how: str) -> bytes:
    buf = io.BytesIO()
    if how == "dcp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        torch.save({"model": msd, "optim": osd, "amp": amp.state_dict()}, buf)
    else:  # each rank its own shard: plain state_dict() calls
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "amp": amp.state_dict()}, buf)
    return buf.getvalue()


def _load(model: nn.Module, opt: torch.optim.Optimizer, blob: bytes, how: str) -> None:
    ckpt = torch.load(io.BytesIO(blob), weights_only=False)
    if how == "dcp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                       options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
    amp.load_state_dict(ckpt["amp"])


def resume(rank: int, level: str, half: torch.dtype, how: str) -> dict[str, Any]:
    """Train 4 steps straight, or 2 steps, checkpoint, a fresh process-like restart from other
    random weights, load, 2 more steps: the final weights must be the same bits."""
    data = batches(rank, 4)
    kw = {"loss_scale": "dynamic"} if half == torch.float16 else {}
    model, opt = build(level, half, **kw)
    train(model, opt, data)
    straight = {"full": full(model), "amp": amp.state_dict()}
    amp.deinitialize()

    model, opt = build(level, half, **kw)
    train(model, opt, data[:2])
    blob = _save(model, opt, how)
    amp.deinitialize()
    model, opt = build(level, half, seed=1, **kw)  # other weights: everything must come from the checkpoint
    _load(model, opt, blob, how)
    train(model, opt, data[2:])
    resumed = {"full": full(model), "amp": amp.state_dict()}
    amp.deinitialize()
    ckpt = torch.load(io.BytesIO(blob), weights_only=False)
    dtypes = sorted({str(v.dtype) for v in ckpt["model"].values()})
    return {"straight": straight, "resumed": resumed, "checkpoint_dtypes": dtypes}


def wrong_orders(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = batches(rank, 1)[0]
    for level in ("O0", "O1", "O2"):  # initialize, then fully_shard: the next step must raise
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
        shard(model)
        opt.zero_grad()
        try:
            with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
            out[f"initialize_then_shard/{level}"] = None
        except RuntimeError as e:
            out[f"initialize_then_shard/{level}"] = str(e)
        amp.deinitialize()
    torch.manual_seed(0)  # the optimizer built before fully_shard: initialize itself refuses
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard(model)
    try:
        amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
        out["optimizer_before_shard"] = None
    except RuntimeError as e:
        out["optimizer_before_shard"] = str(e)
    amp.deinitialize()
    return out


def batchnorm(rank: int) -> dict[str, Any]:
    """keep_batchnorm_fp32 under FSDP2: a batch norm inside a block cannot stay FP32 (error);
    as a unit of its own it does."""
    out: dict[str, Any] = {}
    try:
        build("O2", norm="batch")
        out["inside_unit"] = None
    except ValueError as e:
        out["inside_unit"] = str(e)
    amp.deinitialize()
    model, opt = build("O2", norm="batch", bn_unit=True)
    losses = train(model, opt, batches(rank, 3))
    seen = {}
    h = model.norm.register_forward_hook(lambda m, a, o: seen.update(weight=str(m.weight.dtype), input=str(a[0].dtype),
                                                                      running_mean=str(m.running_mean.dtype)))
    model(batches(rank, 1)[0][0])
    h.remove()
    out["own_unit"] = {"losses": losses, "seen": seen}
    amp.deinitialize()
    model, opt = build("O3", norm="batch")  # O3 keeps no batch norm in FP32: one unit is fine
    out["o3_inside_unit"] = {"losses": train(model, opt, batches(rank, 2)),
                             "dtypes": sorted({str(t.dtype) for t in [*model.norm.parameters(), *model.norm.buffers()]
                                               if t.is_floating_point()}),
                             "state_dict": sorted({str(t.dtype) for t in model.state_dict().values()
                                                   if t.is_floating_point()})}
    amp.deinitialize()
    out["o3_restored"] = sorted({str(t.dtype) for t in [*model.parameters(), *model.buffers()]
                                 if t.is_floating_point()})
    return out


def bad_input(rank: int) -> dict[str, Any]:
    """What initialize refuses on a sharded model: parameters in no unit at O2, sharded and
    unsharded models together at O2, FSDP2 internals other than ampatch knows (nothing changed)."""
    from unittest import mock

    import ampatch.model.sharded

    def refused(make: Callable[[], None]) -> str | None:
        try:
            make()
            return None
        except (ValueError, RuntimeError) as e:
            return f"{'ValueError' if isinstance(e, ValueError) else 'RuntimeError'}: {e}"  # DESIGN's type
        finally:
            amp.deinitialize()

    def no_root() -> None:  # the batch norm's parameters belong to the root, which has no unit
        model = Net("batch")
        for layer in (model.fc1, model.fc2, model.fc3):
            fully_shard(layer)
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)

    def mixed() -> None:
        models = [shard(Net()), Net()]
        opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
        amp.initialize(models, opt, opt_level="O2", verbosity=0)

    model, opt = build(None)
    internals = dict(ampatch.model.sharded._INTERNALS,
                     group=(*ampatch.model.sharded._INTERNALS["group"], "renamed_by_a_later_torch"))
    with mock.patch.dict(ampatch.model.sharded._INTERNALS, internals):
        other_torch = refused(lambda: amp.initialize(model, opt, opt_level="O2", verbosity=0))
    return {"no_root": refused(no_root), "mixed": refused(mixed), "other_torch": other_torch,
            "unchanged": model._get_fsdp_state()._mp_policy == MixedPrecisionPolicy()
            and {p.dtype for p in model.parameters()} == {torch.float32}}


def example(rank: int) -> dict[str, Any]:
    """examples/fsdp.py inside this process group, at every level (and a level forced through
    AMPATCH_OPT_LEVEL wins over --opt-level)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "fsdp.py")
    spec = importlib.util.spec_from_file_location("ampatch_example_fsdp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out: dict[str, Any] = {}
    for level in LEVELS:
        loss = module.main(["--opt-level", level, "--steps", "3", "--accum", "2", "--batch", "16"])
        out[level] = {"loss": loss, "report_level": amp.report().opt_level}
        amp.deinitialize()
    os.environ["AMPATCH_OPT_LEVEL"] = "O3"
    try:
        module.main(["--opt-level", "O1", "--steps", "1", "--batch", "16"])
        out["forced"] = amp.report().opt_level
    finally:
        del os.environ["AMPATCH_OPT_LEVEL"]
        amp.deinitialize()
    return out


def unscale_local(rank: int) -> dict[str, Any]:
    """ampatch's unscale of sharded grads (DTensors, next to a plain tensor) works on each
    rank's local shard: no collective of its own (the overflow flag is reduced once, later)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from ampatch.optim.scaler import unscale_
    model, opt = build(None)
    x, y = batches(rank, 1)[0]
    F.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()] + [torch.ones(3)]
    before = [g.full_tensor() if hasattr(g, "full_tensor") else g.clone() for g in grads]
    with CommDebugMode() as comm:
        found = unscale_(grads, 0.5, None)
    after = [g.full_tensor() if hasattr(g, "full_tensor") else g.clone() for g in grads]
    return {"collectives": comm.get_total_counts(), "found": found.item(),
            "halved": all(torch.equal(a, b * 0.5) for a, b in zip(after, before))}


def reinitialize(rank: int) -> dict[str, Any]:
    """initialize again on the same sharded model and optimizer: each level undoes the last."""
    model, opt = build(None)
    out: dict[str, Any] = {}
    for level in ("O2", "O3", "O1", "O3", "O0"):
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
        losses = train(model, opt, batches(rank, 2, seed=len(out)))
        out[f"{len(out)}:{level}"] = {
            "losses": losses, "sharded": sorted({str(p.dtype) for p in model.parameters()}),
            "state": sorted({str(v.dtype) for s in opt.state.values() for k, v in s.items() if k != "step"}),
            "param_dtype": str(model._get_fsdp_state()._mp_policy.param_dtype)}
    amp.deinitialize()
    return out


def custom_policy(rank: int) -> dict[str, Any]:
    """A policy given to fully_shard is replaced at O2 and put back by deinitialize."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    model, opt = build("O2", mp_policy=policy)
    during = model._get_fsdp_state()._mp_policy
    train(model, opt, batches(rank, 1))
    amp.deinitialize()
    return {"during": str(during.param_dtype), "after": model._get_fsdp_state()._mp_policy == policy}


def keep_fp32(rank: int, level: str) -> dict[str, Any]:
    """keep_fp32="fc3" (a fully_shard unit of its own) stays FP32 at every level: its
    all-gathered weight, its sharded parameters, what it computes; its output leaves in the
    level's dtype. A kept module that shares a unit with half layers is refused."""
    model, opt = build(level, keep_fp32="fc3")
    seen: dict[str, str] = {}

    def pre(name: str) -> Callable:  # after FSDP's pre-forward: the unsharded weight
        def hook(module: nn.Module, args: tuple) -> None:
            seen.setdefault(f"{name}.weight", str(module.weight.dtype))
        return hook

    def post(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen.setdefault("fc3.output", str(out.dtype))

    handles = [model.fc2.register_forward_pre_hook(pre("fc2")), model.fc3.register_forward_pre_hook(pre("fc3")),
               model.fc3.register_forward_hook(post)]
    losses = train(model, opt, batches(rank, STEPS))
    for h in handles:
        h.remove()
    res = {"losses": mean_over_ranks(losses), "seen": seen,
           "fc2_sharded": str(model.fc2.weight.dtype), "fc3_sharded": str(model.fc3.weight.dtype),
           "state_dict_dtypes": sorted({str(v.dtype) for v in model.state_dict().values()}),
           "report": amp.report().keep_fp32, "full": full(model)}
    amp.deinitialize()
    res["restored"] = ("forward" not in vars(model.fc3), sorted({str(p.dtype) for p in model.parameters()}))
    if level == "O3":  # fc1 shares the root's unit with the batch norm, which O3 casts to half
        try:
            build("O3", norm="batch", keep_fp32="fc1")
            res["shared_unit"] = None
        except ValueError as e:
            res["shared_unit"] = str(e)
        amp.deinitialize()
        build("O3", norm="batch", keep_fp32="fc1,norm")  # the whole unit kept: fine
        res["whole_unit"] = amp.report().keep_fp32
        amp.deinitialize()
    return res


SCENARIOS: list[tuple[str, Callable[..., Any], tuple]] = (
    [(f"level/{lv}", each_level, (lv,)) for lv in LEVELS]
    + [("native", native, ())]
    + [(f"overflow/{lv}", overflow, (lv,)) for lv in ("O1", "O2")]
    + [("no_sync/O2", no_sync, ("O2",))]
    + [("resume/O2-fp16-state_dict", resume, ("O2", torch.float16, "state_dict")),
       ("resume/O5-dcp", resume, ("O5", torch.bfloat16, "dcp"))]
    + [("wrong_orders", wrong_orders, ()), ("batchnorm", batchnorm, ()), ("custom_policy", custom_policy, ()),
       ("reinitialize", reinitialize, ()), ("bad_input", bad_input, ()),
       ("unscale_local", unscale_local, ()), ("example", example, ())]
    + [(f"keep_fp32/{lv}", keep_fp32, (lv,)) for lv in ("O1", "O2", "O3", "O5")]
)


def run_all(rank: int, only: set[str] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, fn, args in SCENARIOS:
        if only and name not in only:
            continue
        try:
            results[name] = fn(rank, *args)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            amp.deinitialize()
    return results


if __name__ == "__main__":
    from _ranks import worker_main

    worker_main(sys.argv,
                lambda rank, world, args: run_all(rank, set(args[0].split(",")) if args and args[0] else None))
