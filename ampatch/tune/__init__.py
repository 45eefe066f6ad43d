"""`ampatch tune`: the fastest precision policy that still trains like FP32, as a policy file.

One job per module:

- ``candidates``: a policy to try (`Candidate`), the ones worth trying on this hardware, and
  the simplicity order that breaks ties;
- ``measure``: one candidate's run (as ``ampatch run --policy`` runs it) and its verdict
  against O0's (finite, no step skipped after the loss scaler's initial back-offs, deviation
  within the tolerance: `ampatch.runs.deviation`);
- ``repair``: a failed candidate's recorded run, and the candidate its diagnosis suggests
  (or why none: a step fault);
- ``timing``: interleaved re-timing against O0 and the spread-based "faster" rule;
- ``search``: the whole search within a budget; ``report``: the table and the JSON.

Nothing here prints: the command line (``ampatch.cli.tune``) gives the stream for progress.
"""
