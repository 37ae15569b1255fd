"""Typed errors of the streaming store.

Every one derives from :class:`asyncflow_core.errors.StoreError`. A call that
raises one of them has left the store unchanged: the store validates a whole
request before it mutates anything.
"""

from __future__ import annotations

from asyncflow_core.errors import StoreError


class StoreFullError(StoreError):
    """New rows do not fit: the store already holds ``capacity`` live rows.

    Fix: acknowledge (or clear) rows so they can be collected, put with
    ``block=True`` to wait for space, or raise the store's ``capacity``.
    """


class StoreTimeoutError(StoreError):
    """A blocking call (``get_meta`` or ``put``) did not complete before its ``timeout``."""


class LeaseError(StoreError):
    """A lease was acknowledged or released twice, after it expired, or was never handed out."""


class UnknownRowError(StoreError):
    """A row id names no live row (never put, or already collected / cleared)."""


class UnknownColumnError(StoreError):
    """A column is requested that no registered task produces, or rows lack a value for it."""


class ColumnTypeError(StoreError):
    """A written column disagrees with the column's schema or the rows written.

    Wrong dtype or trailing shape (compared with the first write of that
    column), dense vs ragged mismatch, or a row count other than the number
    of rows written.
    """


class StoreClosedError(StoreError):
    """The store was closed; every waiter is woken with this error."""


class InvalidRequestError(StoreError):
    """A request is malformed: batch size 0 or above capacity, unknown task, bad DP rank, ..."""


__all__ = [
    "ColumnTypeError",
    "InvalidRequestError",
    "LeaseError",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StoreTimeoutError",
    "UnknownColumnError",
    "UnknownRowError",
]
