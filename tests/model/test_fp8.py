"""The FP8 layers (`model.fp8_choice`, `model.fp8`), without a session:

- which layers, each with its reason: by default every Linear with dims multiples of 16
  but the output head (the last Linear, or one tied to an embedding); never a layer kept
  in FP32, inside nn.MultiheadAttention, with a forward of its own, or registered twice;
  `fp8_modules` as names, globs or a callable; a pattern matching nothing lists the layers;
- conversion in place: the same module objects, parameters, hooks, train/eval mode and
  state_dict keys (checkpoints load strictly both ways); restore gives the plain classes
  and drops what the conversion added; a failure half-way converts nothing;
- Transformers' GPT-2 Conv1D runs torchao's float8 matmul bit for bit like a Float8Linear
  holding its transposed weight;
- the config: recipes as torchao names them, emulation without FP8 tensor cores;
- torchao missing or of another release: ImportError naming the extra.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from ampatch.config.values import FP8_RECIPES
from ampatch.model import fp8, fp8_choice

torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


class Net(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.odd = nn.Linear(32, 24)
        self.attn = nn.MultiheadAttention(32, 2)
        self.head = nn.Linear(32, 64, bias=False)
        if tie:
            self.head.weight = self.emb.weight
            self.last = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.up(self.emb(ids))))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        if hasattr(self, "last"):
            h = self.last(h)
        return self.head(h) + self.odd(h).sum(-1, keepdim=True)


def reasons(choices) -> dict[str, tuple[bool, str]]:
    return {c.label: (c.convert, c.reason) for c in choices}


def test_the_default_choice_and_its_reasons():
    got = reasons(fp8_choice.choose([Net()]))
    assert got["up"] == (True, "default: Linear with dims multiples of 16")
    assert got["down"][0] is True
    assert got["odd"] == (False, "in/out features 32x24 are not multiples of 16 (FP8 GEMMs need them)")
    assert got["attn.out_proj"][0] is False and "MultiheadAttention" in got["attn.out_proj"][1]
    assert got["head"] == (False, "output head: the last Linear in module order")
    tied = reasons(fp8_choice.choose([Net(tie=True)]))
    assert tied["head"] == (False, "output head: weight tied to embedding 'emb'")
    assert tied["last"][0] is True  # the last Linear, but not the head: the tied one is


def test_kept_shared_subclassed_and_already_converted_layers_are_skipped():
    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class PlainSubclass(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(16, 16), OwnForward(16, 16), PlainSubclass(16, 16), nn.Linear(16, 16),
                      nn.Linear(16, 16))
    m.add_module("again", m[3])
    kept = {id(m[0])}
    got = reasons(fp8_choice.choose([m], kept=kept))
    assert got["0"] == (False, "kept in FP32 (keep_fp32)")
    assert got["1"] == (False, "OwnForward has its own forward, which converting would replace")
    assert got["2"][0] is True
    assert got["3"] == (False, "one module registered under several names")
    layers = fp8.Fp8Layers([m], fp8_choice.choose([m], kept=kept), fp8.config_for("tensorwise", "cpu"))
    assert isinstance(m[2], PlainSubclass) and isinstance(m[2], Float8Linear)  # both: its own methods stay
    assert reasons(fp8_choice.choose([m]))["2"] == (False, "already float8 (converted before initialize)")
    layers.restore()
    assert type(m[2]) is PlainSubclass


def test_fp8_modules_by_name_glob_and_callable():
    m = Net()
    by_glob = reasons(fp8_choice.choose([m], ("u*", "head")))
    assert by_glob["up"] == (True, "selected by fp8_modules")
    assert by_glob["down"] == (False, "not selected by fp8_modules")
    assert by_glob["head"] == (True, "selected by fp8_modules")  # asked for: the head rule is the default's
    assert by_glob["odd"][0] is False  # a rule that makes FP8 wrong holds whatever is asked
    by_call = reasons(fp8_choice.choose([m], lambda module, fqn: fqn == "down"))
    assert by_call["down"][0] is True and by_call["up"][0] is False
    with pytest.raises(ValueError, match=r"'mlp\.\*' matches no Linear layer.*up, down, odd, attn.out_proj, head"):
        fp8_choice.choose([m], ("mlp.*",))
    two = reasons(fp8_choice.choose([nn.Sequential(nn.Linear(16, 16)), nn.Sequential(nn.Linear(16, 16))], ("1.0",)))
    assert two == {"0.0": (False, "not selected by fp8_modules"), "1.0": (True, "selected by fp8_modules")}


def test_conversion_is_in_place_and_restore_gives_the_plain_layers_back():
    torch.manual_seed(0)
    m = Net()
    plain = copy.deepcopy(m)
    up, params, keys = m.up, list(m.parameters()), list(m.state_dict())
    m.up.eval()
    seen = []
    m.up.register_forward_hook(lambda *_: seen.append(1))
    layers = fp8.Fp8Layers([m], fp8_choice.choose([m]), fp8.config_for("tensorwise", "cpu"))
    assert m.up is up and type(m.up) is Float8Linear and type(m.head) is nn.Linear
    assert list(m.parameters()) == params and all(a is b for a, b in zip(m.parameters(), params))
    assert list(m.state_dict()) == keys and not m.up.training
    ids = torch.randint(0, 64, (2, 5))
    out = m(ids)
    assert seen == [1] and not torch.equal(out, plain(ids))  # FP8 ran, and the hook with it
    assert (out - plain(ids)).norm() / plain(ids).norm() < 0.1
    m.load_state_dict(plain.state_dict(), strict=True)  # a plain checkpoint into the FP8 model
    plain.load_state_dict(m.state_dict(), strict=True)  # and the other way round
    layers.restore()
    assert type(m.up) is nn.Linear and set(vars(m.up)) == set(vars(plain.up))
    assert torch.equal(m(ids), plain(ids))
    layers.restore()  # idempotent


def test_a_failure_half_way_converts_nothing(monkeypatch):
    m = Net()
    choices = fp8_choice.choose([m])
    calls = []
    own = fp8.Fp8Layers._convert

    def failing(self, layer, attributes):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("boom")
        own(self, layer, attributes)
    monkeypatch.setattr(fp8.Fp8Layers, "_convert", failing)
    with pytest.raises(RuntimeError, match="boom"):
        fp8.Fp8Layers([m], choices, fp8.config_for("rowwise", "cpu"))
    assert type(m.up) is nn.Linear and "config" not in vars(m.up)


def test_gpt2_conv1d_runs_like_a_float8_linear_with_its_weight_transposed():
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    conv = Conv1D(48, 32)  # nf=48 outputs, nx=32 inputs: weight (32, 48)
    model = nn.Sequential(conv, nn.Linear(48, 16))
    weight = conv.weight
    choice = fp8_choice.choose([model])
    assert reasons(choice)["0"] == (True, "default: Conv1D, run as a Linear with its weight transposed")
    x = torch.randn(4, 7, 32, requires_grad=True)
    for recipe in FP8_RECIPES:
        config = fp8.config_for(recipe, "cpu")
        layers = fp8.Fp8Layers([model], choice, config)
        assert isinstance(conv, Conv1D) and conv.weight is weight
        linear = Float8Linear.from_float(nn.Linear(32, 48), config=config)
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            linear.bias.copy_(conv.bias)
        y, y_ref = conv(x), linear(x)
        assert torch.equal(y, y_ref)
        gx, gw = torch.autograd.grad(y.square().sum(), (x, conv.weight))
        gx_ref, gw_ref = torch.autograd.grad(y_ref.square().sum(), (x, linear.weight))
        assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref.t())
        layers.restore()
        assert type(conv) is Conv1D
    del transformers


def test_recipes_are_torchaos_and_emulated_without_fp8_tensor_cores():
    from torchao.float8 import Float8LinearConfig, Float8LinearRecipeName
    assert FP8_RECIPES == tuple(r.value for r in Float8LinearRecipeName)
    assert not fp8.has_fp8_kernels("cpu")
    config = fp8.config_for("rowwise", "cpu")
    assert config.emulate
    assert dataclasses.replace(config, emulate=False) == Float8LinearConfig.from_recipe_name("rowwise")
    own = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    assert fp8.config_for(own, "cpu").enable_fsdp_float8_all_gather is False  # not sharded: nothing to gather
    assert fp8.config_for("tensorwise", "cpu", sharded_model=True).enable_fsdp_float8_all_gather is True
    assert fp8.config_for("rowwise", "cpu", sharded_model=True).enable_fsdp_float8_all_gather is False


@pytest.mark.parametrize("case, message", [
    ("missing", r'torchao is not installed.*pip install "ampatch\[fp8\]"'),
    ("version", r'tested with torchao 0\.18\.x, and torchao 0\.7\.0 is installed.*pip install "ampatch\[fp8\]"'),
])
def test_without_the_fp8_extra_fp8_raises_importerror_naming_it(case, message):
    block = ("sys.modules['torchao'] = None" if case == "missing" else
             "import torchao; torchao.__version__ = '0.7.0'")
    code = textwrap.dedent(f"""
        import sys, torch
        {block}
        import ampatch as amp
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        try:
            amp.initialize(m, opt_level="O5", fp8=True, verbosity=0)
        except ImportError as e:
            print("ImportError:", e)
        print(type(m[0]).__name__, m[0].weight.dtype)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert re.search(message, out), out
    assert out.strip().endswith("Linear torch.float32")  # refused before anything changed


