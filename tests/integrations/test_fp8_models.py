"""`fp8=` on the models and frameworks users bring (tiny random configs, no downloads):

- GPT-2: its Conv1D projections run in FP8 and the tied `lm_head` is skipped as the output
  head; trained by `AmpatchTrainer` through a policy and by a Trainer subclass with the
  mixin through `initialize_kwargs`; plain Conv1D again after `train()`;
- a 2-layer `LlamaForCausalLM`: the 14 projections in FP8, `lm_head` skipped; it learns;
- Lightning's `AmpatchPrecision(..., fp8=...)`: the keyword reaches `initialize`.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import ampatch as amp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 3


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def ids(n: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1))


def test_gpt2_conv1d_layers_run_in_fp8_and_the_tied_head_is_skipped():
    model = gpt2()
    amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O5", fp8=True, verbosity=0)
    layers = {layer["name"]: layer for layer in amp.report().fp8_layers}
    assert layers["lm_head"]["reason"] == "output head: weight tied to embedding 'transformer.wte'"
    converted = sorted(n for n, layer in layers.items() if layer["converted"])
    assert converted == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                         "transformer.h.0.mlp.c_proj"]
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, Conv1D) and type(c_attn).__name__ == "Float8Conv1D"
    amp.deinitialize()
    assert type(c_attn) is Conv1D


def test_a_two_layer_llama_learns_with_fp8():
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    amp.initialize(model, opt, opt_level="O5", fp8=True, verbosity=0)
    layers = amp.report().fp8_layers
    assert sum(layer["converted"] for layer in layers) == 14
    assert [layer["reason"] for layer in layers if layer["name"] == "lm_head"] == [
        "output head: the last Linear in module order"]
    batch = ids(BATCH, 256)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


class Watching(transformers.Trainer):
    seen: list[str] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
        self.seen.append(type(model.transformer.h[0].mlp.c_fc).__name__)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def arguments(tmp_path: Path) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
                                          learning_rate=1e-2, report_to="none", use_cpu=True, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


@pytest.mark.parametrize("how", ["policy", "mixin"])
def test_the_trainer_runs_fp8_through_a_policy_or_the_mixins_keywords(how, tmp_path):
    pytest.importorskip("accelerate")
    from ampatch.huggingface import AmpatchTrainer, AmpatchTrainerMixin
    data = [{"input_ids": row, "labels": row} for row in ids(STEPS * BATCH)]
    model = gpt2()
    if how == "policy":
        cls = type("PolicyTrainer", (AmpatchTrainer, Watching), {"seen": []})
        trainer = cls(model=model, args=arguments(tmp_path), train_dataset=data,
                      policy={"opt_level": "O5", "fp8": "rowwise"})
    else:
        cls = type("MixinTrainer", (AmpatchTrainerMixin, Watching), {"seen": []})
        trainer = cls(model=model, args=arguments(tmp_path), train_dataset=data, opt_level="O5",
                      initialize_kwargs={"fp8": "rowwise"})
    trainer.train()
    assert cls.seen == ["Float8Conv1D"] * STEPS
    assert type(model.transformer.h[0].mlp.c_fc) is Conv1D  # undone after train()


def test_lightning_plugin_passes_fp8_to_initialize():
    L = pytest.importorskip("lightning.pytorch")
    from ampatch.lightning import AmpatchPrecision
    seen = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):  # noqa: ANN001
            seen.append(type(self.net[0]).__name__)
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randn(16, 16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[AmpatchPrecision("O5", fp8=True, verbosity=0)])
    module = Module()
    trainer.fit(module, loader)
    assert seen == ["Float8Linear", "Float8Linear"]
    assert type(module.net[0]) is nn.Linear  # teardown put it back
