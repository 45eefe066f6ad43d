"""Model casting at O2/O3/O5: dtypes of every part of a model at each level and
half dtype, buffers following their modules, batch norms (SyncBN included) kept FP32,
casting of inputs and outputs through containers and custom batches, FP32 `state_dict()`,
`load_state_dict` of FP32 or half tensors, torch.compile after initialize, and the CNN example.
"""
from __future__ import annotations

import collections
import copy
import importlib.util
import io
import itertools
import pathlib
import re
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

import ampatch as amp

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ROOT = pathlib.Path(__file__).resolve().parents[2]


# (level, half_dtype): every valid combination; O4/O5 exist only in bfloat16
COMBOS = [("O0", F16), ("O0", BF16), ("O1", F16), ("O1", BF16), ("O2", F16), ("O2", BF16),
          ("O3", F16), ("O3", BF16), ("O4", BF16), ("O5", BF16)]
COMBO_IDS = [f"{lvl}-{'fp16' if h == F16 else 'bf16'}" for lvl, h in COMBOS]


class Net(nn.Module):
    """Linear, Conv, BatchNorm, SyncBatchNorm, LayerNorm, Embedding, and own buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)
        self.sbn = nn.SyncBatchNorm(3)
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, img: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        a = self.bn(self.conv(img)).mean((2, 3))
        b = self.emb(idx).mean(1)
        h = self.ln(torch.cat([a, b], 1))
        return self.sbn(self.fc(h)) * self.scale


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def net_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 1, 5, 5, generator=g), torch.randint(0, 10, (4, 3), generator=g)


BN_PARTS = ("bn.", "sbn.")


def expected_dtype(name: str, original: torch.dtype, level: str, half: torch.dtype,
                   keep_bn: bool | None = None) -> torch.dtype:
    if not original.is_floating_point or level in ("O0", "O1", "O4"):
        return original
    if keep_bn is None:
        keep_bn = level in ("O2", "O5")
    if keep_bn and name.startswith(BN_PARTS):
        return F32
    return half


@pytest.mark.parametrize("level,half", COMBOS, ids=COMBO_IDS)
def test_dtypes_of_every_part(level, half):
    model = make_net()
    before = {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()}
    assert before["bn.num_batches_tracked"] == torch.long and before["count"] == torch.long
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    assert set(params) | set(buffers) == set(before)
    for name, t in list(params.items()) + list(buffers.items()):
        assert t.dtype == expected_dtype(name, before[name], level, half), name
    # forward and backward run; grads have their params' dtype; output is FP32
    img, idx = net_inputs()
    out = model(img, idx)
    assert out.dtype == F32
    out.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
    assert buffers["bn.num_batches_tracked"].item() == 1  # BN ran in training mode


@pytest.mark.parametrize("level,keep_bn", [("O2", False), ("O3", True), ("O5", False)])
def test_keep_batchnorm_fp32_override(level, keep_bn):
    model = make_net()
    before = {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()}
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level,
                   keep_batchnorm_fp32=keep_bn)
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        assert t.dtype == expected_dtype(name, before[name], level, BF16, keep_bn), name
    assert model(*net_inputs()).dtype == F32


def test_batchnorm_subclasses_kept_fp32():
    class MyBN(nn.BatchNorm1d):
        pass

    model = nn.Sequential(nn.Linear(3, 4), MyBN(4), nn.BatchNorm3d(2), nn.InstanceNorm1d(4, affine=True),
                          nn.GroupNorm(2, 4))
    amp.initialize(model, opt_level="O2")
    assert model[0].weight.dtype == BF16
    assert model[1].weight.dtype == F32 and model[1].running_var.dtype == F32
    assert model[2].weight.dtype == F32 and model[2].running_mean.dtype == F32
    # instance norm and group norm are not batch norms: cast like the rest (Apex's rule)
    assert model[3].weight.dtype == BF16 and model[4].weight.dtype == BF16


def test_shared_and_frozen_params():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(), lin)  # the same module twice: one param object
    model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([model[0].weight], lr=0.1)
    amp.initialize(model, opt, opt_level="O2")
    assert lin.weight.dtype == BF16 and lin.bias.dtype == BF16 and not lin.bias.requires_grad
    masters = list(amp.master_params(opt))
    assert len(masters) == 1 and masters[0].dtype == F32 and masters[0].requires_grad


# ------------------------------------------------------------------ inputs and outputs
class Pair(NamedTuple):
    a: torch.Tensor
    b: object


class Batch:
    """A user batch type: moves its tensors with `.to(dtype)`."""

    def __init__(self, x: torch.Tensor, labels: torch.Tensor, log: list) -> None:
        self.x, self.labels, self.log = x, labels, log

    def to(self, dtype: torch.dtype) -> "Batch":
        self.log.append(dtype)
        return Batch(self.x.to(dtype), self.labels, self.log)


class Recorder(nn.Module):
    """Keeps what forward received; returns a nested structure of mixed dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen: tuple | None = None

    def forward(self, *args, **kwargs):
        self.seen = (args, kwargs)
        w = self.lin.weight
        return {
            "half": w * 2,
            "ints": torch.arange(3),
            "list": [w + 1, (torch.ones(2, dtype=F32), "tag")],
            "pair": Pair(w.sum(), np.ones(2)),
            "none": None,
            "max": w.max(0),  # a torch.return_types structseq
        }


