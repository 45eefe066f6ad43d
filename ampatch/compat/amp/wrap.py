"""`apex.amp.wrap`: Apex's wrappers that patched one torch function through its handle. ampatch
patches torch itself, from its op lists (`ampatch.o1.lists`), and registers a function of your
own through `amp.register_*_function`; so each of these is importable and raises at call time
naming the registration that does the same."""
from __future__ import annotations

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
for _name, _way in _WAYS.items():
    globals()[_name] = not_provided_function(
        _name, __name__, f"apex.amp.wrap.{_name} patched torch through Apex's handle and is not provided by "
        f"ampatch; use {_way}.")
del _name, _way
