"""``Closing``: ``with`` for objects that have an idempotent ``close()`` (no torch here)."""

from __future__ import annotations

from typing import Any, TypeVar

_C = TypeVar("_C", bound="Closing")


class Closing:
    """A base for objects with a ``close()``: ``with obj:`` gives the object and closes it on
    the way out, on an exception too. The subclass defines ``close``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClosesManager(Closing):
    """A :class:`Closing` over a tiering manager of its own (``self.manager``): ``close()``
    closes it once; after that, ``_check_open()`` raises ``RuntimeError(closed_message)``."""

    manager: Any
    closed_message = "closed"
    _closed = False

    def close(self) -> None:
        """Close the manager: what is in flight is stored first (bounded), then its tiers and
        host arena close. Idempotent."""
        if not self._closed:
            self._closed = True
            self.manager.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(self.closed_message)
