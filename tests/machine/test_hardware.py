"""ampatch.machine.hardware: device detection, the once-only slow-half warning at initialize, the
device in report(), the lines `ampatch compare` prints, and the layer-size tip. Fake devices make every branch
run on any machine; the real-device checks compare with torch's own probes."""
from __future__ import annotations

import json
import logging
import types

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.machine import hardware
from ampatch.machine.device_text import machine_line, slow_half_note
from ampatch.session.report import Report

SLOW = "has no fast path"


def fake(kind: str = "cpu", bf16: bool | None = False, fp16: bool | None = False, capability: str | None = None,
         name: str = "Test CPU") -> hardware.DeviceInfo:
    return hardware.DeviceInfo(kind, name, 2, capability, ("avx2",), ("avx512_bf16",),
                               {"bfloat16": bf16, "float16": fp16},
                               {"bfloat16": "basis-bf16", "float16": "basis-fp16"}, torch.__version__)


@pytest.fixture
def fresh_log(monkeypatch):
    """The warning is once per process and device: start from a clean slate."""
    monkeypatch.setattr(hardware, "_logged", set())


def test_cpu_detection_agrees_with_torch_probes() -> None:
    info = hardware.describe("cpu")
    assert info is hardware.describe(torch.device("cpu"))  # detected once
    assert info.type == "cpu" and info.name and info.torch == torch.__version__
    probes = {name: getattr(torch.cpu, name, lambda: False)() for name in
              ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")}
    if probes["_is_avx512_bf16_supported"] or probes["_is_amx_tile_supported"]:
        assert info.native["bfloat16"] is True
    if probes["_is_amx_fp16_supported"]:
        assert info.native["float16"] is True
    if info.native["bfloat16"] is False:
        assert "avx512_bf16" in info.lacks
    d = info.to_dict()
    assert json.loads(json.dumps(d)) == d


def test_cuda_capabilities_from_device_properties(monkeypatch) -> None:
    def props(major: int, minor: int, name: str):
        return types.SimpleNamespace(major=major, minor=minor, name=name, multi_processor_count=80)

    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    for (major, minor), bf16, fp16 in [((9, 0), True, True), ((8, 6), True, True), ((7, 5), False, True),
                                       ((6, 1), False, False)]:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, m=major, n=minor: props(m, n, "GPU"))
        info = hardware._describe_cuda(0)
        assert info.capability == f"{major}.{minor}" and info.native == {"bfloat16": bf16, "float16": fp16}
    t4 = fake("cuda", bf16=False, fp16=True, capability="7.5", name="Tesla T4")
    assert "half_dtype=torch.float16" in hardware.half_advice(t4, torch.bfloat16)
    assert hardware.half_advice(t4, torch.float16) is None
    p100 = fake("cuda", bf16=False, fp16=False, capability="6.0", name="Tesla P100")
    assert "no tensor cores" in hardware.half_advice(p100, "float16")


def test_cpu_advice_says_what_to_expect_and_do() -> None:
    avx2 = fake()
    bf16 = hardware.half_advice(avx2, torch.bfloat16)
    assert "SLOWER than O0" in bf16 and "use O0" in bf16 and "AMX" in bf16
    fp16 = hardware.half_advice(avx2, torch.float16)
    assert "tens of times slower" in fp16 and "O0" in fp16
    assert "half_dtype=torch.bfloat16" in hardware.half_advice(fake(bf16=True), torch.float16)
    assert hardware.half_advice(fake(bf16=True), torch.bfloat16) is None
    assert hardware.half_advice(avx2, torch.float32) is None
    assert hardware.half_advice(fake("mps", bf16=None, fp16=None), torch.float16) is None  # unknown: quiet


def test_initialize_warns_once_when_half_is_not_native(monkeypatch, caplog, fresh_log) -> None:
    monkeypatch.setattr(hardware, "describe", lambda device: fake())
    with caplog.at_level(logging.INFO, logger="ampatch"):
        amp.initialize(torch.nn.Linear(8, 8), opt_level="O0")          # O0: no half, no warning
        amp.initialize(torch.nn.Linear(8, 8), opt_level="O1", verbosity=0)  # silenced
        assert not [r for r in caplog.records if SLOW in r.getMessage()]
        amp.initialize(torch.nn.Linear(8, 8), opt_level="O1")
        amp.initialize(torch.nn.Linear(8, 8), opt_level="O5")          # same device, same dtype: once
    slow = [r for r in caplog.records if SLOW in r.getMessage()]
    assert len(slow) == 1 and slow[0].levelno == logging.WARNING
    assert "bfloat16" in slow[0].getMessage() and "Test CPU" in slow[0].getMessage()


def test_no_warning_where_half_is_native(monkeypatch, caplog, fresh_log) -> None:
    monkeypatch.setattr(hardware, "describe", lambda device: fake(bf16=True))
    with caplog.at_level(logging.INFO, logger="ampatch"):
        amp.initialize(torch.nn.Linear(8, 8), opt_level="O1")
    assert not [r for r in caplog.records if SLOW in r.getMessage()]


