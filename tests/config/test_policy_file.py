"""Policy files: loading checks every key and value, `initialize(policy=)` lets explicit
keywords win (with a warning), `AMPATCH_POLICY` overrides the script, and a policy measured
on another kind of machine warns."""
from __future__ import annotations

import json

import pytest
import torch
from _config import props
from torch import nn

import ampatch as amp
from ampatch.cli import main
from ampatch.config import env
from ampatch.config.policy_file import Policy, PolicyError, from_outside, load, save
from ampatch.machine.hardware import Machine, fingerprint, policy_warning


def _model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_save_then_load_gives_the_same_policy(tmp_path):
    pol = Policy("O2", "bfloat16", ("head", "body.0"), "dynamic", "kahan",
                 measured={"tolerance": 0.02, "machine": fingerprint().to_dict()})
    save(pol, tmp_path / "p.json")
    back = load(tmp_path / "p.json")
    assert back == pol and back.measured["tolerance"] == 0.02
    assert json.loads((tmp_path / "p.json").read_text())["keep_fp32"] == ["head", "body.0"]
    assert load({"opt_level": "o1"}).opt_level == "O1"


@pytest.mark.parametrize("data,words", [
    ({"opt_level": "O1", "keep_fp23": []}, "unknown key(s) 'keep_fp23'"),
    ({"opt_level": "O7"}, "opt_level must be one of"),
    ({}, "opt_level must be one of"),
    ({"opt_level": "O1", "half_dtype": "float8"}, "half_dtype must be"),
    ({"opt_level": "O5", "half_dtype": "float16"}, "is the bfloat16 variant of"),
    ({"opt_level": "O1", "loss_scale": "huge"}, "loss_scale"),
    ({"opt_level": "O1", "keep_fp32": [3]}, "keep_fp32 must be a list of module names"),
    ({"opt_level": "O1", "format": 9}, "format 9"),
    ({"opt_level": "O5", "master_weights": "fp8"}, "master_weights='fp8'"),
])
def test_a_bad_policy_names_what_is_wrong(data, words):
    with pytest.raises(PolicyError, match=None) as err:
        load(data)
    assert words in str(err.value)


