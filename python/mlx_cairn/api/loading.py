"""How a served model is loaded and unloaded: one load at a time, room for it, idle unloads.

Life of a model (one writer: :class:`ModelLifecycle`, under its lock)::

    unloaded --get()/preload--> loading --ok--> loaded --LRU / idle--> unloading --> unloaded
                                   \\--fails--> failed (error kept; the next request retries)

- One load at a time, in its own thread; every request that names a model
  while it loads awaits that one load (a failure answers all of them). A
  waiter that gives up (cancelled, client gone) leaves the load running for
  the others.
- A model with a lease (:mod:`mlx_cairn.api.leases`), or with requests
  waiting for it, is never unloaded.
- Room (``max_loaded`` models, ``memory_budget_gb``): before a load, the
  least recently used models without leases or waiters (never a pinned one)
  are unloaded until the new one fits; if none can go, the load waits up to
  ``load_wait`` seconds, then every waiter gets
  :class:`~mlx_cairn.errors.ModelUnavailable` (503 / ``overloaded_error``,
  ``Retry-After``). A model's memory is measured when it loads (weights plus
  KV pool); before its first load its size on disk stands in.
- ``idle_unload``: a model with no lease for that many seconds is unloaded
  (never during a load), and MLX's buffer cache is cleared. A request may set
  its own model's idle time (:meth:`ModelLifecycle.keep_alive`, the Ollama
  API's ``keep_alive``): 0 unloads it as soon as its last lease ends.

Which names reach which model is :mod:`mlx_cairn.api.registry`'s business.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mlx_cairn.api.leases import ModelLease, ServedModel
from mlx_cairn.errors import CairnError, ModelLoadError, ModelUnavailable
from mlx_cairn.models.hub import Progress, is_hub_name, resolve

log = logging.getLogger("mlx_cairn.api")
#: Loads and unloads (info lines; the api logger keeps to errors and refusals).
life_log = logging.getLogger("mlx_cairn.models.lifecycle")

#: File suffixes of weight files (``model.gguf`` is also served as ``model``).
MODEL_FILE_SUFFIXES = (".gguf", ".safetensors")

#: Seconds a load waits for room before its requests get 503.
DEFAULT_LOAD_WAIT = 60.0

Loader = Callable[[str | None], Any]
EngineFactory = Callable[[Any], Any]
#: Called under the lifecycle's lock once a model is loaded (the registry adds the
#: name the loader reports).
OnLoaded = Callable[[ServedModel, Any], None]


def disk_size(source: str | None) -> int:
    """Bytes of a model's weight files on disk (0 when unknown): the size guess before a load."""
    if source is None or is_hub_name(source):
        return 0
    p = Path(source).expanduser()
    try:
        if p.is_file():
            return p.stat().st_size
        return sum(f.stat().st_size for f in p.glob("*") if f.suffix in MODEL_FILE_SUFFIXES)
    except OSError:
        return 0


def measured_bytes(loaded: Any, engine: Any) -> int:
    """Weights (every parameter array) plus the engine's KV pool and state slots, in bytes."""
    total = 0
    model = getattr(loaded, "model", None)
    if model is not None and hasattr(model, "parameters"):
        from mlx.utils import tree_flatten

        flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        total += sum(int(v.nbytes) for _, v in flat)
    stats = getattr(engine, "stats", None)
    if callable(stats):
        with contextlib.suppress(Exception):
            st = stats()
            total += int(st.kv_cache_bytes) + int(st.state_cache_bytes)
    return total


