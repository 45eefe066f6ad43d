"""Apex-era scripts as they were written: the alias
looks installed to libraries that probe for Apex, ampatch's log records never break a
script's logging format, and a BERT-style script that imports `amp_C`/`apex_C`, clips with
`multi_tensor_l2norm`, trains with `FusedLAMB` and evaluates with `.cpu().numpy()` runs
unmodified through `ampatch run --apex-alias`."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys
import textwrap
from pathlib import Path

import pytest
from _cli import ampatch_main

from ampatch import compat
from ampatch.compat import alias

ROOT = Path(__file__).resolve().parents[2]


def _is_package_available(name: str) -> bool:
    """How Transformers 4.x probes for a package while it is being imported."""
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_alias_looks_installed_to_importlib(apex_alias) -> None:
    spec = importlib.util.find_spec("apex")
    assert spec is not None and spec.name == "apex" and spec.submodule_search_locations == []
    for name in [*alias.provided_modules(), *alias.EXTENSION_MODULES]:
        assert sys.modules[name].__spec__ is not None, name
        assert importlib.util.find_spec(name) is not None, name
    assert importlib.metadata.version("apex") == alias.APEX_VERSION
    assert importlib.metadata.distribution("apex").metadata["Name"] == "apex"
    assert _is_package_available("apex") and importlib.util.find_spec("apex.amp") is not None  # Lightning 1.x
    assert any(d.metadata["Name"] == "apex" for d in importlib.metadata.distributions())
    compat.uninstall_apex_alias()
    assert importlib.util.find_spec("apex") is None and not _is_package_available("apex")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")


class _RankFilter(logging.Filter):
    """What GNMT and other multi-process scripts put on the root logger."""

    def __init__(self, rank: int, log_all_ranks: bool = True) -> None:
        super().__init__()
        self.rank, self.log_all_ranks = rank, log_all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.log_all_ranks or self.rank == 0


@pytest.fixture
def root_logging():
    root, ours = logging.getLogger(), logging.getLogger("ampatch")
    handlers, filters, level, our_level = list(root.handlers), list(root.filters), root.level, ours.level
    ours.setLevel(logging.INFO)  # an earlier session's verbosity=0 may have left it at ERROR
    yield root
    root.handlers[:], root.filters[:] = handlers, filters
    root.setLevel(level)
    ours.setLevel(our_level)


def test_log_records_fit_a_root_format_with_a_field_set_by_a_root_filter(root_logging, capsys) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(rank)s | %(node)s | %(message)s"))
    root_logging.addHandler(handler)
    root_logging.addFilter(_RankFilter(3))
    logging.getLogger("ampatch").warning("from ampatch")
    err = capsys.readouterr().err
    assert "--- Logging error ---" not in err
    assert "3 | - | from ampatch" in err  # the root's filter set rank; the field nobody sets is "-"
    root_logging.filters[:] = [_RankFilter(1, log_all_ranks=False)]
    logging.getLogger("ampatch").warning("not on rank 1")
    assert "not on rank 1" not in capsys.readouterr().err  # the script's filter drops ampatch's records too


BERT_STYLE = textwrap.dedent('''\
    # Apex-era code: compiled-extension imports at the top, a rank field in the log format.
    import importlib.metadata, importlib.util, logging, sys
    import torch
    import amp_C
    import apex_C
    from apex import amp
    from apex.optimizers import FusedLAMB
    from apex.multi_tensor_apply import multi_tensor_applier

    class RankFilter(logging.Filter):
        def filter(self, record):
            record.rank = 0
            return True

    logging.basicConfig(level=logging.DEBUG, format="%(asctime)s - %(levelname)s - %(rank)s - %(message)s")
    logging.getLogger().addFilter(RankFilter())
    assert importlib.util.find_spec("apex") is not None and importlib.metadata.version("apex")  # transformers' probe
    assert multi_tensor_applier.available

    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 2, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = FusedLAMB(model.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level=sys.argv[1], loss_scale="dynamic", verbosity=2)
    overflow_buf = torch.zeros(1, dtype=torch.int)
    losses = []
    for step in range(12):
        for micro in range(2):  # gradient accumulation, rescaled with amp_C as BERT pretraining does
            loss = torch.nn.functional.cross_entropy(model(x[micro::2]), y[micro::2]) / 2
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], 1.0)
        flat = apex_C.flatten(grads)
        assert flat.numel() == sum(g.numel() for g in grads) and overflow_buf.item() == 0
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() * 2)
    with torch.no_grad():
        logits = model(x)
    preds = logits.detach().cpu().numpy().argmax(axis=1)  # Transformers' evaluation loop
    print(f"grad norm {norm.item():.3f}; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"accuracy {(preds == y.numpy()).mean():.2f}")
    assert losses[-1] < losses[0], losses
''')


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_bert_style_script_runs_unmodified(tmp_path: Path, level: str, capfd: pytest.CaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "run_pretraining.py"
    script.write_text(BERT_STYLE)
    # `ampatch run` through cli.main in this process (tests/_cli.py); the script is its child process
    proc = ampatch_main(capfd, monkeypatch, "run", "--apex-alias", "--", sys.executable, str(script), level,
                        cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "--- Logging error ---" not in out and "- 0 - ampatch:" in out  # ampatch's own lines, with the rank
    assert "accuracy" in out
