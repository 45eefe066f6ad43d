"""An O2/O5 checkpoint resumes bit for bit whichever order it loads in: after `initialize`
(DeepSpeed, ignite, a hand-written loop) or into the plain model and optimizer before it
(mmengine's Runner), in a fresh process as a user resumes. `model.state_dict()` holds the
masters' exact values (kahan: the bfloat16 weights, with each compensation in the optimizer's
state entry of its param), aliased, so the model's weights carry them whatever the
optimizer's `load_state_dict` keeps.

Run as a script, this file is the resuming process: `python THIS DIR OUT ORDER:CONFIG...` resumes
each config from DIR/CONFIG.pt in each order given, one after the other (one fresh process for
all of them: an interpreter and torch start once, not once per case), and saves what each gave.
"""
from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
STEPS, SAVE_AFTER = 8, 4
CONFIGS = {  # name: (opt_level, half_dtype, master_weights, optimizer)
    "O2-sgd": ("O2", "float16", None, "sgd"),
    "O2-adamw": ("O2", "float16", None, "adamw"),
    "O5-sgd": ("O5", None, None, "sgd"),
    "O5-adamw": ("O5", None, None, "adamw"),
    "O5-kahan-sgd": ("O5", None, "kahan", "sgd"),
    "O5-kahan-adamw": ("O5", None, "kahan", "adamw"),
}
ORDERS = ["initialize-then-load", "initialize-then-load-optimizer-first", "load-then-initialize"]


def make(seed: int, optimizer: str):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 3))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-4)
    return model, opt


def initialize(model, opt, config: str):
    level, half, mode, _ = CONFIGS[config]
    kw = {"half_dtype": getattr(torch, half)} if half else {}
    if mode:
        kw["master_weights"] = mode
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def batches():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)) for _ in range(STEPS)]


def step(model, opt, x, y) -> float:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.item()


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def resume(order: str, config: str, path: str):
    """A fresh model and optimizer (other initial weights) resumed from `path` in `order`."""
    model, opt = make(1234, CONFIGS[config][3])
    ckpt = torch.load(path, weights_only=True)
    if order == "load-then-initialize":  # mmengine: the plain model and torch optimizer load it
        model.load_state_dict(ckpt["model"], strict=True)
        opt.load_state_dict(ckpt["optimizer"])
        model, opt = initialize(model, opt, config)
    elif order == "initialize-then-load":
        model, opt = initialize(model, opt, config)
        model.load_state_dict(ckpt["model"], strict=True)
        opt.load_state_dict(ckpt["optimizer"])
    else:
        model, opt = initialize(model, opt, config)
        opt.load_state_dict(ckpt["optimizer"])
        model.load_state_dict(ckpt["model"], strict=True)
    amp.load_state_dict(ckpt["amp"])
    return model, opt


