"""The same Hugging Face cases as model/test_hf_conventions.py, on real (tiny, random) transformers
models. Skipped where transformers is not installed (it is not a dependency of ampatch)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import ampatch as amp

transformers = pytest.importorskip("transformers")

F32, BF16 = torch.float32, torch.bfloat16


def test_o2_save_pretrained_then_from_pretrained_gives_the_fp32_model(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    ids = torch.randint(0, 64, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.dtype == F32
    masters = {id(p): m for p, m in zip(model.parameters(), amp.master_params(opt))}
    weight = model.transformer.h[0].mlp.c_fc.weight
    assert torch.equal(loaded.transformer.h[0].mlp.c_fc.weight, masters[id(weight)])  # the exact FP32 master
    assert not torch.equal(masters[id(weight)], weight.float())  # not the bfloat16 weight widened
    assert torch.equal(loaded.lm_head.weight, masters[id(model.transformer.wte.weight)])  # tied: one master
    amp.initialize(loaded, torch.optim.AdamW(loaded.parameters()), opt_level="O2", half_dtype=BF16, verbosity=0)


def test_o2_whisper_generate():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        suppress_tokens=[], begin_suppress_tokens=[])
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model = amp.initialize(model, opt_level="O2", half_dtype=BF16, verbosity=0)
    with torch.no_grad():
        out = model.generate(input_features=torch.randn(2, 8, 16), max_new_tokens=3, do_sample=False)
    assert out.dtype == torch.long and out.shape[0] == 2


def _t5():
    torch.manual_seed(0)
    config = transformers.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=64,
                                   decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(config)


@pytest.mark.parametrize("when", ["before", "after"])
def test_o2_float16_gradient_checkpointing_recomputes_as_the_forward_ran(when):
    """T5's float16 forward makes a clamp bound from Python numbers (`torch.where`): in the half
    dtype while the cast forward runs, in FP32 when torch recomputes the checkpointed layer in
    backward unless the recompute runs under the forward's default dtype too (torch then refuses
    it: "Recomputed values ... have different metadata"). Enabled before or after initialize,
    the checkpointed step gives the gradients of the step without checkpointing."""
    ids, labels = torch.randint(3, 64, (2, 8)), torch.randint(3, 64, (2, 5))
    grads = []
    for checkpointing in (False, True):
        model = _t5()
        if checkpointing and when == "before":
            model.gradient_checkpointing_enable()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=1.0,
                                    verbosity=0)
        if checkpointing and when == "after":
            model.gradient_checkpointing_enable()
        model.train()
        loss = model(input_ids=ids, labels=labels).loss
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads.append([p.grad.clone() for p in amp.master_params(opt)])
        if checkpointing:
            funcs = [m._gradient_checkpointing_func for m in model.modules()
                     if "_gradient_checkpointing_func" in vars(m)]
            assert funcs
            pickle.dumps(funcs[0])  # picklable, as transformers' own partial is
            copy.deepcopy(model)
        amp.deinitialize()
    for plain, checkpointed in zip(*grads):  # the same within float16's rounding (checkpointing changes the
        # order of some FP32 sums too: transformers turns use_cache off)
        assert (plain - checkpointed).norm() <= 1e-2 * plain.norm()
