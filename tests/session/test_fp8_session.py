"""`amp.initialize(..., fp8=...)`: a session whose Linear layers run torchao's float8 training.

- in place: the model object the user holds is trained, its parameters the optimizer's,
  its state_dict keys and FP32 values unchanged; `deinitialize` gives plain nn.Linear back
  with the trained weights; `report()` and the start-up notice list every layer with its
  reason and say "fp8 emulated: numerics only, not speed" here (no FP8 tensor cores);
- a refused initialize converts nothing (float16, LBFGS, a pattern matching nothing,
  fp8_modules selecting no convertible layer); a model with nothing to convert warns and
  trains as without fp8;
- composes with O0/O4/O5, the low-memory masters, a dynamic loss scale, clipping on the
  masters, keep_fp32, a policy, torch.compile; a checkpoint resumes exactly;
- torchao is imported only by a session with fp8.
"""
from __future__ import annotations

import copy
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.session.session import current

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

EMULATED = "fp8 emulated: numerics only, not speed"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 16, generator=gen) / 4
    return [(x, x @ w) for x in (torch.randn(64, 32, generator=gen) for _ in range(n))]


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, clip: float | None = None) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def fresh(seed: int = 0, lr: float = 1e-2) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def test_o5_fp8_trains_the_users_model_in_place_and_deinitialize_puts_it_back(caplog):
    model, opt = fresh()
    params, keys = list(model.parameters()), list(model.state_dict())
    with caplog.at_level(logging.INFO, logger="ampatch"), pytest.warns(UserWarning, match=EMULATED):
        got, got_opt = amp.initialize(model, opt, opt_level="O5", fp8=True)
    assert got is model and got_opt is opt
    assert type(model.fc1) is Float8Linear and type(model.head) is nn.Linear
    assert all(a is b for a, b in zip(model.parameters(), params)) and list(model.state_dict()) == keys
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    notice = caplog.text
    assert f"fp8 tensorwise on 2 of 3 Linear layers ({EMULATED})" in notice
    assert "skip head (Linear 64->16): output head: the last Linear in module order" in notice
    losses = train(model, opt, data())
    assert losses[-1] < 0.7 * losses[0]
    report = amp.report()
    assert report.fp8 == "tensorwise" and report.fp8_emulated and report.fp8_label == f"fp8 tensorwise ({EMULATED})"
    assert [(layer["name"], layer["converted"]) for layer in report.fp8_layers] == [
        ("fc1", True), ("fc2", True), ("head", False)]
    assert f"fp8 tensorwise ({EMULATED}): 2 of 3 Linear layers converted" in str(report)
    assert "fp8  fc2 (Linear 64->64): default: Linear with dims multiples of 16" in str(report)
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    amp.deinitialize()
    assert type(model.fc1) is nn.Linear and type(model.fc2) is nn.Linear
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), masters))  # the trained weights, exactly


def test_fp8_close_to_bfloat16_and_each_recipe_runs():
    ref_model, ref_opt = fresh()
    amp.initialize(ref_model, ref_opt, opt_level="O5", verbosity=0)
    ref = train(ref_model, ref_opt, data())
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        model, opt = fresh()
        amp.initialize(model, opt, opt_level="O5", fp8=recipe, verbosity=0)
        losses = train(model, opt, data())
        assert losses != ref and abs(losses[-1] - ref[-1]) < 0.05 * ref[0], (recipe, losses, ref)


@pytest.mark.parametrize("level, keywords", [
    ("O0", {}), ("O4", {}), ("O5", {"master_weights": "stochastic"}), ("O5", {"master_weights": "kahan"}),
    ("O2", {"half_dtype": torch.bfloat16, "loss_scale": "dynamic"}),
])
def test_fp8_composes_with_each_level_and_master_mode(level, keywords):
    model, opt = fresh()
    amp.initialize(model, opt, opt_level=level, fp8="rowwise", verbosity=0, **keywords)
    assert isinstance(model.fc2, Float8Linear)
    losses = train(model, opt, data(), clip=1.0)
    assert losses[-1] < 0.8 * losses[0] and amp.report().skipped_steps == []


