"""`props(level, **keywords)`: the session properties `initialize` would resolve, for tests of
the configuration rules (`options.resolve` over an `Options`)."""
from __future__ import annotations

import logging
from typing import Any

from ampatch.config.env import Overrides
from ampatch.config.options import Options, Properties, resolve


def props(opt_level: Any = "O1", *, device: Any = None, overrides: Overrides | None = None,
          hard_override: bool = False, notes: list[str] | None = None, **keywords: Any) -> Properties:
    resolved, said = resolve(Options(opt_level=opt_level, **keywords), device, overrides or Overrides(),
                                        hard_override)
    if notes is not None:
        notes.extend(said)
    for note in said if notes is None else ():  # as initialize does, once the logger follows the session
        logging.getLogger("ampatch").warning(note)
    return resolved
