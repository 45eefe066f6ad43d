"""Every error ampatch raises on purpose: one family under `AmpatchError`, so that a caller
can catch all of ampatch's refusals with one ``except``.

Each class also keeps the builtin type DESIGN.md promises (and Apex raised), so that
``except ValueError`` and the like in user code go on catching it: bad configuration is a
`ValueError`/`TypeError`, a call in the wrong order a `RuntimeError`, a banned or
unprovided function a `NotImplementedError`, an unprovided Apex module an `ImportError`,
a bad state dict key a `KeyError`.

One message shape: ``ampatch: <what is wrong>; <the fix>`` in one line, with a docs
pointer (``see docs/....md``) when the fix needs more than a line. The ``ampatch: `` prefix
is added here, once (`str(error)`); the raise sites write only what is wrong and the fix,
and a message that quotes another error quotes its `reason` (the text without the prefix).

This module imports nothing of ampatch: it is the lowest layer, importable from every room.
"""
from __future__ import annotations

__all__ = ["PREFIX", "AmpatchError", "ConfigError", "ConfigTypeError", "BadFlagString", "BadLossId",
           "OverrideError", "PolicyError", "RecordingError", "StateDictKeyError", "OrderError", "PlatformError",
           "InvalidCallError", "NotSupportedError", "NotProvidedError", "MissingDependencyError", "ReadOnlyError",
           "UsageError", "CliError", "RunFailed", "NoReference", "ServerError", "InternalError", "reason"]

PREFIX = "ampatch: "


class AmpatchError(Exception):
    """The base of every error ampatch raises on purpose. `str()` is ``"ampatch: " + reason``;
    `args[0]` (and `reason`) hold the message without the prefix, so that pickling across
    processes and messages that quote another error do not repeat it."""

    def __init__(self, message: object = "", *args: object, **kwargs: object) -> None:
        if isinstance(message, str):
            message = message.removeprefix(PREFIX)
        super().__init__(message, *args, **kwargs)  # kwargs: ImportError's name= and path=

    @property
    def reason(self) -> str:
        """What is wrong and the fix, without the ``ampatch: `` prefix."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:  # also KeyError's, which would quote the whole message
        return PREFIX + self.reason


def reason(error: BaseException) -> str:
    """The message of `error` for quoting inside another one: an ampatch error's without its
    prefix, any other exception's as it is."""
    return error.reason if isinstance(error, AmpatchError) else str(error)


# -- bad configuration: ValueError / TypeError ------------------------------------------------

class ConfigError(AmpatchError, ValueError):
    """A bad value given to ampatch: a keyword of `initialize`, an ``AMPATCH_*`` variable, a
    file it reads (policy, checkpoint, recording), a combination that cannot run."""


class ConfigTypeError(AmpatchError, TypeError):
    """An argument of the wrong type (a dtype given as an int, a list where a model goes)."""


class BadFlagString(ConfigError, ConfigTypeError):
    """A flag given as a string other than "True"/"False": a bad value of an accepted type,
    or the wrong type for a flag; both exception types catch it."""


class BadLossId(ConfigTypeError, ConfigError):
    """A loss_id that is not an int: the wrong type, and a bad value of the argument."""


class OverrideError(ConfigError, RuntimeError):
    """An override Apex refused (its `warn_or_err`): a ValueError like every configuration
    error here, and the RuntimeError Apex raised. `hard_override=True` makes it a warning."""


class PolicyError(ConfigError):
    """A policy that cannot be applied: a missing or unreadable file, an unknown key, a bad
    value. The message names it and the fix."""


class RecordingError(ConfigError):
    """A document that is not a recording this ampatch reads (another format, a missing field)."""


class StateDictKeyError(ConfigError, KeyError):
    """An amp state dict with keys it should not have (or lacks some): a KeyError, and a
    ValueError for callers that treat a bad checkpoint as a bad value."""


# -- misuse: RuntimeError ---------------------------------------------------------------------

class OrderError(AmpatchError, RuntimeError):
    """A call in the wrong order or state: `scale_loss` before `initialize`, a model wrapped
    in DistributedDataParallel before `initialize`, a patch applied twice, a session ended."""


class PlatformError(AmpatchError, RuntimeError):
    """This torch or machine lacks what was asked (no torch.distributed, no CUDA, FSDP2
    internals this ampatch does not know)."""


class InvalidCallError(AmpatchError, RuntimeError):
    """A call the library ampatch stands in for refuses with a RuntimeError (Apex's optimizers
    and kernels, torch's hooks): kept a RuntimeError, as they raise it."""


# -- not provided: NotImplementedError / ImportError / AttributeError -------------------------

class NotSupportedError(AmpatchError, NotImplementedError):
    """A banned function, or a feature (of Apex, of a mode) ampatch does not provide; the
    message names the safe alternative."""


class NotProvidedError(AmpatchError, ImportError):
    """An Apex module ampatch does not provide. An `ImportError`, deliberately not a
    `ModuleNotFoundError`: `from apex import contrib` would swallow that one and replace
    the message by a bare "cannot import name"."""


class MissingDependencyError(AmpatchError, ImportError):
    """An optional package a feature needs is missing or of a version ampatch does not run
    with (torchao for fp8, Lightning, Transformers, wrapt)."""


class ReadOnlyError(AmpatchError, AttributeError):
    """An attribute of Apex's state that ampatch computes and does not let be set."""


# -- the command line: the command prints these in one line -----------------------------------

class UsageError(ConfigError):
    """Bad input from the user (a missing script, a device this machine lacks): the command
    line reports it in one line, as a usage error."""


class CliError(UsageError):
    """A usage error: reported as one ``ampatch: error:`` line, exit code 2 (as is every
    `UsageError` the compare package raises)."""


class RunFailed(AmpatchError, RuntimeError):
    """The diagnosed run could not be diagnosed (it crashed first, or never trained under
    amp): the message says why, for the command line to print."""


class NoReference(AmpatchError, RuntimeError):
    """The O0 run failed, never trained under amp, or is unsound: nothing to judge the candidates against.
    `result`: what the command had measured (set by `tune`, for its JSON), or None."""

    result: object = None


class ServerError(AmpatchError, RuntimeError):
    """The fork server did not start, or stopped answering."""


class InternalError(AmpatchError, RuntimeError):
    """A check of ampatch's own invariants failed: a bug in ampatch (or in what drives it out of
    order), not the user's input; the message says what to report."""