def _resume_in_this_process(root: str, out: str, cases: list[str]) -> None:
    """Each ORDER:CONFIG case resumed from ROOT/CONFIG.pt, its losses, weights and masters (or
    its traceback) saved in OUT under that key; the session ends between cases."""
    import traceback
    torch.set_num_threads(1)  # as the test process (tests/conftest.py): the same reduction order
    results: dict[str, object] = {}
    for case in cases:
        order, config = case.split(":")
        torch.manual_seed(99)  # a resumed process draws other numbers before it loads
        try:
            model, opt = resume(order, config, str(Path(root) / f"{config}.pt"))
            losses = [step(model, opt, x, y) for x, y in batches()[SAVE_AFTER:]]
            results[case] = {"losses": losses, "weights": weights(model),
                             "masters": [m.detach().clone() for m in amp.master_params(opt)]}
        except Exception:  # reported by the test of this case
            results[case] = {"error": traceback.format_exc()}
        finally:
            amp.deinitialize()
    torch.save(results, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per config: the uninterrupted run (its losses, final weights and masters) and the
    checkpoint it saved after SAVE_AFTER steps."""
    root = tmp_path_factory.mktemp("ck")
    out = {}
    for config in CONFIGS:
        model, opt = initialize(*make(0, CONFIGS[config][3]), config)
        losses = []
        for i, (x, y) in enumerate(batches()):
            if i == SAVE_AFTER:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()},
                           root / f"{config}.pt")
            losses.append(step(model, opt, x, y))
        out[config] = (root / f"{config}.pt", losses, weights(model),
                       [m.detach().clone() for m in amp.master_params(opt)])
        amp.deinitialize()
    return out


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory) -> dict[str, dict]:
    """Every config resumed in every order, in one fresh process (not the one that saved)."""
    root = next(iter(runs.values()))[0].parent
    out = tmp_path_factory.mktemp("resumed") / "resumed.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(amp.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    cases = [f"{order}:{config}" for config in CONFIGS for order in ORDERS]
    proc = subprocess.run([sys.executable, __file__, str(root), str(out), *cases], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_resume_in_a_fresh_process_is_bit_for_bit(config, order, runs, resumed):
    _, losses, final, masters = runs[config]
    got = resumed[f"{order}:{config}"]
    assert "error" not in got, got.get("error")
    assert got["losses"] == losses[SAVE_AFTER:]  # floats: bit for bit
    assert got["weights"].keys() == final.keys()
    for k in final:
        assert torch.equal(got["weights"][k], final[k]), k
    assert len(got["masters"]) == len(masters)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got["masters"], masters))


@pytest.mark.parametrize("config", ["O2-adamw", "O5-kahan-adamw"])
def test_a_resume_can_fail_the_comparison(config, runs, tmp_path):
    """Control: the weights widened from the half model (what a checkpoint held before) and a
    plain optimizer state, loaded before initialize, do not continue the run bit for bit."""
    path, losses, _, _ = runs[config]
    ckpt = torch.load(path, weights_only=True)
    half = BF16 if CONFIGS[config][1] is None else F16
    ckpt["model"] = {k: v if k.startswith("1.") else v.to(half).float() for k, v in ckpt["model"].items()}
    for entry in ckpt["optimizer"]["state"].values():  # kahan: without the compensations
        entry.pop("ampatch_compensation", None)
    widened = tmp_path / "widened.pt"
    torch.save(ckpt, widened)
    model, opt = resume("load-then-initialize", config, str(widened))
    assert [step(model, opt, x, y) for x, y in batches()[SAVE_AFTER:]] != losses[SAVE_AFTER:]


# ------------------------------------------------------------------ what model.state_dict() holds
def trained(level: str, mode: str | None = None, steps: int = 3, **kw):
    model, opt = make(0, "adamw")
    if mode:
        kw["master_weights"] = mode
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    for x, y in batches()[:steps]:
        step(model, opt, x, y)
    return model, opt


@pytest.mark.parametrize("level,half", [("O2", F16), ("O2", BF16), ("O5", BF16)])
def test_state_dict_holds_the_masters_and_deinitialize_leaves_them(level, half):
    model, opt = trained(level, half_dtype=half)
    masters = {id(p): m for p, m in zip(model.parameters(), amp.master_params(opt))}
    sd = model.state_dict()
    for (name, p) in model.named_parameters():
        assert sd[name].dtype == F32
        assert torch.equal(sd[name], masters[id(p)]), name
    assert any(not torch.equal(sd[n], p.float()) for n, p in model.named_parameters())  # not the half ones
    live = model.state_dict(keep_vars=True)
    assert all(live[n] is p for n, p in model.named_parameters())
    amp.deinitialize()
    assert all(torch.equal(p, sd[n]) and p.dtype == F32 for n, p in model.named_parameters())


def test_a_model_changed_outside_the_optimizer_saves_what_it_holds():
    """A half weight changed after the last step (by the user, or DDP's broadcast before the
    first one): its master no longer rounds to it, and the model's value is saved."""
    model, opt = trained("O2", half_dtype=F16)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    sd = model.state_dict()
    assert torch.equal(sd["0.weight"], model[0].weight.float())
    assert torch.equal(sd["3.weight"], list(amp.master_params(opt))[-2])


def test_kahan_state_dicts_alias_the_weights_and_the_compensations():
    """The model's state dict holds the bfloat16 weights themselves, the optimizer's each
    compensation in its param's state entry, both aliased (a save copies nothing)."""
    model, opt = trained("O5", "kahan", steps=8)
    sd, osd = model.state_dict(), opt.state_dict()
    comp = _kahan_compensations(opt)
    for (name, p), (i, m) in zip(model.named_parameters(), enumerate(amp.master_params(opt))):
        if p.dtype != BF16:
            continue
        assert sd[name].data_ptr() == p.data_ptr(), name
        c = osd["state"][i]["ampatch_compensation"]
        assert c.data_ptr() == comp[id(m)].data_ptr(), name
    assert any(c.abs().sum() > 0 for c in comp.values())


def test_kahan_deinitialize_gives_weight_plus_compensation():
    model, opt = trained("O5", "kahan", steps=8)
    comp = _kahan_compensations(opt)
    expected = {n: p.float() + comp[id(m)].float() if p.dtype == BF16 else p.detach().clone()
                for (n, p), m in zip(model.named_parameters(), amp.master_params(opt))}
    amp.deinitialize()
    for n, p in model.named_parameters():
        assert p.dtype == F32 and torch.equal(p, expected[n]), n


@pytest.mark.parametrize("order", ORDERS[::2])
@pytest.mark.parametrize("target", ["O0", "O1"])
def test_o2_checkpoint_resumed_at_a_level_without_masters(target, order):
    model, opt = trained("O2", half_dtype=F16)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    amp.deinitialize()
    fresh, fopt = make(5, "adamw")
    if order == "load-then-initialize":
        fresh.load_state_dict(ckpt["model"])
        fopt.load_state_dict(ckpt["optimizer"])
        fresh, fopt = amp.initialize(fresh, fopt, opt_level=target, verbosity=0)
    else:
        fresh, fopt = amp.initialize(fresh, fopt, opt_level=target, verbosity=0)
        fresh.load_state_dict(ckpt["model"])
        fopt.load_state_dict(ckpt["optimizer"])
    assert all(torch.equal(p, m) for p, m in zip(fresh.parameters(), masters))
    assert all(torch.equal(p, m) for p, m in zip(amp.master_params(fopt), masters))


@pytest.mark.parametrize("order", ORDERS[::2])
@pytest.mark.parametrize("source", ["O0", "O1"])
def test_fp32_checkpoint_resumed_at_o2_gives_exact_masters(source, order):
    model, opt = trained(source)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    amp.deinitialize()
    fresh, fopt = make(5, "adamw")
    if order == "load-then-initialize":
        fresh.load_state_dict(ckpt["model"])
        fopt.load_state_dict(ckpt["optimizer"])
        fresh, fopt = amp.initialize(fresh, fopt, opt_level="O2", half_dtype=F16, verbosity=0)
    else:
        fresh, fopt = amp.initialize(fresh, fopt, opt_level="O2", half_dtype=F16, verbosity=0)
        fresh.load_state_dict(ckpt["model"])
        fopt.load_state_dict(ckpt["optimizer"])
    assert all(torch.equal(m, ckpt["model"][n]) for (n, _), m in zip(model.named_parameters(),
                                                                     amp.master_params(fopt)))
    assert all(v.dtype == F32 for st in fopt.state.values() for k, v in st.items() if k != "step")


def test_o2_state_dict_loads_strictly_into_a_plain_model_and_copies_stay_plain():
    model, opt = trained("O2", half_dtype=F16)
    sd = model.state_dict()
    plain = make(3, "sgd")[0]
    plain.load_state_dict(sd, strict=True)
    assert all(torch.equal(p, m) for p, m in zip(plain.parameters(), amp.master_params(opt)))
    twin = copy.deepcopy(model)  # an EMA copy: half params of its own, FP32 values of its own, no masters
    masters = list(amp.master_params(opt))
    twin_sd = twin.state_dict()
    for (n, p), m in zip(twin.named_parameters(), masters):
        assert torch.equal(twin_sd[n], m) and twin_sd[n].data_ptr() != m.data_ptr(), n
        assert torch.equal(p, m.to(p.dtype)), n
    restored = pickle.loads(pickle.dumps(model))
    assert restored.state_dict().keys() == sd.keys()


def _kahan_compensations(opt) -> dict[int, torch.Tensor]:
    from ampatch.session.session import current
    (handle,) = [h for h in current().optimizers if h.optimizer is opt]
    return handle.masters.comp


if __name__ == "__main__":
    _resume_in_this_process(sys.argv[1], sys.argv[2], sys.argv[3:])