class ModelLifecycle:
    """Loads, leases and unloads the served models: lazy single-flight loading, LRU
    unloading, idle unloads. Works on :class:`ServedModel` slots; names are resolved
    by the caller (:class:`~mlx_cairn.api.registry.ModelRegistry`)."""

    def __init__(
        self,
        models: list[ServedModel],
        *,
        loader: Loader | None = None,
        engine_factory: EngineFactory | None = None,
        max_loaded: int | None = None,
        memory_budget_gb: float | None = None,
        idle_unload: float | None = None,
        load_wait: float = DEFAULT_LOAD_WAIT,
        allow_download: bool | None = None,
        on_loaded: OnLoaded | None = None,
    ) -> None:
        self.models = models
        self.loader = loader
        self.engine_factory = engine_factory
        self._on_loaded = on_loaded
        self.max_loaded = max_loaded
        self.memory_budget = None if memory_budget_gb is None else memory_budget_gb * 2**30
        self.idle_unload = idle_unload
        self.load_wait = load_wait
        self.allow_download = allow_download
        self._cond = threading.Condition()
        self._load_serial = threading.Lock()  # one load or unload pass at a time
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        if idle_unload is not None:
            self._start_reaper()

    def _start_reaper(self) -> None:
        with self._cond:
            if self._reaper is not None:
                return
            self._reaper = threading.Thread(
                target=self._reap_loop, name="cairn-idle-unload", daemon=True
            )
        self._reaper.start()

    # ----------------------------------------------------------- leases

    async def get(self, sm: ServedModel) -> ModelLease:
        """Load ``sm`` if needed (awaiting a load already under way) and return a lease
        on it. Raises ModelLoadError / ModelUnavailable for every waiter.

        A request that has to wait, or that arrives while earlier waiters have
        not submitted yet, gets a turn (see :meth:`ModelLease.turn`).
        """
        ticket: int | None = None
        try:
            while True:
                with self._cond:
                    if ticket is None and (sm.state != "loaded" or sm._turns.outstanding()):
                        ticket = sm._turns.take()
                lease = self._try_lease(sm, ticket)
                if lease is not None:
                    return lease
                with self._cond:
                    sm.waiting += 1
                try:
                    await asyncio.wrap_future(self._start_load(sm))
                finally:
                    with self._cond:
                        sm.waiting -= 1
                        self._cond.notify_all()
        except BaseException:
            if ticket is not None:
                sm._turns.done(ticket)  # a failed or abandoned wait gives its turn up
            raise

    def lease(self, sm: ServedModel, timeout: float | None = None) -> ModelLease:
        """:meth:`get` for synchronous callers (tools, tests)."""
        while True:
            lease = self._try_lease(sm)
            if lease is not None:
                return lease
            with self._cond:
                sm.waiting += 1
            try:
                self._start_load(sm).result(timeout)
            finally:
                with self._cond:
                    sm.waiting -= 1
                    self._cond.notify_all()

    def _try_lease(self, sm: ServedModel, ticket: int | None = None) -> ModelLease | None:
        with self._cond:
            if sm.state != "loaded" or sm.engine is None:
                return None
            sm.active += 1
            sm.last_used = time.time()
            engine = sm.engine

        def release() -> None:
            with self._cond:
                sm.active -= 1
                sm.last_used = time.time()
                self._cond.notify_all()

        return ModelLease(sm, engine, release, ticket)

    # ----------------------------------------------------------- loading

    def preload(self, targets: Iterable[ServedModel]) -> None:
        """Load ``targets`` now, one after another; failures are logged and remembered."""
        for sm in dict.fromkeys(targets):
            try:
                self._start_load(sm).result()
            except CairnError as e:
                log.error("%s", e.message)

    def _start_load(self, sm: ServedModel) -> concurrent.futures.Future[None]:
        with self._cond:
            if sm.state == "loaded":
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                done.set_result(None)
                return done
            if sm._loading is None:
                sm._loading = concurrent.futures.Future()
                # Running from the start: a waiter that gives up (its asyncio wrapper is
                # cancelled) must not cancel the load that the other waiters share.
                sm._loading.set_running_or_notify_cancel()
                threading.Thread(
                    target=self._load, args=(sm, sm._loading), name="cairn-load", daemon=True
                ).start()
            return sm._loading

    def _load(self, sm: ServedModel, fut: concurrent.futures.Future[None]) -> None:
        try:
            with self._load_serial:
                self._make_room(sm)
                self._load_now(sm)
                self._trim(sm)
        except BaseException as e:
            _end_mlx_thread()
            with self._cond:
                sm._loading = None
                if sm.state == "loading":
                    sm.state = "unloaded"
                self._cond.notify_all()
            fut.set_exception(
                e if isinstance(e, CairnError) else ModelLoadError(f"{type(e).__name__}: {e}")
            )
            return
        _end_mlx_thread()
        with self._cond:
            sm._loading = None
            self._cond.notify_all()
        fut.set_result(None)

    def _load_now(self, sm: ServedModel) -> None:
        with self._cond:
            sm.state = "loading"
        start = time.perf_counter()
        try:
            source = sm.source
            if source is not None and is_hub_name(source):
                sm.download = Progress()
                source = str(
                    resolve(source, allow_download=self.allow_download, progress=sm.download)
                )
            loader = self.loader or _default_loader
            factory = self.engine_factory or _default_engine_factory
            loaded = loader(source)
            engine = factory(loaded)
        except Exception as e:  # any loader failure is a 500 for this model only
            sm.error = f"model {sm.name!r} failed to load: {type(e).__name__}: {e}"
            raise ModelLoadError(sm.error) from e
        seconds = time.perf_counter() - start
        with self._cond:
            sm.loaded, sm.engine, sm.error = loaded, engine, None
            sm.state = "loaded"
            sm.load_seconds = seconds
            sm.loaded_at = sm.last_used = time.time()
            sm.loads += 1
            sm.memory_bytes = measured_bytes(loaded, engine) or sm.memory_bytes
            sm.context_length = _context_length(engine, loaded) or sm.context_length
            if self._on_loaded is not None:
                self._on_loaded(sm, loaded)
        life_log.info("model %s ready in %.2fs (%d MiB)", sm.name, seconds, sm.memory_bytes >> 20)

    def _make_room(self, sm: ServedModel) -> None:
        """Unload LRU models until ``sm`` fits; wait (up to ``load_wait``) while none can go."""
        if self.max_loaded is None and self.memory_budget is None:
            return
        deadline = time.monotonic() + self.load_wait
        with self._cond:
            while True:
                victims = self._victims_for(sm)
                if victims is not None:
                    taken = [(v, self._take_locked(v)) for v in victims]
                    break
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    busy = [m.name for m in self.models if m.engine is not None]
                    raise ModelUnavailable(
                        f"model {sm.name!r} cannot be loaded now: no room, and every loaded "
                        f"model ({', '.join(busy)}) is pinned or serving requests; retry later",
                        retry_after=max(1.0, min(self.load_wait, 30.0)),
                    )
                self._cond.wait(min(left, 0.25))
        self._finish_unloads(taken)

    def _trim(self, sm: ServedModel) -> None:
        """After a load: its measured size may exceed the guess it was admitted with, so
        unload idle LRU models until the budget holds again (never ``sm`` itself)."""
        if self.memory_budget is None:
            return
        with self._cond:
            sm.waiting += 1  # not a victim of its own trim
            try:
                victims = self._victims_for(sm, loading=False) or []
                taken = [(v, self._take_locked(v)) for v in victims]
            finally:
                sm.waiting -= 1
        self._finish_unloads(taken)

    def _victims_for(self, sm: ServedModel, loading: bool = True) -> list[ServedModel] | None:
        """The models to unload so ``sm`` fits (least recently used first), or None."""
        loaded = [m for m in self.models if m is not sm and m.engine is not None]
        free = sorted(
            (m for m in loaded if not m.pinned and m.active == 0 and m.waiting == 0),
            key=lambda m: m.last_used or 0.0,
        )
        victims: list[ServedModel] = []

        extra = 1 if loading else 0  # sm is not counted in ``loaded``

        def too_many() -> bool:
            if self.max_loaded is not None and len(loaded) - len(victims) + extra > self.max_loaded:
                return True
            if self.memory_budget is None or len(loaded) == len(victims):
                return False  # a model larger than the budget still loads alone
            used = sum(m.memory_bytes for m in loaded if m not in victims)
            return used + sm.memory_bytes > self.memory_budget

        while too_many():
            if not free:
                return None
            victims.append(free.pop(0))
        return victims

    # --------------------------------------------------------- unloading

    def _take_locked(self, sm: ServedModel) -> Any:
        """Detach ``sm``'s engine so no new lease can reach it (caller holds the lock)."""
        engine, sm.engine = sm.engine, None
        sm.state = "unloading"
        return engine

    def _finish_unloads(self, taken: list[tuple[ServedModel, Any]]) -> None:
        """Close detached engines, drop the last references, clear MLX's buffer cache,
        and only then mark the models unloaded: a model seen ``unloaded`` has given its
        memory back (a request's garbage may hold the engine in a cycle until the
        collection)."""
        if not taken:
            return
        closed: list[ServedModel] = []
        while taken:
            sm, engine = taken.pop()
            self._close_engine(sm, engine)
            del engine
            closed.append(sm)
        gc.collect()
        _clear_mlx_cache()
        with self._cond:
            for sm in closed:
                sm.state = "unloaded"
                sm.unloads += 1
                sm.keep_alive = None  # a request's keep_alive lasts until the model goes
            self._cond.notify_all()
        for sm in closed:
            life_log.info("model %s unloaded", sm.name)

    def _close_engine(self, sm: ServedModel, engine: Any) -> None:
        """Close a detached engine and drop the slot's reference to the loaded model."""
        try:
            _wait_idle(engine)
            engine.close()
        except Exception:  # closing is best effort; the slot is free either way
            log.exception("closing the engine of %s", sm.name)
        with self._cond:
            sm.loaded = None

    def unload(self, sm: ServedModel) -> bool:
        """Unload ``sm`` now if it has no lease or waiter (False if it could not go)."""
        with self._load_serial:
            with self._cond:
                if sm.engine is None or sm.active or sm.waiting:
                    return False
                taken = [(sm, self._take_locked(sm))]
            self._finish_unloads(taken)
        return True

    def keep_alive(self, sm: ServedModel, seconds: float | None) -> None:
        """How long ``sm`` stays loaded once idle, from now on: 0 unloads it when its
        last lease ends, ``math.inf`` never, None the server's ``idle_unload``."""
        with self._cond:
            sm.keep_alive = seconds
        if seconds is not None and seconds != math.inf:
            self._start_reaper()

    def idle_limit(self, sm: ServedModel) -> float | None:
        """Seconds ``sm`` may stay idle before it is unloaded (None: never)."""
        limit = sm.keep_alive if sm.keep_alive is not None else self.idle_unload
        return None if limit is None or limit == math.inf else limit

    def _reap_loop(self) -> None:
        # A keep_alive of 0 asks for an unload right after the request: look often.
        interval = max(0.05, min(1.0, (self.idle_unload or 1.0) / 4))
        try:
            while not self._closed.wait(interval):
                self.reap_idle()
        finally:
            _end_mlx_thread()

    def reap_idle(self) -> list[str]:
        """Unload every model idle for its :meth:`idle_limit` (skipped while a load runs)."""
        if not self._load_serial.acquire(blocking=False):
            return []
        try:
            now = time.time()
            with self._cond:
                idle = [
                    (m, self._take_locked(m))
                    for m in self.models
                    if m.engine is not None
                    and not m.pinned
                    and m.active == 0
                    and m.waiting == 0
                    and (limit := self.idle_limit(m)) is not None
                    and now - (m.last_used or now) >= limit
                ]
            names = [m.name for m, _ in idle]
            self._finish_unloads(idle)
            return names
        finally:
            self._load_serial.release()

    def close(self) -> None:
        """Close every engine (shutdown)."""
        self._closed.set()
        for sm in self.models:
            engine = sm.engine
            if engine is not None:
                try:
                    engine.close()
                except Exception:  # closing is best effort at shutdown
                    log.exception("closing the engine of %s", sm.name)