def test_a_missing_or_broken_file_names_the_file(tmp_path):
    with pytest.raises(PolicyError, match="not found"):
        load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{opt_level: O1")
    with pytest.raises(PolicyError, match="bad.json.*not valid JSON"):
        load(tmp_path / "bad.json")


def test_initialize_takes_a_policy_and_explicit_keywords_win_with_a_warning(tmp_path):
    save(Policy("O5", "bfloat16", ("2",)), tmp_path / "p.json")
    model, opt = _model()
    model, opt = amp.initialize(model, opt, policy=str(tmp_path / "p.json"), verbosity=0)
    rep = amp.report()
    assert rep.opt_level == "O5" and model[0].weight.dtype == torch.bfloat16 and model[2].weight.dtype == torch.float32
    amp.deinitialize()
    model, opt = _model()
    with pytest.warns(UserWarning, match="opt_level='O1' beats the policy's opt_level='O5'"):
        amp.initialize(model, opt, opt_level="O1", policy={"opt_level": "O5"})
    assert amp.report().opt_level == "O1"
    amp.deinitialize()


def test_a_policy_from_outside_acts_as_the_forced_variables(tmp_path):
    """One rule for settings from outside: the file's fields act as AMPATCH_OPT_LEVEL & co.,
    so the script's keywords that conflict with its level are dropped one by one, with a note."""
    save(Policy("O4", keep_fp32=("b",)), tmp_path / "p.json")
    over = from_outside(env.read({env.POLICY: str(tmp_path / "p.json"), env.KEEP_FP32: "a"}))
    assert over.opt_level == "O4" and over.keep_fp32 == ("a", "b")   # added to the names given from outside
    notes: list[str] = []
    got = props("O2", overrides=over, notes=notes, master_weights=True, half_dtype="float16", loss_scale=128)
    said = " ".join(notes)
    assert got.opt_level == "O4" and got.master_weights is None and got.half_dtype == torch.bfloat16
    assert got.loss_scale == 128.0                                  # does not conflict: kept
    assert "dropping master_weights=True" in said and "dropping half_dtype=torch.float16" in said
    assert f"AMPATCH_POLICY={tmp_path / 'p.json'} (opt_level O4) overrides the script's opt_level=O2" in said
    # the variables, set as well, still win over the file
    both = from_outside(env.read({env.POLICY: str(tmp_path / "p.json"), env.OPT_LEVEL: "O1"}))
    assert both.opt_level == "O1"
    assert from_outside(env.read({})) == env.read({})


def test_AMPATCH_POLICY_overrides_the_scripts_level(tmp_path, monkeypatch):
    save(Policy("O4", "bfloat16"), tmp_path / "p.json")
    monkeypatch.setenv(env.POLICY, str(tmp_path / "p.json"))
    model, opt = _model()
    amp.initialize(model, opt, opt_level="O0", verbosity=0)
    assert amp.report().opt_level == "O4"
    amp.deinitialize()
    monkeypatch.setenv(env.POLICY, str(tmp_path / "missing.json"))
    with pytest.raises(PolicyError, match="missing.json"):
        amp.initialize(*_model(), verbosity=0)


def test_a_policy_measured_on_another_kind_of_machine_warns():
    here = Machine("cpu", "this CPU", {"bfloat16": False, "float16": False})
    there = Policy("O4", "bfloat16", measured={"machine": {"type": "cpu", "name": "that CPU",
                                                            "native": {"bfloat16": True, "float16": False}}})
    assert "native; here (this CPU) it is emulated" in policy_warning(there.measured, "bfloat16", here)
    assert policy_warning(there.measured, "bfloat16", Machine("cpu", "this CPU", {"bfloat16": True})) is None
    assert "measured on cuda" in policy_warning({"machine": {"type": "cuda"}}, "float16", here)
    assert policy_warning(Policy("O1").measured, "bfloat16") is None    # written by hand: nothing to compare
    # where a policy is applied, the warning reaches the user
    cuda = Policy("O1", "float16", measured={"machine": {"type": "cuda", "name": "H200"}})
    with pytest.warns(UserWarning, match="measured on H200"):
        amp.initialize(*_model(), policy=cuda)


def test_run_and_compare_refuse_a_broken_policy_file(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps({"opt_level": "O1", "colour": "red"}))
    assert main(["run", "--policy", str(tmp_path / "p.json"), "--", "python", "-c", "pass"]) == 2
    assert "unknown key(s) 'colour'" in capsys.readouterr().err
    assert main(["compare", "--policy", str(tmp_path / "nope.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_run_policy_applies_the_file_to_an_unmodified_script(tmp_path):
    save(Policy("O4", "bfloat16", ("1",)), tmp_path / "p.json")
    script = tmp_path / "train.py"
    script.write_text("import torch, ampatch as amp\n"
                      "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
                      "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "m, o = amp.initialize(m, o, opt_level='O0', verbosity=0)\n"
                      "assert amp.report().opt_level == 'O4', amp.report().opt_level\n")
    assert main(["run", "--policy", str(tmp_path / "p.json"), "--", "python", str(script)]) == 0


def test_compare_adds_a_row_for_the_policy(tmp_path, capsys):
    save(Policy("O4", "bfloat16"), tmp_path / "p.json")
    script = tmp_path / "train.py"
    script.write_text("import torch, ampatch as amp\n"
                      "torch.manual_seed(0)\n"
                      "m = torch.nn.Linear(8, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "m, o = amp.initialize(m, o, opt_level='O1', verbosity=0)\n"
                      "for _ in range(4):\n"
                      "    loss = m(torch.ones(4, 8)).float().pow(2).mean()\n"
                      "    with amp.scale_loss(loss, o) as s: s.backward()\n"
                      "    o.step(); o.zero_grad()\n")
    code = main(["compare", "--levels", "O0", "--policy", str(tmp_path / "p.json"), "--json", str(tmp_path / "c.json"),
                 "--", "python", str(script)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["level"] for r in rows] == ["O0", "policy:O4"] and rows[1]["half_dtype"] == "bfloat16"
    assert rows[1]["max_loss_dev_vs_O0"] is not None


def test_a_policy_files_keep_fp32_that_matches_no_module_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    save(Policy("O5", "bfloat16", ("hed",), 1.0), path)
    monkeypatch.setenv("AMPATCH_POLICY", str(path))
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=rf"AMPATCH_POLICY={path} \(keep_fp32\): no module is named 'hed'"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
    monkeypatch.setenv("AMPATCH_KEEP_FP32", "bdy")  # the variable's own name is still blamed on it
    with pytest.raises(ValueError, match=r"AMPATCH_KEEP_FP32: no module is named 'bdy'"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
