"""`ampatch tune`: the fastest precision policy that still trains like FP32, as a policy file.

The library entry point is `tune(...) -> TuneResult` (`command`); ``ampatch tune`` calls it.
One job per module:

- ``command``: the entry point: the job (a script, or a built-in workload), the search, the policy file;
- ``candidates``: a policy to try (`Candidate`), the ones worth trying on this hardware, and
  the simplicity order that breaks ties (O0 the simplest);
- ``measure``: one candidate's run (as ``ampatch run --policy`` runs it), judged by
  `ampatch.runs.verdict` (whether it trains like FP32, the rule diagnose verifies a fix by);
- ``repair``: a failed candidate's recorded run, and the candidate its diagnosis suggests
  (modules kept in FP32, a loss scale, FP32 masters against stalled updates, layers left out of
  FP8; or why none);
- ``fp8``: the FP8 candidates (``--levels O5+fp8``: each torchao recipe) and the rule that an
  emulated one is listed for its fidelity, never chosen for speed;
- ``timing``: interleaved re-timing against O0 and the spread-based "faster" rule;
- ``search``: the whole search within a budget (it stops with `NoProgress`, "run more steps",
  when O0's loss does not fall beyond its own noise); ``report``: the table and the JSON.

Nothing here prints: progress goes to the stream the caller gives (`tune(log=...)`).
"""
from ampatch.tune.command import NoProgress, NoReference, TuneResult, tune

__all__ = ["tune", "TuneResult", "NoReference", "NoProgress"]
