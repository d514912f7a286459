"""The body's own exception out of an ``open_*`` manager that runs a nursery around it.

A Trio nursery raises what its tasks raised as a ``BaseExceptionGroup``, and the block of an
``async with`` around a nursery runs *in* that nursery. So an exception raised in the body
of ``async with open_engine(...)`` would come out grouped: ``except ClientError`` around the
block would not catch it, and Ctrl-C would show a grouped ``KeyboardInterrupt``. Trio's docs
suggest unwrapping for such managers when the group holds nothing but the body's exception;
:func:`body_errors_unwrapped` does that, and leaves every other group as it is (a background
task failed: the caller must see that failure).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import AsyncIterator, TypeVar

__all__ = ["body_errors_unwrapped"]

T = TypeVar("T")


@asynccontextmanager
async def body_errors_unwrapped(manager: AbstractAsyncContextManager[T]) -> AsyncIterator[T]:
    """Enter ``manager``; an exception the body raises comes out as itself when the
    exception groups ``manager``'s nurseries put around it hold nothing else.

    When they hold more (a background task failed too, or instead: the body then usually
    raised the ``Cancelled`` that failure caused), the group comes out as the nurseries
    raised it.
    """
    body_error: BaseException | None = None
    try:
        async with manager as value:
            try:
                yield value
            except BaseException as exc:
                body_error = exc
                raise
    except BaseExceptionGroup as group:
        if body_error is None or not _only(group, body_error):
            raise
    else:
        return
    try:
        raise body_error  # outside the except clause: the group is not its __context__
    finally:
        body_error = None  # no cycle through this frame


def _only(group: BaseExceptionGroup, exc: BaseException) -> bool:
    """Whether ``exc`` is all ``group`` holds (at any depth of nesting)."""
    _, rest = group.split(lambda e: e is exc)
    return rest is None
