"""`apex.amp.rnn_compat`: Apex's patching of the RNN cells of old PyTorch builds. Current
PyTorch has no old RNN backend (`has_old_rnns()` is False) and ampatch casts RNNs itself
(`ampatch.o1.rnn`), so the patching helpers raise at call time."""
from __future__ import annotations

from ..missing import not_provided_class, not_provided_function

__all__ = ["has_old_rnns", "whitelist_rnn_cells", "VariableFunctionsShim", "RNN_NAMES"]

RNN_NAMES = ["rnn_relu", "rnn_tanh", "gru", "lstm"]
_WAY = "ampatch casts torch's RNNs itself at O1/O4 (amp.initialize); nothing to patch by hand"


def has_old_rnns() -> bool:
    """Whether this PyTorch has the pre-1.0 RNN backend: never, for the PyTorch ampatch supports."""
    return False


whitelist_rnn_cells = not_provided_function("whitelist_rnn_cells", __name__,
                                            f"apex.amp.rnn_compat.whitelist_rnn_cells is not provided: {_WAY}.")
VariableFunctionsShim = not_provided_class("VariableFunctionsShim", __name__,
                                           f"apex.amp.rnn_compat.VariableFunctionsShim is not provided: {_WAY}.")
