"""Side-by-side benchmark: ampatch O1/O2/O3 against torch.autocast and plain FP32 (issue 8).

Every result is a ratio measured in one process with the modes interleaved: each round runs
every mode once, in a rotating order, and a ratio is the median over rounds of that round's
ratio. On a shared machine absolute times drift; ratios taken inside one round barely do.

    python scripts/bench                          # everything (< 5 minutes on 2 CPU cores)
    python scripts/bench --json bench.json        # the same, and the numbers as JSON
    python scripts/bench --quick --only micro     # a few seconds (the smoke test)
    python scripts/bench --fsdp                   # alone: FSDP2 peak memory per rank, O2 vs O0

Sections (``--only``, comma-separated): ``transformer``, ``mlp``, ``cnn`` (``train`` = all
three), ``micro``, ``o1`` (O1 against autocast on tiny layers: F.linear calls and a 16-layer
MLP step, eager and compiled; issue 44), ``memory``, ``compiled`` (the transformer step under
torch.compile),
and ``gpu``: a GPU-sized transformer (issue 13), the default
with ``--device cuda`` (the CPU-sized workloads are launch-bound there and say nothing about
mixed precision); ``--quick`` shrinks it so that the code path also runs on a CPU.

    python scripts/bench --device cuda --json gpu.json   # gpu + micro, about a minute

Layout: ``cli`` (the command line), ``registry`` (the sections, their targets, the report's
order), ``harness`` (device, clock, the interleaved timing loop, summaries), ``meter``
(memory measurement, also used by scripts/o2_memory.py), ``workloads`` (models and the
step of each mode), ``sections/`` (one module per section), ``child`` (the entry of the
child processes: ``python -m bench.child``, started through ``spawn``).
"""
