"""Shared fixtures: every test starts and ends without an ampatch session; `apex_alias`
installs the Apex import alias for one test."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import ampatch as amp

# Creating the first optimizer imports torch._dynamo, which rebinds torch.manual_seed;
# do it once here so identity snapshots taken by tests are stable.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

HALF_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The suite runs tiny ops: one intra-op thread avoids waits on a thread barrier
    (tens of ms per half matmul on a shared 2-core machine). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _no_session():
    amp.deinitialize()
    yield
    amp.deinitialize()


@pytest.fixture(params=HALF_DTYPES, ids=["bf16", "fp16"])
def half(request) -> torch.dtype:
    return request.param


def pytest_collection_modifyitems(config, items):
    # Files holding slow or distributed tests first (each file's own order kept): with two
    # xdist workers taking whole files in this order, the long ones start early instead of
    # leaving one worker alone with the last of them.
    long_files = {item.nodeid.split("::")[0] for item in items
                  if "slow" in item.keywords or "distributed" in item.keywords}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in long_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def apex_alias():
    """The Apex import alias for one test (skipped where a real apex is installed)."""
    from ampatch import compat
    if "apex" not in sys.modules and importlib.util.find_spec("apex") is not None:
        pytest.skip("a real apex is installed here")
    compat.uninstall_apex_alias()
    assert compat.install_apex_alias()
    yield
    compat.uninstall_apex_alias()
