"""The process-wide asyncio loop that runs in the SDK's I/O thread.

Started on first use, stopped at interpreter exit. Tiers reach it as ``ctx.loop``.
"""

from __future__ import annotations

import asyncio
import atexit
import threading

THREAD_NAME = "kvtiers-io"

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """Return the running I/O loop, starting its thread on first use."""
    global _loop, _thread
    with _lock:
        if _loop is not None and _thread is not None and _thread.is_alive():
            return _loop
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_forever()
            # drain what is left so nothing is destroyed pending
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        thread = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
        thread.start()
        started.wait()
        _loop, _thread = loop, thread
        return loop


def stop_loop(timeout: float = 5.0) -> None:
    """Stop the I/O loop and join its thread (done automatically at exit)."""
    global _loop, _thread
    with _lock:
        loop, thread = _loop, _thread
        _loop = _thread = None
    if loop is None or thread is None:
        return
    if thread.is_alive():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)


def is_io_thread(thread: threading.Thread) -> bool:
    """True for the SDK's own I/O thread (left out of per-tier leak checks)."""
    return thread is _thread


atexit.register(stop_loop)
