"""The level a framework integration initializes at (`ampatch.lightning`, `ampatch.huggingface`).

A framework plugin takes `opt_level=None, policy=None` and `amp.initialize`'s other keywords:
a level given explicitly is used (and beats the policy's, as any explicit keyword does); a
policy alone decides the level (a tuned "O1 bfloat16" runs as O1, a tuned O0 in FP32);
with neither, `DEFAULT_LEVEL`, the level the frameworks lack (half weights, FP32 masters).
"""
from __future__ import annotations

from typing import Any

from ampatch.errors import ConfigTypeError, OrderError

from ..session.session import current, set_current

__all__ = ["DEFAULT_LEVEL", "RESERVED", "LevelChoice", "end_session"]

DEFAULT_LEVEL = "O2"
RESERVED = ("models", "optimizers")  # the framework hands the plugin its model and optimizers


class LevelChoice:
    """The `amp.initialize` keywords of one plugin (`who` names it in errors): `keywords()`
    holds `opt_level` when given, or `DEFAULT_LEVEL` when no policy is; `policy` when given;
    and the other keywords as they came."""

    def __init__(self, who: str, opt_level: str | None, policy: Any, initialize_kwargs: dict[str, Any]) -> None:
        if opt_level is not None and not isinstance(opt_level, str):
            raise ConfigTypeError(f"{who}(opt_level) takes a level name such as 'O2' (or None: the policy's level, "
                                  f"else {DEFAULT_LEVEL}), got {opt_level!r}.")
        for name in (*RESERVED, "opt_level", "policy"):
            if name in initialize_kwargs:
                raise ConfigTypeError(f"{who} got {name} among amp.initialize's keywords: the framework passes the "
                                      "model and optimizers to the plugin, and opt_level and policy are the plugin's "
                                      "own arguments; give only amp.initialize's other keywords there.")
        self.who, self.opt_level, self.policy = who, opt_level, policy
        self.extra = dict(initialize_kwargs)

    def keywords(self) -> dict[str, Any]:
        """The keywords for `amp.initialize`, besides the models and optimizers."""
        out = dict(self.extra)
        if self.opt_level is not None:
            out["opt_level"] = self.opt_level
        elif self.policy is None:
            out["opt_level"] = DEFAULT_LEVEL
        if self.policy is not None:
            out["policy"] = self.policy
        return out


def end_session() -> Any:
    """Take the session's `report()`, then end it (`amp.deinitialize()`), and return the
    report: a framework ends the session when training ends (teardown, train() returning),
    after which `amp.report()` has no session to ask, so the plugin keeps the last one for its
    user."""
    session = current()
    if session is None:
        raise OrderError("amp.report() was called with no ampatch session: the plugin's session already ended "
                         "(its `last_report` keeps the report).")
    report = session.report()
    set_current(None)
    session.close()
    return report
