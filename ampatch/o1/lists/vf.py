"""O1 policy for ``torch._VF``, the module through which ``torch.nn`` calls RNN kernels.

``nn.RNNCell``, ``nn.LSTMCell`` and ``nn.GRUCell`` call ``torch._VF.rnn_tanh_cell`` /
``rnn_relu_cell`` / ``lstm_cell`` / ``gru_cell``, not ``torch.<cell>``: verified in torch
2.13's ``torch/nn/modules/rnn.py``, which does ``from torch import _VF`` and calls
``_VF.<cell>(...)`` in each cell's ``forward`` (a test checks the installed source). The
objects are the same builtins as ``torch.<cell>`` (listed in torch_ops.py for direct
callers), but ``torch._VF`` is its own module object, so it needs its own patches.

``torch._VF`` is a ``types.ModuleType`` subclass whose ``__getattr__`` forwards to
``torch._C._VariableFunctions``: the cells are not in its ``__dict__``, so a patch adds
an entry there and restoring must delete it rather than set it.

The full-sequence functions (``_VF.rnn_tanh``, ``_VF.lstm``, ``_VF.gru``) are not listed:
``nn.RNN/LSTM/GRU.forward`` checks input and weight dtypes in Python before calling them,
so whole RNN modules are handled at the module level (``ampatch.o1.rnn``).
"""
from __future__ import annotations

# Deliberate differences
# ----------------------
# From the torch.autocast op reference: none (the four cells are lower-precision ops there;
# the CUDA-only fused kernels _thnn_fused_lstm_cell/_thnn_fused_gru_cell are reached
# through these entry points and are private).
# From Apex amp: Apex patched the same four cells (through its rnn_compat shim on the
# module nn used); ampatch lists them as ordinary policy data.

HALF: tuple[str, ...] = (
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "lstm_cell",
    "gru_cell",
)

FLOAT: tuple[str, ...] = ()

PROMOTE: tuple[str, ...] = ()

SEQUENCE_PROMOTE: tuple[str, ...] = ()

BANNED: dict[str, str] = {}

NATIVELY_PROMOTING: tuple[str, ...] = ()
