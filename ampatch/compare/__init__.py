"""``ampatch compare``: train once per opt level, each in a fresh process, and compare them.

One job per module:

- ``runner``: child processes (environment, launch, wait, stop, the JSON they write at exit,
  why they failed) and ``run_all``, the levels one after another;
- ``forkserver``: the built-in workloads' runs forked from one process that did the imports;
- ``progress``: the live line of the running level;
- ``budget``: the time budget that sets each level's deadline and step cap;
- ``sizing``: the built-in workload's size, from a quick calibration (or ``--size``);
- ``builtin``: a comparison on a built-in workload (device, commands, title);
- ``rows``: a `Row` of statistics per level; ``table``: the text table and the JSON;
- ``plot``: the ``--plot`` figure (matplotlib, optional);
- ``apex_site/sitecustomize.py``: what ``ampatch run --apex-alias`` puts on a run's path.

Nothing here prints: the command line (``ampatch.cli``) gives the stream to write progress to
and prints the table.
"""


class UsageError(ValueError):
    """Bad input from the user (a missing script, a device this machine lacks): the command
    line reports it in one line, as a usage error."""
