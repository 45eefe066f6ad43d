"""``ampatch compare``'s own job: the text table and the JSON of the runs' statistics
(``table``; the statistics themselves are `ampatch.runs.stats`, which tune and diagnose
share), and the ``--plot`` figure (``plot``).

The runs themselves (child processes, fork server, progress, budget, sizing) are
``ampatch.runs``. Nothing here prints: the command line prints the table.
"""