def test_report_records_the_device(monkeypatch) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)
    rep = amp.report()
    dev = rep.to_dict()["device"]
    real = hardware.describe("cpu")
    assert dev["type"] == "cpu" and dev["name"] == real.name and dev["torch"] == torch.__version__
    assert dev["half_dtype"] == "bfloat16" and dev["half_native"] is real.native["bfloat16"]
    assert json.loads(json.dumps(rep.to_dict()))["device"] == dev
    assert "device: cpu: " in str(rep) and real.name in str(rep)
    amp.initialize(torch.nn.Linear(8, 8), opt_level="O0", verbosity=0)
    assert amp.report().device.half_dtype is None and amp.report().device.half_native is None
    back = Report.from_dict(json.loads(json.dumps(rep.to_dict())))   # typed again after JSON
    assert back.device == rep.device and back.device.info.native == real.native


def test_model_device() -> None:
    assert hardware.model_device([torch.nn.ReLU()]) == torch.device("cpu")
    assert hardware.model_device([torch.nn.ReLU(), torch.nn.Linear(2, 2).to("meta")]) == torch.device("meta")


def test_machine_line_and_note() -> None:
    d = fake()
    line = machine_line(d, ["bfloat16"])
    assert line.startswith("cpu: Test CPU, 2 cores (flags: avx2; no avx512_bf16)")
    assert f"torch {torch.__version__}" in line and "bfloat16 not native (basis-bf16)" in line
    assert "bfloat16 native" in machine_line(fake(bf16=True), ["bfloat16"])
    note = slow_half_note(d, ["bfloat16"])
    assert note.startswith("note: bfloat16 is emulated on this CPU") and "use O0" in note
    assert slow_half_note(fake(bf16=True), ["bfloat16"]) is None
    assert slow_half_note(d, []) is None
    gpu = fake("cuda", bf16=False, fp16=True, capability="7.5", name="Tesla T4")
    assert "compute capability 7.5" in machine_line(gpu, ["float16", "bfloat16"])
    assert slow_half_note(gpu, ["float16"]) is None
    assert "Tesla T4" in slow_half_note(gpu, ["float16", "bfloat16"])


@pytest.mark.cuda
def test_real_cuda_device() -> None:
    info = hardware.describe("cuda")
    major, _ = torch.cuda.get_device_capability()
    assert info.type == "cuda" and info.name == torch.cuda.get_device_name()
    assert info.native["float16"] is (major >= 7 or bool(torch.version.hip))
    model = torch.nn.Linear(8, 8).cuda()
    amp.initialize(model, opt_level="O1", verbosity=0)
    assert amp.report().device.info.type == "cuda" and amp.report().device.half_dtype == "float16"


def test_float16_on_a_cpu_without_it_warns_at_the_users_line_once(monkeypatch, fresh_log) -> None:
    """`initialize(half_dtype=torch.float16)` on a CPU without native float16: a script with no
    logging configured still sees it (a Python warning at its own line, as for emulated
    bfloat16), once per process; verbosity=0 silences it."""
    import warnings

    monkeypatch.setattr(hardware, "describe", lambda device: fake(bf16=True))
    model = torch.nn.Linear(8, 8)
    with pytest.warns(UserWarning, match="float16 has no fast path on this CPU") as seen:
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", half_dtype=torch.float16)
    assert seen[0].filename == __file__                     # the user's line, not ampatch's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = torch.nn.Linear(8, 8)
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O3",
                       half_dtype=torch.float16)             # once: no second warning
    amp.deinitialize()


# ------------------------------------------------------------------ the layer-size tip
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3)
        self.block = nn.Sequential(nn.Conv2d(16, 20, 1, groups=4), nn.ReLU(), nn.Conv1d(8, 8, 1))
        self.fc = nn.Linear(30, 64)
        self.head = nn.Linear(64, 10)
        self.ok = nn.Linear(64, 64)
        self.lazy = nn.LazyLinear(7)  # not initialized: no in_features yet


def test_dims_not_multiple_of_8_lists_exactly_the_odd_layers() -> None:
    assert hardware.dims_not_multiple_of_8(Net()) == [
        "stem (Conv2d): in_channels=3",
        "block.0 (Conv2d): out_channels=20",
        "fc (Linear): in_features=30",
        "head (Linear): out_features=10",
    ]
    assert hardware.dims_not_multiple_of_8(nn.Linear(5, 8)) == ["<model> (Linear): in_features=5"]
    assert hardware.dims_not_multiple_of_8([nn.Linear(8, 8), nn.Sequential(nn.ConvTranspose2d(8, 9, 2))]) == [
        "model1.0 (ConvTranspose2d): out_channels=9"]
    assert hardware.dims_not_multiple_of_8(nn.Sequential(nn.Linear(16, 32), nn.Embedding(3, 5))) == []


def test_log_dims_tip_logs_once_at_info(caplog) -> None:
    model = nn.Linear(13, 8)  # a listing no other test logs
    with caplog.at_level(logging.INFO, logger="ampatch"):
        assert hardware.log_dims_tip(model, verbosity=0) == []
        assert not caplog.records
        assert hardware.log_dims_tip(model) == ["<model> (Linear): in_features=13"]
        assert hardware.log_dims_tip(model) == ["<model> (Linear): in_features=13"]
    records = [r for r in caplog.records if "multiples of 8" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "in_features=13" in records[0].getMessage()
