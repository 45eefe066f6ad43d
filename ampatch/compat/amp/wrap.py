"""`apex.amp.wrap`: Apex's wrappers that patched one torch function through its handle. ampatch
patches torch itself, from its op lists (`ampatch.o1.lists`), and registers a function of your
own through `amp.register_*_function`; so each of these is importable and raises at call time
naming the registration that does the same."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..missing import not_provided_function

__all__ = ["make_cast_wrapper", "cached_cast", "make_promote_wrapper", "promote", "promote_match_arg0",
           "make_err_wrapper", "err_if_any_half", "err_if_arg0_half", "rnn_cast", "new_rnn_cast", "disable_casts"]

_WAYS = {
    "make_cast_wrapper": "amp.register_half_function(module, name) or register_float_function(module, name)",
    "cached_cast": "amp.register_half_function(module, name) or register_float_function(module, name)",
    "make_promote_wrapper": "amp.register_promote_function(module, name)",
    "promote": "amp.register_promote_function(module, name)",
    "promote_match_arg0": "amp.register_promote_function(module, name)",
    "make_err_wrapper": "amp.register_float_function(module, name) (ampatch's banned list is ampatch.o1.lists)",
    "err_if_any_half": "amp.register_float_function(module, name) (ampatch's banned list is ampatch.o1.lists)",
    "err_if_arg0_half": "amp.register_float_function(module, name) (ampatch's banned list is ampatch.o1.lists)",
    "rnn_cast": "nothing: ampatch casts torch's RNNs itself at O1/O4",
    "new_rnn_cast": "nothing: ampatch casts torch's RNNs itself at O1/O4",
    "disable_casts": "`with amp.disable_casts():` around the call",
}


def _stand_in(name: str) -> Callable[..., Any]:
    return not_provided_function(name, __name__, f"apex.amp.wrap.{name} patched torch through Apex's handle and is "
                                 f"not provided by ampatch; use {_WAYS[name]}.")


make_cast_wrapper = _stand_in("make_cast_wrapper")
cached_cast = _stand_in("cached_cast")
make_promote_wrapper = _stand_in("make_promote_wrapper")
promote = _stand_in("promote")
promote_match_arg0 = _stand_in("promote_match_arg0")
make_err_wrapper = _stand_in("make_err_wrapper")
err_if_any_half = _stand_in("err_if_any_half")
err_if_arg0_half = _stand_in("err_if_arg0_half")
rnn_cast = _stand_in("rnn_cast")
new_rnn_cast = _stand_in("new_rnn_cast")
disable_casts = _stand_in("disable_casts")
