"""`fp8=` and `fp8_modules=` as configuration, before anything changes:

- the values: None/False off, True = "tensorwise", a recipe name in any case, a torchao
  Float8LinearConfig as is; an unknown recipe lists the valid ones; `fp8_modules` names,
  globs or a callable, and only with fp8;
- where it runs: the levels whose layers compute in bfloat16 or FP32 (O0, O4, O5, O1/O2/O3
  with bfloat16); float16 is refused naming O4/O5 and half_dtype=torch.bfloat16; a disabled
  session has none;
- from outside: AMPATCH_FP8 (a recipe, 1, or off), a policy file's `fp8` field, and a level
  forced from outside that computes in float16 drops the script's fp8 with a note.
"""
from __future__ import annotations

import json

import pytest
import torch
from _config import props

from ampatch.config import env, policy_file
from ampatch.config.options import Options
from ampatch.config.values import parse_fp8, parse_fp8_modules

CUDA = torch.device("cuda")  # only its type matters to the rules: float16 by default there


@pytest.mark.parametrize("value, parsed", [(None, None), (False, None), (True, "tensorwise"),
                                           ("RowWise ", "rowwise"), ("rowwise_with_gw_hp", "rowwise_with_gw_hp")])
def test_fp8_values(value, parsed):
    assert Options(fp8=value).fp8 == parsed


def test_bad_fp8_values_name_the_valid_ones():
    with pytest.raises(ValueError, match="'columnwise' is not an fp8 recipe; use True, one of 'tensorwise', "
                                         "'rowwise', 'rowwise_with_gw_hp', a torchao.float8.Float8LinearConfig"):
        Options(opt_level="O5", fp8="columnwise")
    with pytest.raises(TypeError, match="fp8 must be True"):
        Options(fp8=8)


def test_a_torchao_config_passes_as_it_is():
    float8 = pytest.importorskip("torchao.float8")
    config = float8.Float8LinearConfig.from_recipe_name("rowwise")
    assert Options(opt_level="O5", fp8=config).fp8 is config
    assert props("O5", fp8=config).fp8 is config


def test_fp8_modules_values():
    assert parse_fp8_modules("a, b.*") == ("a", "b.*")
    assert parse_fp8_modules(["a", "b,c"]) == ("a", "b", "c")
    choose = lambda module, fqn: True  # noqa: E731
    assert parse_fp8_modules(choose) is choose
    with pytest.raises(ValueError, match="fp8_modules is empty"):
        Options(fp8=True, fp8_modules=[])
    with pytest.raises(TypeError, match="fp8_modules takes layer names"):
        Options(fp8=True, fp8_modules=[torch.nn.Linear])
    with pytest.raises(ValueError, match="fp8 is off: pass fp8=True"):
        Options(fp8_modules="blocks.*")


@pytest.mark.parametrize("level, keywords", [
    ("O0", {}), ("O4", {}), ("O5", {}), ("O1", {"half_dtype": "bfloat16"}), ("O2", {"half_dtype": "bfloat16"}),
    ("O3", {"half_dtype": torch.bfloat16}), ("O5", {"master_weights": "kahan"}), ("O2", {"cast_model_type": False}),
])
def test_fp8_runs_where_the_layers_compute_in_bfloat16_or_fp32(level, keywords):
    assert props(level, device=CUDA, fp8=True, **keywords).fp8 == "tensorwise"


@pytest.mark.parametrize("level, keywords", [("O1", {}), ("O2", {}), ("O3", {}),
                                             ("O2", {"half_dtype": torch.float16})])
def test_fp8_with_float16_is_refused_naming_the_fix(level, keywords):
    with pytest.raises(ValueError) as err:
        props(level, device=CUDA, fp8="rowwise", **keywords)
    message = str(err.value)
    assert f"{level} here computes in float16" in message
    assert "opt_level='O4' or 'O5'" in message and "half_dtype=torch.bfloat16" in message


def test_a_disabled_session_has_no_fp8():
    assert props("O5", fp8=True, enabled=False).fp8 is None


def test_ampatch_fp8_from_outside():
    assert env.read({env.FP8: "rowwise"}).fp8 == "rowwise"
    assert env.read({env.FP8: "1"}).fp8 == "tensorwise"
    assert env.read({env.FP8: "off"}).fp8 is False
    assert env.read({}).fp8 is None
    with pytest.raises(ValueError, match="AMPATCH_FP8='fp4': 'fp4' is not an fp8 recipe; use one of 'tensorwise'"):
        env.read({env.FP8: "fp4"})
    notes: list[str] = []
    assert props("O5", overrides=env.read({env.FP8: "rowwise"})).fp8 == "rowwise"
    assert props("O5", fp8=True, fp8_modules="a", overrides=env.read({env.FP8: "0"}), notes=notes).fp8 is None
    assert notes == ["ampatch: AMPATCH_FP8=0 turns off the script's fp8='tensorwise'."]


def test_a_forced_float16_level_drops_the_scripts_fp8_with_a_note():
    notes: list[str] = []
    forced = env.read({env.OPT_LEVEL: "O2", env.HALF_DTYPE: "float16"})
    got = props("O5", fp8="rowwise", fp8_modules=("fc",), overrides=forced, notes=notes)
    assert got.opt_level == "O2" and got.fp8 is None
    assert any(n.startswith("ampatch: dropping fp8='rowwise', which conflicts with forced O2") for n in notes)
    assert props("O2", fp8=True, overrides=env.read({env.OPT_LEVEL: "O5"})).fp8 == "tensorwise"  # no conflict: kept
    with pytest.raises(ValueError, match="computes in float16"):  # both from outside: a contradiction
        props("O0", overrides=env.read({env.OPT_LEVEL: "O2", env.HALF_DTYPE: "float16", env.FP8: "1"}))


def test_a_policy_file_carries_fp8(tmp_path):
    pol = policy_file.load({"opt_level": "O5", "fp8": "rowwise"})
    assert pol.fp8 == "rowwise" and pol.keywords()["fp8"] == "rowwise" and "fp8='rowwise'" in pol.describe()
    assert policy_file.load({"opt_level": "O5", "fp8": True}).fp8 == "tensorwise"
    assert policy_file.load({"opt_level": "O5", "fp8": False}).keywords()["fp8"] is False
    assert "fp8" not in policy_file.load({"opt_level": "O5"}).keywords()
    assert policy_file.load(pol.to_dict()) == pol
    with pytest.raises(policy_file.PolicyError, match="'fp16' is not an fp8 recipe"):
        policy_file.load({"opt_level": "O5", "fp8": "fp16"})
    with pytest.raises(policy_file.PolicyError, match="fp8 must be null, false, true or a recipe name"):
        policy_file.load({"opt_level": "O5", "fp8": 1})
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"opt_level": "O5", "fp8": "rowwise_with_gw_hp"}))
    outside = policy_file.from_outside(env.read({env.POLICY: str(path)}))
    assert outside.fp8 == "rowwise_with_gw_hp" and "fp8" in outside.sources
    assert policy_file.from_outside(env.read({env.POLICY: str(path), env.FP8: "off"})).fp8 is False  # the variable wins
    applied = policy_file.apply_in_code({"opt_level": "O5"}, {"opt_level": "O5", "fp8": "rowwise"}, set())
    assert applied["fp8"] == "rowwise"


def test_parse_fp8_names_what_it_parses():
    with pytest.raises(ValueError, match="^ampatch: --fp8='x' is not an fp8 recipe; use one of"):
        parse_fp8("x", "--fp8")
