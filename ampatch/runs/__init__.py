"""Runs of a training script or built-in workload in child processes: the layer under
``ampatch run``, ``compare``, ``diagnose`` and ``tune``.

One job per module:

- ``process``: starting a child (its own session, killed with the command), passing the
  command's SIGINT/SIGTERM/SIGHUP on to it, and ending it and what it started;
- ``runner``: a run's environment, launch, wait, stop, the JSON it writes at exit, why it
  failed; `runner.run_level` runs one forced level and reads its `Report`; ``run_all`` the
  levels one after another;
- ``forkserver``: the built-in workloads' runs forked from one process that did the imports;
- ``progress``: the live line of the running level;
- ``budget``: the time budget that sets each level's deadline and step cap;
- ``sizing``: the built-in workload's size, from a quick calibration (or ``--size``);
- ``builtin``: runs of a built-in workload (device, launcher, each level's command);
- ``stats``: a run's statistics against O0's (`RunStats`), shared by compare, tune and diagnose;
- ``deviation``: the one measure of how far a loss curve strays from O0's, and how much it learns;
- ``verdict``: whether a run trains like FP32 (tune holds every candidate to it, diagnose a
  verified fix): finite, no late skipped step (a loss scaler's growth probe aside), learning
  between half and twice what O0 learns at 99% confidence, and a deviation from O0's curve
  no more than the tolerance beyond the noise of its paired differences from O0;
- ``apex_site/sitecustomize.py``: what ``--apex-alias`` puts on a run's path.

Nothing here prints: the command line (``ampatch.cli``) gives the stream to write progress to.
"""

from ampatch.errors import UsageError

__all__ = ["UsageError"]  # where the command line and the runs import it from

