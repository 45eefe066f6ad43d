"""The same Hugging Face cases as model/test_hf_conventions.py, on real (tiny, random) transformers
models. Skipped where transformers is not installed (it is not a dependency of ampatch)."""
from __future__ import annotations

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
