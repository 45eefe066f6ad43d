"""`fp8_modules` from outside: AMPATCH_FP8_MODULES and a policy file's `fp8_modules` field (what
`diagnose --fp8` verifies its exclusions with, and `tune` writes once it measured them).

- the variable replaces the script's `fp8_modules` (the layers that run in FP8), with a note
  where the two differ, and is ignored with a note while fp8 is off;
- names that match no layer are an error naming the variable (or the policy file);
- a policy's `fp8_modules` is a list of names, not with `fp8: false`, and acts as the variable;
- a real session converts exactly those layers.
"""
from __future__ import annotations

import json

import pytest
import torch
from _config import props
from torch import nn

import ampatch as amp
from ampatch.config import env, policy_file


def test_the_variable_is_read_and_checked():
    assert env.read({env.FP8_MODULES: "fc1, blocks.*.mlp"}).fp8_modules == ("fc1", "blocks.*.mlp")
    assert env.read({}).fp8_modules is None
    with pytest.raises(ValueError, match="AMPATCH_FP8_MODULES=',': names no layer"):
        env.read({env.FP8_MODULES: ","})


def test_it_replaces_the_scripts_choice_and_needs_fp8():
    notes: list[str] = []
    outside = env.read({env.FP8_MODULES: "fc1", env.FP8: "rowwise"})
    got = props("O5", fp8=True, fp8_modules=["fc2"], overrides=outside, notes=notes)
    assert got.fp8 == "rowwise" and got.fp8_modules == ("fc1",)
    assert "ampatch: AMPATCH_FP8_MODULES=fc1 overrides the script's fp8_modules=('fc2',)." in notes
    assert props("O5", fp8=True, overrides=env.read({env.FP8_MODULES: "fc1"})).fp8_modules == ("fc1",)
    notes.clear()
    off = props("O5", overrides=env.read({env.FP8_MODULES: "fc1"}), notes=notes)
    assert off.fp8 is None and off.fp8_modules is None
    assert notes == ["ampatch: AMPATCH_FP8_MODULES=fc1 ignored: fp8 is off (set AMPATCH_FP8 with it)."]
    assert props("O5", fp8=True, enabled=False).fp8_modules is None


def test_a_policy_file_carries_fp8_modules(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"opt_level": "O5", "fp8": "tensorwise", "fp8_modules": ["fc1", "fc2"]}))
    pol = policy_file.load(path)
    assert pol.fp8_modules == ("fc1", "fc2") and pol.keywords()["fp8_modules"] == ["fc1", "fc2"]
    assert "fp8_modules=['fc1', 'fc2']" in pol.describe() and pol.to_dict()["fp8_modules"] == ["fc1", "fc2"]
    merged = policy_file.from_outside(env.read({env.POLICY: str(path)}))
    assert merged.fp8_modules == ("fc1", "fc2") and "fp8_modules ['fc1', 'fc2']" in merged.quote("fp8_modules")
    mine = policy_file.from_outside(env.read({env.POLICY: str(path), env.FP8_MODULES: "fc2"}))
    assert mine.fp8_modules == ("fc2",)  # the variable, set as well, still wins
    assert policy_file.load({"opt_level": "O5"}).fp8_modules is None
    for bad, message in [([], "fp8_modules must be null or a non-empty list"), ([3], "fp8_modules must be null"),
                         ("fc1", None)]:
        data = {"opt_level": "O5", "fp8": True, "fp8_modules": bad}
        if message is None:
            assert policy_file.load(data).fp8_modules == ("fc1",)
        else:
            with pytest.raises(policy_file.PolicyError, match=message):
                policy_file.load(data)
    with pytest.raises(policy_file.PolicyError, match="fp8_modules names the layers that run in FP8, but fp8 is false"):
        policy_file.load({"opt_level": "O5", "fp8": False, "fp8_modules": ["fc1"]})


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16))


def test_a_session_converts_the_layers_named_from_outside(monkeypatch):
    pytest.importorskip("torchao")
    monkeypatch.setenv(env.FP8, "tensorwise")
    monkeypatch.setenv(env.FP8_MODULES, "2")
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp.initialize(m, opt, opt_level="O5", verbosity=0)
    assert [type(m[i]).__name__ for i in (0, 2, 3)] == ["Linear", "Float8Linear", "Linear"]
    assert [layer["converted"] for layer in amp.report().fp8_layers] == [False, True, False]
    amp.deinitialize()
    monkeypatch.setenv(env.FP8_MODULES, "nowhere")
    with pytest.raises(ValueError, match=r"^ampatch: AMPATCH_FP8_MODULES=nowhere: fp8_modules: 'nowhere' matches no "
                                         r"Linear layer .* The Linear layers are: 0, 2, 3\."):
        m = model()
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O5", verbosity=0)
