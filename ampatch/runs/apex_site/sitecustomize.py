"""Put on a run's path by `ampatch run --apex-alias`: `from apex import amp` loads ampatch.

Python imports a module named ``sitecustomize`` at start-up from the first directory of its
path that has one; this one installs the alias, then runs the ``sitecustomize`` it shadows,
if there is one (under another module object: this one is still being imported).
"""
import importlib.machinery
import importlib.util
import os
import sys

import ampatch.compat

ampatch.compat.install_apex_alias()

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