def test_a_torch_too_old_for_torchao_is_refused_naming_the_versions(monkeypatch):
    fp8.require.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    try:
        with pytest.raises(ImportError, match=r"fp8= needs torch >= 2\.11 .*this is torch 2\.9\.1. Upgrade torch"):
            fp8.require()
    finally:
        fp8.require.cache_clear()


def test_fsdp2_without_all_gather_extensions_is_refused_naming_the_alternative():
    from ampatch.model import sharded
    units = sharded.Units.__new__(sharded.Units)  # the FSDP2 records of a torch without extensions
    units.params = [type("OldFSDPParam", (), {"_sharded_param_data": None})()]
    with pytest.raises(RuntimeError, match="FP8 all-gather under FSDP2 needs FSDP2's all-gather extensions.*"
                                           "enable_fsdp_float8_all_gather=False"):
        units.check_all_gather_extensions()


class NamedLinear(nn.Linear):
    """A Linear subclass of the user's (no forward of its own): converted to a float8 class made
    at run time, which must pickle as the user's class does."""

    def tag(self) -> str:
        return "mine"


class SubclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = NamedLinear(32, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_converted_subclass_and_conv1d_pickle_and_copy():
    import io
    torch.manual_seed(0)
    m = SubclassNet()
    layers = fp8.Fp8Layers([m], fp8_choice.choose([m], ["a", "b"]), fp8.config_for("tensorwise", "cpu"))
    assert isinstance(m.a, NamedLinear) and type(m.a) is not NamedLinear
    x = torch.randn(4, 32)
    buf = io.BytesIO()
    torch.save(m, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert type(loaded.a) is type(m.a) and loaded.a.tag() == "mine" and torch.equal(loaded(x), m(x))
    twin = copy.deepcopy(m)
    assert type(twin.a) is type(m.a) and torch.equal(twin(x), m(x))
    layers.restore()
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    conv = nn.Sequential(Conv1D(48, 32), nn.Linear(48, 16))
    layers = fp8.Fp8Layers([conv], fp8_choice.choose([conv]), fp8.config_for("tensorwise", "cpu"))
    buf = io.BytesIO()
    torch.save(conv, buf)
    again = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert type(again[0]) is type(conv[0]) and isinstance(again[0], Conv1D)
    layers.restore()
    del transformers
