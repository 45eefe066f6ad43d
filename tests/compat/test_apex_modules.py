"""Apex's module layout under the alias: every public module of Apex's `amp`, `optimizers`,
`fp16_utils`, `parallel`, `normalization` and `multi_tensor_apply` packages (its last release
with amp) imports, with its public names; what ampatch does not provide fails to import with
the replacement named, and `importlib.util.find_spec` of it answers None; and
`optimizer._amp_stash` exists after `initialize` whatever was imported before."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import ampatch
import ampatch as amp
from ampatch import compat
from ampatch.compat import alias

# Apex's public modules and the public names each defines or re-exports (read from Apex's
# source before amp was removed; the private `_amp_state` is listed because scripts import it).
APEX_MODULES: dict[str, tuple[str, ...]] = {
    "apex.amp": ("init", "half_function", "float_function", "promote_function", "register_half_function",
                 "register_float_function", "register_promote_function", "scale_loss", "disable_casts",
                 "initialize", "state_dict", "load_state_dict", "master_params", "_amp_state"),
    "apex.amp.amp": ("init", "half_function", "float_function", "promote_function", "register_half_function",
                     "register_float_function", "register_promote_function"),
    "apex.amp.handle": ("scale_loss", "disable_casts", "AmpHandle", "NoOpHandle"),
    "apex.amp.frontend": ("Properties", "O0", "O1", "O2", "O3", "opt_levels", "initialize", "state_dict",
                          "load_state_dict"),
    "apex.amp.opt": ("OptimWrapper",),
    "apex.amp.scaler": ("LossScaler", "scale_check_overflow_python", "axpby_check_overflow_python"),
    "apex.amp._amp_state": ("AmpState", "_amp_state", "warn_or_err", "maybe_print", "master_params"),
    "apex.amp.utils": ("is_cuda_enabled", "get_cuda_version", "is_fp_tensor", "is_nested", "should_cache",
                       "collect_fp_tensor_types", "type_string", "maybe_half", "maybe_bfloat16", "maybe_float",
                       "casted_args", "cached_cast", "verbose_print", "as_inplace", "has_func", "set_func",
                       "set_func_save", "synthesize_flattened_rnn_weights", "new_synthesize_flattened_rnn_weights"),
    "apex.amp.wrap": ("make_cast_wrapper", "cached_cast", "make_promote_wrapper", "promote", "promote_match_arg0",
                      "make_err_wrapper", "err_if_any_half", "err_if_arg0_half", "rnn_cast", "new_rnn_cast",
                      "disable_casts"),
    "apex.amp.compat": ("variable_is_tensor", "tensor_is_variable", "tensor_is_float_tensor", "is_tensor_like",
                        "is_floating_point", "scalar_python_val", "filter_attrs"),
    "apex.amp.rnn_compat": ("has_old_rnns", "whitelist_rnn_cells", "VariableFunctionsShim"),
    "apex.amp.__version__": ("VERSION", "__version__"),
    "apex.amp.lists": (),
    "apex.amp.lists.functional_overrides": ("MODULE", "FP16_FUNCS", "BFLOAT16_FUNCS", "FP32_FUNCS", "BANNED_FUNCS"),
    "apex.amp.lists.torch_overrides": ("MODULE", "FP16_FUNCS", "BFLOAT16_FUNCS", "FP32_FUNCS", "CASTS",
                                       "SEQUENCE_CASTS"),
    "apex.amp.lists.tensor_overrides": ("MODULE", "FP16_FUNCS", "BFLOAT16_FUNCS", "FP32_FUNCS", "CASTS",
                                        "SEQUENCE_CASTS"),
    "apex.optimizers": ("FusedAdam", "FusedSGD", "FusedNovoGrad", "FusedLAMB", "FusedAdagrad",
                        "FusedMixedPrecisionLamb", "FP16_Optimizer"),
    "apex.optimizers.fused_adam": ("FusedAdam",),
    "apex.optimizers.fused_sgd": ("FusedSGD",),
    "apex.optimizers.fused_lamb": ("FusedLAMB",),
    "apex.optimizers.fused_novograd": ("FusedNovoGrad",),
    "apex.optimizers.fused_adagrad": ("FusedAdagrad",),
    "apex.optimizers.fused_mixed_precision_lamb": ("FusedMixedPrecisionLamb",),
    "apex.optimizers.fp16_optimizer": ("FP16_Optimizer",),
    "apex.fp16_utils": ("BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
                        "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm",
                        "convert_module", "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler",
                        "DynamicLossScaler"),
    "apex.fp16_utils.fp16util": ("BN_convert_float", "network_to_half", "convert_module", "convert_network",
                                 "FP16Model", "backwards_debug_hook", "prep_param_lists",
                                 "model_grads_to_master_grads", "master_params_to_model_params", "to_python_float",
                                 "clip_grad_norm", "tofp16"),
    "apex.fp16_utils.fp16_optimizer": ("FP16_Optimizer",),
    "apex.fp16_utils.loss_scaler": ("LossScaler", "DynamicLossScaler", "to_python_float"),
    "apex.parallel": ("DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
                      "create_syncbn_process_group", "LARC", "ReduceOp"),
    "apex.parallel.distributed": ("DistributedDataParallel", "Reducer", "flat_dist_call", "apply_flat_dist_call",
                                  "split_half_float_double", "split_by_type", "extract_tensors",
                                  "import_flatten_impl", "flatten", "unflatten"),
    "apex.parallel.LARC": ("LARC",),
    "apex.parallel.sync_batchnorm": ("SyncBatchNorm",),
    "apex.parallel.sync_batchnorm_kernel": ("SyncBatchnormFunction",),
    "apex.parallel.optimized_sync_batchnorm": ("SyncBatchNorm",),
    "apex.parallel.optimized_sync_batchnorm_kernel": ("SyncBatchnormFunction",),
    "apex.parallel.multiproc": (),
    "apex.normalization": ("FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"),
    "apex.normalization.fused_layer_norm": (
        "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm", "FusedLayerNormAffineFunction",
        "FusedRMSNormAffineFunction", "FusedLayerNormAffineMixedDtypesFunction",
        "FusedRMSNormAffineMixedDtypesFunction", "FusedLayerNormFunction", "FusedRMSNormFunction",
        "fused_layer_norm_affine", "fused_layer_norm", "mixed_dtype_fused_layer_norm_affine",
        "fused_rms_norm_affine", "fused_rms_norm", "mixed_dtype_fused_rms_norm_affine", "manual_rms_norm"),
    "apex.normalization.instance_norm": ("InstanceNorm3dNVFuser",),
    "apex.multi_tensor_apply": ("MultiTensorApply", "multi_tensor_applier"),
    "apex.multi_tensor_apply.multi_tensor_apply": ("MultiTensorApply", "multi_tensor_applier"),
    "amp_C": ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_adam",
              "multi_tensor_sgd", "multi_tensor_lamb", "multi_tensor_novograd", "multi_tensor_adagrad"),
    "apex_C": ("flatten", "unflatten"),
}
# Apex modules ampatch does not provide: the import fails naming the replacement.
NOT_PROVIDED = ("apex.contrib", "apex.contrib.optimizers", "apex.contrib.optimizers.distributed_fused_adam",
                "apex.transformer", "apex.transformer.tensor_parallel", "apex.amp._initialize",
                "apex.amp._process_optimizer", "apex.optimizers.fused_lars", "apex.mlp")


@pytest.mark.parametrize("name", sorted(APEX_MODULES))
def test_each_public_apex_module_imports_with_its_names(apex_alias, name: str) -> None:
    module = importlib.import_module(name)
    assert importlib.util.find_spec(name) is not None
    missing = [n for n in APEX_MODULES[name] if not hasattr(module, n)]
    assert not missing, f"{name} lacks {missing}"
    exec(f"import {name}", {})  # the import statement too, not only importlib


def test_the_rule_maps_apex_names_to_compat_files(apex_alias) -> None:
    assert alias.target_of("apex.optimizers.fused_adam") == "ampatch.compat.optimizers.fused_adam"
    assert alias.target_of("apex.amp.lists.torch_overrides") == "ampatch.compat.amp.lists.torch_overrides"
    assert alias.target_of("apex.amp") == "ampatch" and alias.target_of("amp_C") == "ampatch.compat.extensions.amp_C"
    assert alias.target_of("apex.contrib") is None and alias.target_of("apex") is None
    for name, target in alias.provided_modules().items():
        assert sys.modules[name] is importlib.import_module(target), name


def test_amp_submodules_are_attributes_of_apex_amp_but_never_set_on_ampatch(apex_alias) -> None:
    from apex.amp import frontend, lists, wrap
    assert lists is sys.modules["apex.amp.lists"] and wrap is sys.modules["apex.amp.wrap"]
    assert frontend is sys.modules["apex.amp.frontend"]
    assert "frontend" not in vars(ampatch) and "lists" not in vars(ampatch)
    compat.uninstall_apex_alias()
    assert not hasattr(ampatch, "lists")


def test_the_lists_are_ampatchs_policy(apex_alias) -> None:
    from apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides

    from ampatch.o1.lists import functional, tensor, torch_ops
    assert torch_overrides.MODULE is torch and tensor_overrides.MODULE is torch.Tensor
    assert functional_overrides.MODULE is torch.nn.functional
    assert set(torch_overrides.FP16_FUNCS) == set(torch_ops.HALF) and "mm" in torch_overrides.FP16_FUNCS
    assert set(functional_overrides.FP32_FUNCS) == set(functional.FLOAT)
    assert "softmax" in functional_overrides.FP32_FUNCS
    assert set(tensor_overrides.CASTS) == set(tensor.PROMOTE)
    assert all(isinstance(n, str) and isinstance(m, str) for n, m in functional_overrides.BANNED_FUNCS)


def test_names_without_an_equivalent_raise_at_call_time_naming_the_way(apex_alias) -> None:
    from apex.amp.wrap import make_cast_wrapper
    from apex.parallel.multiproc import main
    from apex.parallel.sync_batchnorm_kernel import SyncBatchnormFunction
    with pytest.raises(NotImplementedError, match="register_half_function"):
        make_cast_wrapper(torch, "mm", None)
    with pytest.raises(NotImplementedError, match="torch.nn.SyncBatchNorm"):
        SyncBatchnormFunction()
    with pytest.raises(NotImplementedError, match="torchrun"):
        main()


def test_what_there_is_behaves(apex_alias) -> None:
    from apex.amp import utils
    from apex.amp.frontend import opt_levels
    from apex.amp.scaler import scale_check_overflow_python
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, manual_rms_norm
    x = torch.randn(3, 8)
    w, b = torch.randn(8), torch.randn(8)
    torch.testing.assert_close(fused_layer_norm_affine(x, w, b, 8, eps=1e-5),
                               torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5))
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(manual_rms_norm(x, (8,), w, 1e-6), rms)
    assert utils.maybe_half([x, 3])[0].dtype == torch.float16 and utils.maybe_half([x, 3])[1] == 3
    assert utils.is_fp_tensor([x, w]) and not utils.is_fp_tensor([x, 1])
    out = torch.empty(3, 8)
    assert scale_check_overflow_python(x, out, 0.5) is False
    torch.testing.assert_close(out, x * 0.5)
    assert scale_check_overflow_python(torch.tensor([float("inf")]), torch.empty(1), 1.0, check_overflow=True)
    assert opt_levels["O2"].options["master_weights"] is True and "O5" in opt_levels


@pytest.mark.parametrize("name", NOT_PROVIDED)
def test_what_is_not_provided_fails_to_import_and_find_spec_answers_none(apex_alias, name: str) -> None:
    assert importlib.util.find_spec(name) is None
    assert not any(n == name or n.startswith(name + ".") for n in sys.modules)
    assert not any(getattr(m, "__dict__", {}).get("__ampatch_probe__") for m in list(sys.modules.values()))
    with pytest.raises(ImportError, match="ampatch does not provide"):
        importlib.import_module(name)
    assert importlib.util.find_spec(name) is None  # again, after a failed import


def test_the_amp_state_loss_scalers_are_apex_amp_scaler_loss_scalers(apex_alias) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampatch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    try:
        scaler_module = importlib.import_module("apex.amp.scaler")
        assert isinstance(ampatch._amp_state.loss_scalers[0], scaler_module.LossScaler)
        assert isinstance(opt._amp_stash, importlib.import_module("apex.amp.stash").AmpOptimizerState)
    finally:
        ampatch.deinitialize()


def test_amp_stash_exists_without_importing_compat_first() -> None:
    """The core asks compat for Apex's optimizer attributes when it patches an optimizer:
    they are there whether or not ampatch.compat was imported before initialize."""
    code = textwrap.dedent("""
        import sys, torch, ampatch
        assert "ampatch.compat" not in sys.modules, "import ampatch loaded compat"
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = ampatch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
        stash = opt._amp_stash
        assert len(stash.all_fp32_from_fp16_params) == 2 and stash.lazy_init_called
        assert all(p.dtype == torch.bfloat16 for p in stash.all_fp16_params)
        opt._lazy_init_maybe_master_weights()
        ampatch.deinitialize()
        assert not hasattr(opt, "_amp_stash")
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_a_package_probed_by_find_spec_still_fails_to_import_what_is_not_provided(apex_alias, tmp_path,
                                                                                     monkeypatch) -> None:
    """`find_spec("pk.sub")` imports `pk`; an `import apex.contrib.xentropy` inside `pk` must
    still raise (a placeholder there would tell `pk` that Apex's kernel exists) and leave no
    placeholder behind."""
    pkg = tmp_path / "probedpk"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "try:\n    import apex.contrib.xentropy\n    FOUND = True\nexcept ImportError:\n    FOUND = False\n")
    (pkg / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("probedpk.sub") is not None
    assert sys.modules["probedpk"].FOUND is False
    assert not any(n.startswith("apex.contrib") for n in sys.modules)
    del sys.modules["probedpk"]


def test_apex_amp_utils_cached_cast_casts_a_changed_parameter_again() -> None:
    from ampatch.compat.amp.utils import cached_cast
    p, cache = torch.nn.Parameter(torch.ones(2)), {}
    assert cached_cast(lambda t: t.half(), p, cache).tolist() == [1.0, 1.0]
    with torch.no_grad():
        p.add_(1)
    assert cached_cast(lambda t: t.half(), p, cache).tolist() == [2.0, 2.0]


def test_maybe_print_follows_the_sessions_verbosity(caplog) -> None:
    from ampatch.compat.amp._amp_state import maybe_print
    model = torch.nn.Linear(2, 2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    with caplog.at_level(logging.INFO, logger="ampatch"):
        maybe_print("quiet please")
    assert "quiet please" not in caplog.text
