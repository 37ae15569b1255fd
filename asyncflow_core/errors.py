"""The exception hierarchy.

Every error a user can cause derives from :class:`AsyncflowError`. The CLI
prints such errors as one line (what was wrong and how to fix it) and exits
non-zero; it never shows a traceback for them. Anything else is a bug.
"""

from __future__ import annotations


class AsyncflowError(Exception):
    """Base class of every error asyncflow raises on purpose.

    ``exit_code`` is what the CLI exits with when this error reaches it.
    """

    exit_code: int = 1


class ConfigError(AsyncflowError):
    """A configuration file, override or plugin option is invalid."""

    exit_code = 2


class PluginError(AsyncflowError):
    """A plugin could not be loaded or looked up."""

    exit_code = 2


class PluginConflictError(PluginError):
    """Two plugins registered the same name for the same kind."""


class UnknownPluginError(PluginError):
    """A name was looked up that no plugin registered."""


class UnsupportedFeatureError(AsyncflowError):
    """A backend was asked for an optional capability it declared it lacks.

    Backends raise this (and only this) from a method whose feature flag is
    ``False`` in their ``Features`` model; the conformance suite checks it.
    """


class BatchError(AsyncflowError, ValueError):
    """A ragged tensor or columnar batch was built from inconsistent parts."""


class WeightTransferError(AsyncflowError):
    """A weight transfer failed, was late, or arrived corrupted."""


class EngineError(AsyncflowError):
    """A rollout or training engine failed to do what was asked."""


class StoreError(AsyncflowError):
    """Base class of streaming store errors (see ``asyncflow_core.store``)."""


class EnvironmentFailure(AsyncflowError):
    """An environment's episode failed: an exception, a step over its time limit, a broken worker.

    The message is one line meant for the user (which call, which turn, the
    exception's type and message). The runtime records it as the episode's
    failure reason (``failed: <message>``) and the run goes on.
    """

    def __init__(self, reason: str, *, call: str = "", turn: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.call = call  #: ``open``, ``reset``, ``step``, ``close`` or ``""``
        self.turn = turn  #: 0-based turn of the failing ``step`` (``None`` for open/reset/close)

    def __reduce__(self):  # keep ``call``/``turn`` across processes
        return (_rebuild_environment_failure, (self.reason, self.call, self.turn))


def _rebuild_environment_failure(reason: str, call: str, turn: int | None) -> EnvironmentFailure:
    return EnvironmentFailure(reason, call=call, turn=turn)
