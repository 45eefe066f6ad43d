"""Hugging Face conventions kept by a model cast to half (O2/O3/O5), shown on pure-torch
models built the way transformers builds its own (transformers is not needed here):

- `generate` and `get_*_features` reach a submodule directly (Whisper's generate runs its
  encoder on the input features, CLIP's get_image_features its vision tower): their
  floating inputs are cast to half like forward's;
- `save_pretrained` writes the model's dtype into the config next to the FP32 state dict:
  the config names the dtype from before the cast, so `from_pretrained` gives the FP32 model.
"""
from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch
from torch import nn

import ampatch as amp

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CAST_LEVELS = [("O2", F16), ("O2", BF16), ("O3", F16), ("O3", BF16), ("O5", BF16)]
CAST_IDS = ["O2-fp16", "O2-bf16", "O3-fp16", "O3-bf16", "O5-bf16"]


class Config:
    """transformers' PretrainedConfig in miniature: a dtype, written to config.json."""

    def __init__(self, dtype: str = "float32") -> None:
        self.dtype = dtype

    def save_pretrained(self, save_directory) -> None:
        (pathlib.Path(save_directory) / "config.json").write_text(json.dumps({"dtype": self.dtype}))


class Seq2Seq(nn.Module):
    """An encoder-decoder whose generate calls its encoder directly (as transformers'
    GenerationMixin does with `self.get_encoder()`), and whose save_pretrained records
    `self.dtype` (the first floating parameter's) in the config, as PreTrainedModel does."""

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self.encoder = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.GELU())
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10)

    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def forward(self, features: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        if memory is None:
            memory = self.encoder(features).mean(-1)
        return self.head(memory[:, None] + self.embed(tokens))

    def generate(self, features: torch.Tensor, steps: int = 3) -> torch.Tensor:
        memory = self.encoder(features).mean(-1)  # not through forward
        tokens = torch.zeros(features.shape[0], 1, dtype=torch.long)
        for _ in range(steps):
            logits = self(tokens=tokens, memory=memory)
            assert logits.dtype == F32  # forward's outputs reach generate as they reach the user
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)
        return tokens

    def get_audio_features(self, features: torch.Tensor) -> torch.Tensor:
        return self.encoder(features).mean(-1)

    def save_pretrained(self, save_directory, is_main_process: bool = True, push_to_hub: bool = False) -> None:
        self.config.dtype = str(self.dtype).split(".")[1]
        if is_main_process:
            self.config.save_pretrained(save_directory)
        torch.save(self.state_dict(), pathlib.Path(save_directory) / "model.pt")

    @classmethod
    def from_pretrained(cls, save_directory) -> "Seq2Seq":
        config = json.loads((pathlib.Path(save_directory) / "config.json").read_text())
        model = cls()
        model.load_state_dict(torch.load(pathlib.Path(save_directory) / "model.pt", weights_only=True))
        return model.to(getattr(torch, config["dtype"]))  # transformers' default dtype="auto"


def make() -> tuple[Seq2Seq, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Seq2Seq()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 3, 5)


@pytest.mark.parametrize("level,half", CAST_LEVELS, ids=CAST_IDS)
def test_entry_points_cast_their_inputs(level, half):
    model, opt, features = make()
    with torch.no_grad():
        ref_tokens = model.generate(features)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    with torch.no_grad():
        tokens = model.generate(features)
        audio = model.get_audio_features(features)
    assert tokens.shape == ref_tokens.shape and tokens.dtype == torch.long
    assert audio.dtype == F32  # a half output leaves in FP32, as forward's do
    copied = copy.deepcopy(model)  # the copy's generate runs the copy's weights
    with torch.no_grad():
        copied.encoder[0].weight.zero_()
        copied.encoder[0].bias.zero_()
        assert torch.equal(copied.get_audio_features(features), torch.zeros_like(audio))
        assert not torch.equal(model.get_audio_features(features), torch.zeros_like(audio))
    amp.deinitialize()
    assert not {"generate", "get_audio_features", "save_pretrained"} & set(vars(model))


def test_methods_not_defined_by_the_class_are_left_alone():
    model = nn.Sequential(nn.Linear(2, 2))
    model.generate = nn.Linear(2, 2)  # a submodule named like an entry point
    amp.initialize(model, opt_level="O2", verbosity=0)
    assert isinstance(model.generate, nn.Linear) and "save_pretrained" not in vars(model)


@pytest.mark.parametrize("level,half", CAST_LEVELS, ids=CAST_IDS)
def test_save_pretrained_config_names_the_dtype_before_the_cast(level, half, tmp_path):
    model, opt, features = make()
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    model(features, torch.zeros(2, 1, dtype=torch.long)).float().sum().backward()
    opt.step()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"dtype": "float32"}
    assert model.config.dtype == "float32"
    loaded = Seq2Seq.from_pretrained(tmp_path)
    assert all(p.dtype == F32 for p in loaded.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # a second process (is_main_process=False) writes no config
    other = tmp_path / "rank1"
    other.mkdir()
    model.save_pretrained(other, is_main_process=False)
    assert not (other / "config.json").exists()
    amp.deinitialize()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"dtype": "float32"}


def test_save_pretrained_push_to_hub_warns(tmp_path, caplog):
    model, opt, _ = make()
    amp.initialize(model, opt, opt_level="O2", half_dtype=BF16)
    with caplog.at_level("WARNING", logger="ampatch"):
        model.save_pretrained(tmp_path, push_to_hub=True)
    assert "push" in caplog.text and "config.json" in caplog.text
