"""A fixed pool of I/O threads, each with its own page-aligned scratch page.

Tasks are ``fn(scratch)`` callables; ``scratch`` is the worker's 4096-byte aligned
``memoryview`` (the chunk trailer is read into and written from it, so O_DIRECT holds
without allocating per operation). Threads start on first use and are joined by
:meth:`Pool.shutdown`, which runs every task already queued first (within a bound: threads
still inside a task past it are abandoned).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from .direct import aligned_buffer

log = logging.getLogger("kvtiers.fs")

Task = Callable[[memoryview], None]
_STOP = object()


class Pool:
    """``n`` daemon threads named ``<name>-<i>`` pulling tasks from one queue."""

    def __init__(self, name: str, n: int) -> None:
        if n < 1:
            raise ValueError(f"{name}: need at least one thread, got {n}")
        self.name = name
        self.n = n
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._busy: set[threading.Thread] = set()  # threads inside a task now

    def submit(self, task: Task) -> None:
        """Queue ``task``; start the threads if they are not running yet."""
        if not self._threads:
            self.start()
        self._q.put(task)

    def submit_many(self, tasks: list[Task]) -> None:
        if not self._threads:
            self.start()
        put = self._q.put
        for t in tasks:
            put(t)

    def start(self) -> None:
        """Start the threads (idempotent)."""
        with self._lock:
            if self._threads or self._stopped:
                if self._stopped:
                    raise ValueError(f"{self.name}: pool is shut down")
                return
            threads = [threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True) for i in range(self.n)]
            for t in threads:
                t.start()
            self._threads = threads

    def _run(self) -> None:
        page = aligned_buffer()
        scratch = memoryview(page)
        get = self._q.get
        me = threading.current_thread()
        try:
            while True:
                task = get()
                if task is _STOP:
                    return
                self._busy.add(me)
                try:
                    task(scratch)
                except BaseException:  # a task must report its own errors; never lose the thread
                    log.exception("%s: task raised", self.name)
                finally:
                    self._busy.discard(me)
        finally:
            scratch.release()
            page.close()

    def shutdown(self, timeout: float | None = None) -> list[threading.Thread]:
        """Run what is queued, stop and join every thread, waiting at most ``timeout``
        seconds in all; return the threads still inside a task then (stuck in I/O: they are
        daemon threads, abandoned).

        A thread still waiting for its next task then is not stuck: it only has not been
        scheduled yet (a loaded machine can take longer than what is left of ``timeout``
        to run an idle thread), and it ends on its own once it is."""
        with self._lock:
            self._stopped = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._q.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [t for t in threads if t.is_alive() and t in self._busy]