def test_keep_fp32_layers_and_a_policy():
    model, opt = fresh()
    amp.initialize(model, opt, policy={"opt_level": "O5", "fp8": "rowwise", "keep_fp32": ["fc2"]}, verbosity=0)
    assert type(model.fc1) is Float8Linear and type(model.fc2) is nn.Linear
    assert {layer["name"]: layer["reason"] for layer in amp.report().fp8_layers}["fc2"] == "kept in FP32 (keep_fp32)"
    assert amp.report().fp8 == "rowwise"


@pytest.mark.parametrize("case", ["float16", "lbfgs", "pattern", "nothing selected"])
def test_a_refused_initialize_converts_nothing(case):
    model, opt = fresh()
    before = copy.deepcopy(model.state_dict())
    kw = {"opt_level": "O5", "fp8": True, "verbosity": 0}
    if case == "float16":
        kw.update(opt_level="O2", half_dtype=torch.float16)
        error, match = ValueError, "half_dtype=torch.bfloat16"
    elif case == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters())
        error, match = ValueError, "fp8 with torch.optim.LBFGS.*first-order optimizer"
    elif case == "pattern":
        kw["fp8_modules"] = ["blocks.*"]
        error, match = ValueError, "'blocks.\\*' matches no Linear layer.*The Linear layers are: fc1, fc2, head"
    else:
        model.fc1 = nn.Linear(32, 60)
        before = copy.deepcopy(model.state_dict())
        kw["fp8_modules"] = ["fc1"]
        error, match = ValueError, "selects no layer that can run in FP8.*60 are not multiples of 16"
    with pytest.raises(error, match=match):
        amp.initialize(model, opt, **kw)
    assert current() is None
    assert all(type(m) is nn.Linear for m in (model.fc1, model.fc2, model.head))
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())


def test_a_model_with_nothing_to_convert_warns_and_trains_as_without_fp8():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="no layer can run in FP8 here, so none was converted"):
        amp.initialize(model, opt, opt_level="O5", fp8=True)
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    assert [layer["reason"] for layer in amp.report().fp8_layers][0].startswith("in/out features 30x20")


def test_a_checkpoint_resumes_exactly():
    batches = data(10)
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O5", fp8=True, verbosity=0)
    train(model, opt, batches[:4])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    rest = train(model, opt, batches[4:])
    amp.deinitialize()
    plain = Net()
    plain.load_state_dict(saved["model"], strict=True)  # an FP8 run's checkpoint loads into a plain model
    model2, opt2 = fresh(seed=1)
    amp.initialize(model2, opt2, opt_level="O5", fp8=True, verbosity=0)
    model2.load_state_dict(saved["model"], strict=True)
    opt2.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    assert train(model2, opt2, batches[4:]) == rest


def test_torch_compile_after_initialize_matches_eager():
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O5", fp8=True, verbosity=0)
    x, y = data(1)[0]
    compiled = torch.compile(model, backend="aot_eager")
    assert torch.equal(compiled(x), model(x))
    before = model.fc1.weight.detach().clone()
    loss = F.mse_loss(compiled(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(model.fc1.weight, before)


def test_torchao_is_imported_only_by_a_session_with_fp8():
    code = textwrap.dedent("""
        import sys, torch
        import ampatch as amp
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        amp.initialize(m, opt_level="O5", verbosity=0)
        print("torchao" in sys.modules)
        amp.initialize(m, opt_level="O5", fp8=True, verbosity=0)
        print("torchao" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
    assert "Failed to load" not in out.stderr  # torchao's own import noise is kept quiet


def test_initialize_again_converts_once_and_deinitialize_leaves_no_trace():
    model, opt = fresh()
    plain_attributes = set(vars(model.fc1))
    amp.initialize(model, opt, opt_level="O5", fp8="rowwise", verbosity=0)
    amp.initialize(model, opt, opt_level="O5", fp8=True, verbosity=0)  # the first session is undone first
    assert type(model.fc1) is Float8Linear and amp.report().fp8 == "tensorwise"
    assert model.fc1.config.cast_config_input.scaling_granularity.value == "tensorwise"
    amp.initialize(model, opt, opt_level="O5", verbosity=0)  # and without fp8: plain layers
    assert type(model.fc1) is nn.Linear and set(vars(model.fc1)) == plain_attributes
