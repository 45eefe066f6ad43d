"""O1/O4 under torch.compile with Inductor imported for the first time inside the session: the
casts are in the captured graph, and what Inductor's code calls after them (its
`extern_kernels`: GEMMs, convolutions) is torch's own, during the session and after
`deinitialize`. Each case runs in a fresh process, where Inductor is not imported yet."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def run(script: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


PRELUDE = """
    import sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import ampatch as amp

    own = torch._C._VariableFunctions  # torch's ops, whatever torch.* holds
    KERNELS = ("mm", "addmm", "bmm", "baddbmm", "convolution")

    def kernels_are_torchs(extern):
        return all(getattr(extern, k) is getattr(own, k) for k in KERNELS if hasattr(extern, k))
"""


def test_inductor_first_imported_under_o1_runs_torchs_own_gemms_after_the_casts():
    run(PRELUDE + """
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    amp.initialize(lin, opt_level="O4", verbosity=0)
    assert "torch._inductor.select_algorithm" not in sys.modules

    def f(x, c):
        h = F.linear(x, lin.weight)
        return torch.addmm(c, h, x.t()) + torch.bmm(h[None], x.t()[None])[0] + h @ x.t()

    graphs = []
    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    x, c = torch.randn(32, 32), torch.randn(32, 32)
    eager = f(x, c)
    compiled = torch.compile(f, backend=backend)(x, c)
    from torch._inductor.select_algorithm import extern_kernels
    from torch._dynamo.variables import tensor, torch as torch_variables
    from ampatch.o1.proxies import is_patch
    assert kernels_are_torchs(extern_kernels), {k: getattr(extern_kernels, k, None) for k in KERNELS}
    assert not [k for k, v in vars(extern_kernels).items() if is_patch(v)]
    assert not [k for k, v in tensor.all_tensor_attrs.items() if is_patch(v)]
    assert not [v for v in torch_variables.ops_consuming_unbacked_scalars if is_patch(v)]
    casts = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert len(casts) >= 4, casts                 # the casts stay in the graph Dynamo captured
    assert compiled.dtype == eager.dtype == torch.bfloat16
    assert torch.allclose(compiled.float(), eager.float(), rtol=0.05, atol=0.5)
    amp.deinitialize()
    assert kernels_are_torchs(extern_kernels)
    a = torch.randn(4, 4)
    assert extern_kernels.addmm(a, a, a).dtype == torch.float32
    print("ok")
    """)


def test_inductor_imported_directly_under_o1_holds_torchs_ops_after_deinitialize():
    run(PRELUDE + """
    amp.initialize(nn.Linear(2, 2), opt_level="O4", verbosity=0)
    import torch._inductor.kernel.mm           # imported without a compile: extern_kernels filled now
    import torch._inductor.kernel.bmm
    from torch._inductor.select_algorithm import extern_kernels
    amp.deinitialize()
    assert kernels_are_torchs(extern_kernels)
    a = torch.randn(4, 4)
    assert extern_kernels.addmm(a, a, a).dtype == torch.float32
    assert extern_kernels.bmm(a[None], a[None]).dtype == torch.float32
    print("ok")
    """)


def test_dynamo_first_imported_under_o1_traces_torchs_ops_and_forgets_the_session():
    """Dynamo's tables of torch's functions are built by name when first needed: built
    under O1, they must still know torch's own ops (else a graph break at every cast op) and
    be rebuilt from torch after `deinitialize`."""
    run(PRELUDE + """
    amp.initialize(nn.Linear(2, 2), opt_level="O4", verbosity=0)
    assert "torch._dynamo" not in sys.modules
    graphs = []
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = lambda x, w: (x @ w).softmax(-1).sum(0)
    x, w = torch.randn(3, 3), torch.randn(3, 3)
    assert torch.compile(fn, backend=backend)(x, w).dtype == torch.float32
    assert len(graphs) == 1                        # no graph break at `@`, softmax or sum
    from torch._dynamo import trace_rules
    assert torch._C.TensorBase.__matmul__ in trace_rules.get_tensor_method()
    amp.deinitialize()
    torch._dynamo.reset()
    assert torch._C.TensorBase.__matmul__ in trace_rules.get_tensor_method()
    assert torch.mm in trace_rules.get_torch_obj_rule_map()
    out = torch.compile(fn, backend=backend)(x, w)
    casts = [n for n in graphs[-1].graph.nodes if n.op == "call_method" and n.target == "to"]
    assert len(graphs) == 2 and not casts and out.dtype == torch.float32
    print("ok")
    """)