def test_inputs_cast_through_containers():
    model = Recorder()
    amp.initialize(model, opt_level="O2", half_dtype=F16)
    ints, bools = torch.arange(4), torch.ones(2, dtype=torch.bool)
    arr = np.ones(3, dtype=np.float32)
    log: list = []
    batch = Batch(torch.ones(2), torch.arange(2), log)
    half_already = torch.ones(2, dtype=F16)
    dd = collections.defaultdict(list, {"x": torch.ones(1)})
    od = collections.OrderedDict(a=torch.ones(1, dtype=torch.float64), b=ints)
    model(
        torch.ones(2),
        [torch.ones(1), (torch.zeros(1, dtype=BF16), ints)],
        {"deep": {"x": torch.ones(3), "arr": arr, "n": 3.5, "s": "text"}},
        Pair(torch.ones(2), ints),
        batch,
        half_already,
        dd,
        od,
        None,
        kw=torch.ones(2),
        kw_ints=ints,
        kw_list=[arr, torch.ones(1)],
    )
    args, kwargs = model.seen
    assert args[0].dtype == F16
    assert isinstance(args[1], list) and isinstance(args[1][1], tuple)
    assert args[1][0].dtype == F16 and args[1][1][0].dtype == F16 and args[1][1][1] is ints
    deep = args[2]["deep"]
    assert deep["x"].dtype == F16 and deep["arr"] is arr and deep["n"] == 3.5 and deep["s"] == "text"
    assert type(args[3]) is Pair and args[3].a.dtype == F16 and args[3].b is ints
    assert isinstance(args[4], Batch) and args[4].x.dtype == F16 and log == [F16]
    assert args[4].labels.dtype == torch.long
    assert args[5] is half_already
    assert type(args[6]) is collections.defaultdict and args[6]["x"].dtype == F16
    assert args[6].default_factory is list
    assert type(args[7]) is collections.OrderedDict and list(args[7]) == ["a", "b"]
    assert args[7]["a"].dtype == F16 and args[7]["b"] is ints
    assert args[8] is None
    assert kwargs["kw"].dtype == F16 and kwargs["kw_ints"] is ints
    assert kwargs["kw_list"][0] is arr and kwargs["kw_list"][1].dtype == F16
    assert bools.dtype == torch.bool


def test_outputs_cast_to_fp32():
    model = Recorder()
    amp.initialize(model, opt_level="O2")
    out = model(torch.ones(2))
    assert set(out) == {"half", "ints", "list", "pair", "none", "max"}
    assert type(out["max"]) is torch.return_types.max
    assert out["max"].values.dtype == F32 and out["max"].indices.dtype == torch.long
    assert out["half"].dtype == F32
    assert torch.equal(out["half"], (model.lin.weight * 2).float())
    assert out["ints"].dtype == torch.long
    assert out["list"][0].dtype == F32 and out["list"][1][0].dtype == F32 and out["list"][1][1] == "tag"
    assert type(out["pair"]) is Pair and out["pair"].a.dtype == F32 and isinstance(out["pair"].b, np.ndarray)
    assert out["none"] is None