def _wait_idle(engine: Any, timeout: float = 10.0) -> None:
    """Wait for a detached engine's last cancelled rows to leave (no lease is left on it)."""
    stats = getattr(engine, "stats", None)
    if not callable(stats):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = stats()
        if not (st.running or st.queue_depth or st.waiting):
            return
        time.sleep(0.01)


def _end_mlx_thread() -> None:
    """MLX needs a thread's streams torn down before the thread ends (else abort at exit)."""
    import sys

    mx = sys.modules.get("mlx.core")
    if mx is not None:
        with contextlib.suppress(Exception):
            mx.clear_streams()


def _clear_mlx_cache() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # pragma: no cover - no MLX, nothing cached
        pass


def _context_length(engine: Any, loaded: Any) -> int | None:
    """The context a request is checked against: the engine's (``cairn serve`` refuses
    a KV pool that cannot hold it), else the model's own."""
    for owner in (engine, loaded):
        n = getattr(owner, "context_length", None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def _default_loader(source: str | None) -> Any:
    from mlx_cairn.models import load

    return load(source)


def _default_engine_factory(loaded: Any) -> Any:  # replaced by serve() with its flags
    if getattr(loaded, "kind", None) == "embedding":  # models/embedding.py
        from mlx_cairn.engine.embedder import EmbeddingEngine

        return EmbeddingEngine(loaded)
    from mlx_cairn.engine import Engine

    return Engine(loaded)
