"""`apex.amp.frontend`: `initialize`, `state_dict` and `load_state_dict` (ampatch's own), and
Apex's description of the opt levels: `Properties` (a session's resolved properties, as
`_amp_state.opt_properties` shows them) and `opt_levels` (name -> the level, with its
`brief` and the `options` it sets), covering ampatch's O0-O5."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ...config import levels, options
from ...errors import NotSupportedError

if TYPE_CHECKING:  # what __getattr__ reads from the package, for the linters (at run time: lazily, it sits above)
    from ampatch import initialize, load_state_dict, state_dict

__all__ = ["initialize", "state_dict", "load_state_dict", "Properties", "OptLevel", "opt_levels",
           "O0", "O1", "O2", "O3", "O4", "O5"]

Properties = options.Properties

_BRIEF = {"O0": "everything in FP32 (a baseline).",
          "O1": "FP32 model; torch functions cast per op list to float16.",
          "O2": "float16 model with FP32 batch norms and FP32 master weights.",
          "O3": "everything in float16 (a speed baseline).",
          "O4": "FP32 model; torch functions cast per op list to bfloat16.",
          "O5": "bfloat16 model with FP32 batch norms and FP32 master weights."}


class OptLevel:
    """One opt level as Apex described it: `brief`, and the `options` it sets (ampatch's table)."""

    name = ""

    @property
    def brief(self) -> str:
        return f"{self.name}:  {_BRIEF[self.name]}"

    @property
    def options(self) -> dict[str, Any]:
        return dataclasses.asdict(levels.LEVELS[self.name])

    def __call__(self, properties: Any) -> Any:
        """Apex applied a level to a Properties object; ampatch resolves levels in `initialize`."""
        raise NotSupportedError(f"apex.amp.frontend.{self.name}(properties) is not provided: ampatch resolves the "
                                f"level in amp.initialize(model, optimizer, opt_level={self.name!r}, ...); "
                                "_amp_state.opt_properties shows the result.")

    def __repr__(self) -> str:
        return f"<opt level {self.name}>"



def _level(name: str) -> type[OptLevel]:
    """Apex's class of that level (`apex.amp.frontend.O2`), made from ampatch's table."""
    return type(name, (OptLevel,), {"name": name, "__module__": __name__})


O0, O1, O2, O3, O4, O5 = (_level(name) for name in ("O0", "O1", "O2", "O3", "O4", "O5"))

opt_levels = {cls.name: cls() for cls in (O3, O2, O1, O0, O4, O5)}


def __getattr__(name: str) -> Any:
    """`initialize`, `state_dict`, `load_state_dict`: ampatch's own (read from the package
    lazily: it sits above compat)."""
    if name in ("initialize", "state_dict", "load_state_dict"):
        import ampatch
        return getattr(ampatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
