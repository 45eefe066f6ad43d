"""``ampatch compare``'s own job: a `Row` of statistics per level from the runs' reports
(``rows``), the text table and the JSON (``table``), the ``--plot`` figure (``plot``).

The runs themselves (child processes, fork server, progress, budget, sizing) are
``ampatch.runs``. Nothing here prints: the command line prints the table.
"""
