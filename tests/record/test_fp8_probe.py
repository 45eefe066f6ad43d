"""`ampatch.record.fp8_probe` and the FP8 part of a recording: a diagnosed run's own FP8
layers, each measured against bfloat16 on the inputs, weights and output gradients of its real
calls; the run trains exactly as without the probe; the records travel in the recording's
JSON; the per-cast counts say which cast flushes what. And two fixes of `fp8_error` they rest
on: the amax element is not "saturated", and errors stay finite where gradients span more
than float32's squares hold."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.config import env
from ampatch.record.fp8_error import cast_stats, layer_fp8_error
from ampatch.record.fp8_probe import Fp8Probe
from ampatch.record.records import Fp8LayerRecord, Recording

pytest.importorskip("torchao")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(32, 64, bias=False)   # fed rows spanning 12 orders of magnitude
        self.fc = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        h = nn.functional.normalize(self.wide(x), dim=-1, eps=1e-30)
        return self.head(torch.relu(self.fc(h)))


def batches(n: int = 4):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(64, 32, generator=gen) * 10.0 ** (-12 * torch.rand(64, 1, generator=gen))
        out.append((x, torch.randint(0, 8, (64,), generator=gen)))
    return out


def train(probe: bool, steps: int = 3):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O5", fp8="tensorwise", verbosity=0)
    from ampatch.session.session import current
    p = Fp8Probe(current().fp8, "tensorwise") if probe else None
    if p is not None:
        p.attach()
    for x, y in batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        if p is not None:
            p.on_step()
    weights = [w.detach().float().clone() for w in model.parameters()]
    amp.deinitialize()
    return weights, p


def test_each_fp8_layer_measured_on_its_own_calls_and_the_run_unchanged():
    plain, _ = train(probe=False)
    probed, p = train(probe=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed))   # measuring changes nothing
    records = {r.name: r for r in p.result()}
    assert list(records) == ["wide", "fc"]                        # the converted layers (head: the output head)
    wide, fc = records["wide"], records["fc"]
    assert wide.calls == fc.calls == 3 and wide.recipe == "tensorwise" and wide.emulated and wide.kind == "Linear"
    assert set(wide.casts) == {"input@output", "weight@output", "grad_output@grad_input", "weight@grad_input",
                               "grad_output@grad_weight", "input@grad_weight"}
    x = wide.casts["input@output"]
    assert x["dtype"] == "float8_e4m3fn" and x["n"] == 3 * 64 * 32
    assert x["underflow"] / x["n"] > 0.3                           # most of a 12-decade range flushes
    assert fc.casts["input@output"]["underflow"] / fc.casts["input@output"]["n"] < 1e-3
    assert all(0.01 < e < 0.1 for e in fc.out_rel_err) and max(wide.wgrad_rel_err) > 0.5
    assert wide.failure is None and fc.failure is None


def test_a_diagnosed_run_records_its_fp8_layers(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    monkeypatch.setenv(env.DIAGNOSE, str(path))
    monkeypatch.setenv(env.MAX_STEPS, "100")                        # recorded: 2 steps (below), not ended
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O5", fp8="rowwise", verbosity=0)
    for x, y in batches(2):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    amp.deinitialize()                                              # ends the session: the recording is written
    doc = json.loads(path.read_text())
    recording = Recording.from_dict(doc)
    assert [r.name for r in recording.fp8] == ["wide", "fc"] and all(r.calls == 2 for r in recording.fp8)
    assert recording.fp8[0].recipe == "rowwise"
    assert recording.fp8[0].casts["input@output"]["underflow"] == 0  # one scale per row: nothing flushes there
    assert Recording.from_dict(recording.to_dict()) == recording


def test_a_run_without_fp8_records_none(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    monkeypatch.setenv(env.DIAGNOSE, str(path))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)
    x, y = batches(1)[0]
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    amp.deinitialize()
    assert json.loads(path.read_text())["recorded"]["fp8"] == []


def test_records_add_calls_and_skip_high_precision_casts():
    r = Fp8LayerRecord("a", "Linear", "rowwise_with_gw_hp", True)
    found = {"out_rel_err": 0.04, "wgrad_rel_err": 0.0,
             "per_cast": {"input@output": {"dtype": "float8_e4m3fn", "n": 10, "saturated": 0, "underflow": 1,
                                           "subnormal": 2, "granularity": "axiswise", "rel_err": 0.03},
                          "input@grad_weight": {"dtype": "high precision"}}}
    r.add(found)
    r.add(found)
    assert r.calls == 2 and r.out_rel_err == [0.04, 0.04]
    assert r.casts == {"input@output": {"dtype": "float8_e4m3fn", "n": 20, "saturated": 0, "underflow": 2,
                                        "subnormal": 4}}


def test_the_amax_element_does_not_saturate():
    """Scaled to FP8's largest value, the amax can land a float32 rounding above it: it loses
    nothing, and before it was counted as saturated in every layer."""
    from torchao.float8.config import Float8LinearConfig
    cast = Float8LinearConfig.from_recipe_name("tensorwise").cast_config_input
    torch.manual_seed(0)
    for _ in range(20):
        x = torch.randn(64, 64) * torch.rand(1).item() * 1000
        assert cast_stats(x, cast, -1, False)["saturated"] == 0


def test_errors_stay_finite_with_gradients_wider_than_float32_squares():
    lin = nn.Linear(32, 32, bias=False).bfloat16()
    x = torch.randn(16, 32)
    go = torch.randn(16, 32) * 1e25           # ||go||^2 overflows float32
    found = layer_fp8_error(lin, x, "tensorwise", go)
    assert 0 < found["out_rel_err"] < 0.1 and 0 < found["wgrad_rel_err"] < 0.2
