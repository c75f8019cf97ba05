"""The thread an engine owns, shared by the chat engine (engine/engine.py) and the
embedding engine (engine/embedder.py): started when the engine is built, stopped by
``close``, by leaving a ``with`` block, or at interpreter exit (the threads are
daemons; they stop cleanly before MLX is torn down).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

_W = TypeVar("_W", bound="WorkerOwner")

_live: weakref.WeakSet[WorkerOwner] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for owner in list(_live):
        owner.close(timeout=10.0)


class WorkerOwner:
    """``close`` and the context manager over ``_lock`` / ``_closing`` / ``_thread``;
    the subclass sets ``_lock`` and ``_closing`` and calls :meth:`_start_worker`."""

    _lock: threading.Condition
    _closing: bool
    _thread: threading.Thread

    def _start_worker(self, loop: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=loop, name=name, daemon=True)
        _live.add(self)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker thread; requests not answered yet end with an error."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