def test_cast_model_outputs():
    model = Recorder()
    amp.initialize(model, opt_level="O2", half_dtype=BF16, cast_model_outputs=F16)
    out = model(torch.ones(2))
    assert out["half"].dtype == F16
    assert out["list"][1][0].dtype == F16  # FP32 outputs too
    assert out["ints"].dtype == torch.long
    assert model.lin.weight.dtype == BF16


def test_gradient_reaches_fp32_input_in_fp32():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    amp.initialize(model, opt_level="O2")
    x = torch.randn(5, 3, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and x.grad.dtype == F32 and x.grad.abs().sum() > 0


@pytest.mark.parametrize("level", ["O0", "O1", "O4"])
def test_fp32_levels_leave_forward_alone(level):
    model = Recorder()
    amp.initialize(model, opt_level=level)
    assert "forward" not in vars(model)
    x = torch.ones(2, dtype=torch.float64)
    model(x)
    assert model.seen[0][0] is x


@pytest.mark.parametrize("level", ["O0", "O1", "O4"])
def test_cast_model_outputs_at_levels_that_leave_the_model_alone(level):
    """As in Apex: only the outputs are cast; inputs and the model are untouched."""
    model = Recorder()
    amp.initialize(model, opt_level=level, cast_model_outputs=F16)
    x = torch.ones(2, dtype=torch.float64)
    out = model(x)
    assert model.seen[0][0] is x and model.lin.weight.dtype == F32
    assert out["half"].dtype == F16 and out["list"][1][0].dtype == F16 and out["ints"].dtype == torch.long
    amp.deinitialize()
    assert "forward" not in vars(model) and model(x)["half"].dtype == F32


# ------------------------------------------------------------------ state dicts
@pytest.mark.parametrize("level,half", [("O2", F16), ("O2", BF16), ("O3", BF16), ("O5", BF16)])
def test_state_dict_holds_the_exact_values_and_the_half_where_it_is_the_only_copy(level, half):
    """FP32 masters and the exact FP32 values of buffers where they are kept; at O3 a param's
    half tensor, the only copy, as plain PyTorch saves a half model; every value aliased."""
    model = make_net()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, half_dtype=half)
    live = model.state_dict(keep_vars=True)
    sd = model.state_dict()
    assert list(sd) == list(ref)
    params = {name for name, _ in model.named_parameters()}
    for k, v in sd.items():
        if level == "O3" and k in params and live[k].dtype == half:  # the only copy: the half tensor itself
            assert v.dtype == half and v.data_ptr() == live[k].data_ptr(), k
            assert torch.equal(v, ref[k].to(half)), k
            continue
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k  # exact: a master, a kept value
    assert live["fc.weight"] is model.fc.weight and live["scale"] is model.scale  # keep_vars: the live tensors
    assert live["fc.weight"].dtype == half  # the model itself stays half
    # the checkpoint loads into a plain FP32 copy of the architecture
    plain = make_net()
    plain.load_state_dict(sd)
    assert plain.fc.weight.dtype == F32


def _pairs(model: nn.Module, opt: torch.optim.Optimizer):
    return list(zip(model.parameters(), amp.master_params(opt)))


@pytest.mark.parametrize("as_half", [False, True], ids=["fp32", "half"])
def test_load_state_dict_accepts_fp32_or_half(as_half):
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", half_dtype=F16)
    torch.manual_seed(5)
    other = Net().state_dict()
    sd = {k: (v.half() if as_half and v.is_floating_point() else v) for k, v in other.items()}
    result = model.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    live = model.state_dict(keep_vars=True)
    for k, v in other.items():
        assert live[k].dtype == expected_dtype(k, v.dtype, "O2", F16), k
        assert torch.equal(live[k].detach(), v.to(live[k].dtype)), k
    # masters follow the loaded values
    for p, m in _pairs(model, opt):
        assert m.dtype == F32 and torch.equal(p, m.to(p.dtype))
    assert torch.equal(model.bn.weight, other["bn.weight"])  # FP32 batch norm: exact
    # and training continues from them
    model(*net_inputs()).float().pow(2).sum().backward()  # a plain backward works too
    opt.step()
    for p, m in _pairs(model, opt):
        assert torch.equal(p, m.to(p.dtype))
    assert not torch.equal(model.fc.weight.detach().float(), other["fc.weight"].half().float())


