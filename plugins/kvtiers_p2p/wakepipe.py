"""A pipe that wakes a thread polling it: the client's I/O thread and the raw bench peer's."""

from __future__ import annotations

import os


class WakePipe:
    """A non-blocking pipe; register :attr:`fd` with a poller, call :meth:`wake` from any
    thread, :meth:`drain` once woken."""

    def __init__(self) -> None:
        self.fd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wake(self) -> None:
        """Make :attr:`fd` readable (a full pipe is full of wake-ups already)."""
        try:
            os.write(self._wfd, b"x")
        except BlockingIOError:
            pass

    def drain(self) -> None:
        """Read every wake-up there is."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._wfd)
