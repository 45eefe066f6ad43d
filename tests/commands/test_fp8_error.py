"""`ampatch.record.fp8_error`, the per-layer half of `diagnose --fp8`: a layer's FP8 error
against the same layer in bfloat16 on the same inputs, for each recipe; the shares of values
flushed to zero where a tensor's range is wide; a model's table from one real step; the
layer, its parameters and their grads left as they were."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ampatch.record.fp8_error import TABLE_KEYS, capture_layer_io, fp8_error_table, layer_fp8_error

pytest.importorskip("torchao")


def layer() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(256, 256).bfloat16()


def test_each_recipe_against_bfloat16():
    lin = layer()
    x = torch.randn(128, 256)
    weight = lin.weight.detach().clone()
    got = {r: layer_fp8_error(lin, x, r) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    for r in got.values():  # FP8's 3-bit mantissa: a few percent, no saturation (dynamic scaling)
        assert 0.01 < r["out_rel_err"] < 0.06 and r["saturated_share"] == 0.0 and r["emulated"]
    assert got["tensorwise"]["wgrad_rel_err"] > got["rowwise"]["wgrad_rel_err"] > 0.01
    assert got["rowwise_with_gw_hp"]["wgrad_rel_err"] == 0.0  # its weight-gradient GEMM is high precision
    assert got["rowwise_with_gw_hp"]["per_cast"]["input@grad_weight"] == {"dtype": "high precision"}
    assert got["tensorwise"]["per_cast"]["grad_output@grad_input"]["dtype"] == "float8_e5m2"
    assert torch.equal(lin.weight, weight) and lin.weight.grad is None


def test_a_wide_range_flushes_values_to_zero_tensorwise_more_than_rowwise():
    lin = layer()
    x = torch.randn(128, 256)
    x[::2] *= 1e-4  # half the rows tiny: one scale per tensor cannot serve both halves
    tensorwise = layer_fp8_error(lin, x, "tensorwise")
    rowwise = layer_fp8_error(lin, x, "rowwise")
    assert tensorwise["underflow_share"] > rowwise["underflow_share"] > 0
    assert tensorwise["subnormal_share"] > tensorwise["underflow_share"]


def test_a_models_table_from_one_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    run = lambda: model(x).pow(2).mean()  # noqa: E731
    io = capture_layer_io(model, ["0", "2"], run)
    assert io["0"][0].shape == (32, 64) and io["2"][1].shape == (32, 64)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    table = fp8_error_table(model, run)
    assert [row["name"] for row in table] == ["0", "2"]  # the default choice: the head is left out
    assert set(table[0]) == {"name", *TABLE_KEYS} and all(0 < row["out_rel_err"] < 0.1 for row in table)