# ------------------------------------------------------------------ torch.compile
def _compile_case(level: str, backend: str) -> None:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(6, 4)
    out_dtype = BF16 if level in ("O1", "O4") else F32  # O1: the last Linear runs in half
    first = compiled(x)
    assert first.dtype == out_dtype
    assert torch.allclose(first.float(), model(x).float(), atol=1e-2)
    for _ in range(2):
        opt.zero_grad()
        out = compiled(x)
        assert out.dtype == out_dtype
        with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    w = model[0].weight
    assert w.dtype == (F32 if level in ("O0", "O1", "O4") else BF16)
    if level in ("O2", "O5"):
        m = next(iter(amp.master_params(opt)))
        assert m.dtype == F32 and torch.equal(w, m.to(w.dtype))
    # the compiled module sees the updated weights, and matches eager on them
    last = compiled(x)
    assert not torch.allclose(last.float(), first.float(), atol=1e-2)
    assert torch.allclose(last.float(), model(x).float(), atol=1e-2)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_compile_after_initialize(level):
    _compile_case(level, "aot_eager")


@pytest.mark.slow
def test_compile_after_initialize_inductor():
    _compile_case("O2", "inductor")


# ------------------------------------------------------------------ the example
def _load_example():
    spec = importlib.util.spec_from_file_location("ampatch_example_cnn", ROOT / "examples" / "cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("level", ["O0", "O2", "O5"])
def test_cnn_example_runs(level, capsys):
    example = _load_example()
    final = example.main(["--opt-level", level, "--steps", "4", "--print-every", "2"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if re.match(r"step\s+\d+", ln)]
    assert len(lines) == 2, out
    assert all("loss" in ln and "ms/step" in ln for ln in lines)
    assert isinstance(final, float) and np.isfinite(final)


# ------------------------------------------------------------------ copies of a cast model
def test_deepcopy_of_cast_model_runs_its_own_weights():
    """EMA recipes deepcopy the model after initialize: the copy must use its own weights."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2")
    model.eval()
    ema = copy.deepcopy(model)
    img, idx = net_inputs()
    assert torch.equal(ema(img, idx), model(img, idx))
    with torch.no_grad():
        ema.fc.bias.add_(1.0)
    out = ema(img.double(), idx)  # still casts inputs and outputs
    assert out.dtype == F32 and ema.fc.weight.dtype == BF16
    assert not torch.equal(out, model(img, idx))
    # loading into the copy leaves the original's masters alone
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    ema.load_state_dict(make_net().state_dict())
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    assert ema.state_dict()["fc.weight"].dtype == F32


def test_pickled_cast_model_round_trips():
    model = make_net()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O3")
    model.eval()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    img, idx = net_inputs()
    out = loaded(img, idx)
    assert out.dtype == F32 and loaded.fc.weight.dtype == BF16
    assert torch.equal(out, model(img, idx))


def test_state_dict_of_a_parent_module_converts_only_the_cast_model():
    model = make_net()
    amp.initialize(model, opt_level="O2")
    other = nn.Linear(2, 2).to(F16)  # the user's own half module, not ampatch's business
    parent = nn.ModuleDict({"other": other, "net": model})  # "other" is saved first
    sd = parent.state_dict()
    assert sd["net.fc.weight"].dtype == F32 and sd["net.bn.weight"].dtype == F32
    assert sd["other.weight"].dtype == F16


def test_data_parallel_replicas_run_their_own_weights():
    """nn.DataParallel after initialize: each replica's forward must use the replica's
    params (Apex's O2 + DataParallel device-mismatch bug). Replication is what
    torch.nn.parallel.replicate does per device, done here on CPU."""
    model = nn.Sequential(nn.Linear(3, 2))
    amp.initialize(model, opt_level="O2")
    replica = model._replicate_for_data_parallel()
    child = model[0]._replicate_for_data_parallel()
    child.weight = torch.zeros(2, 3, dtype=BF16)
    child.bias = torch.ones(2, dtype=BF16)
    replica._modules["0"] = child
    x = torch.randn(4, 3)
    out = replica(x)  # FP32 input: still cast to half by the replica's wrapper
    assert out.dtype == F32 and torch.equal(out, torch.ones(4, 2))
    assert not torch.equal(model(x), torch.ones(4, 2))
    amp.deinitialize()
    assert "_replicate_for_data_parallel" not in vars(model) and "forward" not in vars(model)
