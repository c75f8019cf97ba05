"""Which model names the server answers to, and loading / unloading one engine per model.

Names: each served model is known by its folder or file name (``Qwen3-0.6B``,
``model.gguf`` and ``model``), a hub model by its ``ORG/NAME[@REVISION]`` and
its ``NAME``, by the name its loader reports, and by ``--alias NAME=MODEL``
(NAME may be a glob such as ``claude-haiku-*``). ``default`` names the first
served model. A ``claude-*`` name that matches nothing resolves to the default
model only when ``--default-model`` says so; anything else unknown is a
:class:`~mlx_cairn.errors.ModelNotFound` (404). Names, aliases and the default
all work before a model is loaded.

Resolution order: served names, exact aliases, glob aliases (in the order
given), ``default``, then the ``claude-*`` fallback.

Life of a model (one writer: this registry, under its lock)::

    unloaded --get()/preload--> loading --ok--> loaded --LRU / idle--> unloading --> unloaded
                                   \\--fails--> failed (error kept; the next request retries)

- One load at a time, in its own thread; every request that names a model
  while it loads awaits that one load (a failure answers all of them). A
  waiter that gives up (cancelled, client gone) leaves the load running for
  the others.
- Requests that waited for a load are answered in the order they arrived:
  each takes a turn (:meth:`ModelLease.turn`) and submits only after every
  earlier one submitted or gave up; tokenizing still runs in parallel.
- A request holds a :class:`ModelLease` from :meth:`ModelRegistry.get` until
  its stream ends (or, for ``prepare`` / ``count_tokens`` only, until that
  call returns). A model with a lease, or with requests waiting for it, is
  never unloaded, so no request runs on a half-loaded or half-unloaded model.
- Room (``max_loaded`` models, ``memory_budget_gb``): before a load, the
  least recently used models without leases or waiters (never a pinned one)
  are unloaded until the new one fits; if none can go, the load waits up to
  ``load_wait`` seconds, then every waiter gets
  :class:`~mlx_cairn.errors.ModelUnavailable` (503 / ``overloaded_error``,
  ``Retry-After``). A model's memory is measured when it loads (weights plus
  KV pool); before its first load its size on disk stands in.
- ``idle_unload``: a model with no lease for that many seconds is unloaded
  (never during a load), and MLX's buffer cache is cleared. A request may set
  its own model's idle time (:meth:`ModelRegistry.keep_alive`, the Ollama
  API's ``keep_alive``): 0 unloads it as soon as its last lease ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fnmatch
import gc
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_cairn.api.dialects import ModelInfo
from mlx_cairn.errors import CairnError, ModelLoadError, ModelNotFound, ModelUnavailable
from mlx_cairn.models.hub import Progress, is_hub_name, resolve, split_name
from mlx_cairn.types import Done, Error

log = logging.getLogger("mlx_cairn.api")
#: Loads and unloads (info lines; the api logger keeps to errors and refusals).
life_log = logging.getLogger("mlx_cairn.models.lifecycle")

#: Name of the embedded default model (docs/design.md §5).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: File suffixes dropped to form a second name (``model.gguf`` is also ``model``).
_MODEL_FILE_SUFFIXES = (".gguf", ".safetensors")

#: Seconds a load waits for room before its requests get 503.
DEFAULT_LOAD_WAIT = 60.0

Loader = Callable[[str | None], Any]
EngineFactory = Callable[[Any], Any]


def names_for_source(source: str | None) -> list[str]:
    """The names a model is served under, from its path or hub-style name."""
    if source is None:
        return [DEFAULT_MODEL_NAME]
    if is_hub_name(source):
        repo, revision = split_name(source)
        names = [source] + ([repo] if revision else [])
        return [*names, repo.rsplit("/", 1)[1]]
    p = Path(source.rstrip("/"))
    names = [p.name]
    if p.suffix.lower() in _MODEL_FILE_SUFFIXES and not p.is_dir():
        names.append(p.stem)
    return names


def scan_models_dir(root: str | Path) -> list[str]:
    """Every model under ``root``: folders holding a ``config.json`` and ``.gguf`` files.

    A model folder is not searched further (its files belong to it). Sorted
    by path, so the listing and the ``default`` model are stable.
    """
    base = Path(root).expanduser()
    if not base.is_dir():
        raise ValueError(f"--models-dir {root}: not a folder")
    found: list[str] = []

    def walk(d: Path) -> None:
        if (d / "config.json").is_file() and d != base:
            found.append(str(d))
            return
        try:
            entries = sorted(d.iterdir())
        except OSError:
            return
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir():
                walk(e)
            elif e.suffix.lower() == ".gguf" and e.is_file():
                found.append(str(e))

    walk(base)
    return found


def disk_size(source: str | None) -> int:
    """Bytes of a model's weight files on disk (0 when unknown): the size guess before a load."""
    if source is None or is_hub_name(source):
        return 0
    p = Path(source).expanduser()
    try:
        if p.is_file():
            return p.stat().st_size
        return sum(f.stat().st_size for f in p.glob("*") if f.suffix in _MODEL_FILE_SUFFIXES)
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


@dataclass(eq=False)
class ServedModel:
    """One model slot: its names, its state, and while loaded its LoadedModel and Engine."""

    names: list[str]
    source: str | None
    loaded: Any = None
    engine: Any = None
    #: The last load's failure (kept until a load succeeds).
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    #: unloaded | loading | loaded | unloading
    state: str = "unloaded"
    pinned: bool = False
    #: Requests holding a lease (running, or between lookup and submit).
    active: int = 0
    #: Requests waiting for this model's load.
    waiting: int = 0
    last_used: float | None = None
    load_seconds: float | None = None
    loaded_at: float | None = None
    loads: int = 0
    unloads: int = 0
    memory_bytes: int = 0
    #: The engine's context (after ``--context-length``), kept across unloads:
    #: the model listings report it.
    context_length: int | None = None
    #: Seconds this model stays loaded once idle, as the last request that said
    #: so asked (:meth:`ModelRegistry.keep_alive`; ``inf``: never unloaded);
    #: None: the server's ``idle_unload``.
    keep_alive: float | None = None
    download: Progress | None = None
    _loading: concurrent.futures.Future[None] | None = field(default=None, repr=False)
    _turns: _Turns = field(default_factory=lambda: _Turns(), repr=False)

    @property
    def name(self) -> str:
        """The primary name."""
        return self.names[0]

    def describe(self) -> dict[str, Any]:
        """The ``/health`` entry (engine stats are added by the caller)."""
        out: dict[str, Any] = {
            "name": self.name,
            "names": list(self.names),
            "loaded": self.engine is not None,
            "state": self.state,
            "pinned": self.pinned,
            "active_requests": self.active,
            "waiting_requests": self.waiting,
            "memory_bytes": self.memory_bytes,
            "last_used": self.last_used,
            "load_seconds": self.load_seconds,
            "loads": self.loads,
            "unloads": self.unloads,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.download is not None and self.state == "loading":
            out["download"] = self.download.snapshot()
        return out


class ModelLease:
    """What a request holds: the model's names and an engine that cannot be unloaded under it.

    ``engine`` wraps the real one: ``submit`` returns a stream that gives the
    lease back when it ends (last event read, or cancelled); ``prepare`` that
    raises and ``count_tokens`` give it back at once. A lease dropped unused
    gives it back when garbage collected.

    A lease from :meth:`ModelRegistry.get` that waited for its model's load
    (or came while earlier waiters had not submitted yet) carries a turn:
    ``await lease.turn()`` before ``engine.submit`` keeps arrival order among
    them (submitting or releasing gives the turn to the next one). Leases from
    the synchronous :meth:`ModelRegistry.lease` take no turn.
    """

    def __init__(
        self,
        sm: ServedModel,
        engine: Any,
        release: Callable[[], None],
        ticket: int | None = None,
    ) -> None:
        self.served = sm
        self.names = sm.names
        self.source = sm.source
        self.loaded = sm.loaded
        self.created = sm.created
        self.ticket = ticket
        turns = sm._turns
        self._pass_turn = _Once(lambda: turns.done(ticket) if ticket is not None else None)
        pass_turn = self._pass_turn

        def release_all() -> None:
            pass_turn()
            release()

        self._release = _Once(release_all)
        self.engine = _LeasedEngine(engine, self._release, self._pass_turn)
        weakref.finalize(self, self._release)

    @property
    def name(self) -> str:
        return self.served.name

    async def turn(self) -> None:
        """Wait until every request that waited for this load before this one has
        submitted or given up (at once for a lease that did not wait)."""
        if self.ticket is not None:
            await self.served._turns.wait(self.ticket)

    def release(self) -> None:
        """Give the lease back now (idempotent)."""
        self._release()


class _Turns:
    """Arrival order of the requests waiting for one model's load (one per model).

    Tickets are taken in arrival order; ticket ``t`` may submit once every
    ticket before it is done (submitted, released, or its wait failed)::

        taken:  0 1 2 3 4          front = 2 (0 and 1 done)
        done:   x x . x .          3 is done too, but 2 still holds the turn

    Thread-safe; waiters are asyncio futures woken on their own loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = 0
        self._front = 0  # the lowest ticket not done
        self._done: set[int] = set()
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def take(self) -> int:
        with self._lock:
            self._taken += 1
            return self._taken - 1

    def outstanding(self) -> bool:
        """Tickets taken and not yet done (a newcomer then queues behind them)."""
        with self._lock:
            return self._front < self._taken

    def done(self, ticket: int) -> None:
        with self._lock:
            self._done.add(ticket)
            while self._front in self._done:
                self._done.discard(self._front)
                self._front += 1
            ready = [w for w in self._waiters if w[0] <= self._front]
            self._waiters = [w for w in self._waiters if w[0] > self._front]
        for _, loop, fut in ready:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, fut)

    async def wait(self, ticket: int) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if ticket <= self._front:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((ticket, loop, fut))
        await fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Once:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _LeasedEngine:
    def __init__(self, engine: Any, release: _Once, pass_turn: _Once) -> None:
        self._engine = engine
        self._release = release
        self._pass_turn = pass_turn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._engine.prepare(*args, **kwargs)
        except BaseException:
            self._release()
            raise

    def count_tokens(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._engine.count_tokens(*args, **kwargs)
        finally:
            self._release()

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        try:
            stream = self._engine.submit(*args, **kwargs)
        except BaseException:
            self._release()
            raise
        finally:
            self._pass_turn()  # queued in the engine (or refused): the next waiter may submit
        return _LeasedStream(stream, self._release)


class _LeasedStream:
    """The engine's stream; the lease goes back after the final event or a cancel."""

    def __init__(self, stream: Any, release: _Once) -> None:
        self._stream = stream
        self._release = release

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __aiter__(self) -> _LeasedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            ev = await self._stream.__anext__()
        except BaseException:
            self._release()
            raise
        if isinstance(ev, (Done, Error)):
            self._release()  # that was the final event
        return ev

    def cancel(self) -> None:
        self._stream.cancel()
        self._release()

    async def aclose(self) -> None:
        self.cancel()


class ModelRegistry:
    """Model names -> served models, with lazy single-flight loading and LRU unloading."""

    def __init__(
        self,
        sources: Iterable[str | None] = (None,),
        *,
        aliases: dict[str, str] | None = None,
        default_model: str | None = None,
        loader: Loader | None = None,
        engine_factory: EngineFactory | None = None,
        models_dir: str | Path | None = None,
        max_loaded: int | None = None,
        memory_budget_gb: float | None = None,
        pins: Iterable[str] = (),
        idle_unload: float | None = None,
        load_wait: float = DEFAULT_LOAD_WAIT,
        allow_download: bool | None = None,
    ) -> None:
        self.models: list[ServedModel] = []
        self._by_name: dict[str, ServedModel] = {}
        all_sources = list(sources)
        if models_dir is not None:
            all_sources += scan_models_dir(models_dir)
        for src in all_sources:
            sm = ServedModel(names_for_source(src), src)
            sm.memory_bytes = disk_size(src)
            self.models.append(sm)
            for n in sm.names:
                self._by_name.setdefault(n, sm)
        if not self.models:
            raise ValueError("no models to serve")
        self._loader = loader
        self._engine_factory = engine_factory
        self.aliases: dict[str, ServedModel] = {}
        self._glob_aliases: list[tuple[str, ServedModel]] = []
        for alias, target in (aliases or {}).items():
            found = self._by_name.get(target)
            if found is None:
                raise ValueError(f"alias {alias!r} points at {target!r}, which is not served")
            if any(c in alias for c in "*?["):
                self._glob_aliases.append((alias, found))
            else:
                self.aliases[alias] = found
        self.default: ServedModel | None = None
        if default_model == "":
            self.default = self.models[0]
        elif default_model is not None:
            self.default = self._by_name.get(default_model) or self.aliases.get(default_model)
            if self.default is None:
                raise ValueError(f"--default-model {default_model!r} is not a served model")
        for pin in pins:
            pinned = self._by_name.get(pin) or self.aliases.get(pin)
            if pinned is None:
                raise ValueError(f"--pin {pin!r} is not a served model")
            pinned.pinned = True
        self.max_loaded = max_loaded
        self.memory_budget = None if memory_budget_gb is None else memory_budget_gb * 2**30
        self.idle_unload = idle_unload
        self.load_wait = load_wait
        self.allow_download = allow_download
        self._cond = threading.Condition()
        self._load_serial = threading.Lock()  # one load or unload pass at a time
        self._closed = threading.Event()
        #: Set by ``cairn serve`` once start-up (preloading) is over.
        self.serving = threading.Event()
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

    # ------------------------------------------------------------ lookup

    def resolve(self, name: str) -> ServedModel:
        """The served model for a requested name (ModelNotFound if none)."""
        sm = self._by_name.get(name) or self.aliases.get(name)
        if sm is not None:
            return sm
        for pattern, target in self._glob_aliases:
            if fnmatch.fnmatchcase(name, pattern):
                return target
        if name == "default":
            return self.models[0]
        if name.startswith("claude-") and self.default is not None:
            return self.default
        raise ModelNotFound(f"model {name!r} not found; served: {', '.join(self.names())}")

    def names(self) -> list[str]:
        """Every concrete served name (not globs)."""
        return [n for sm in self.models for n in sm.names] + list(self.aliases)

    def listing(self) -> list[ModelInfo]:
        """One entry per served name and exact alias, loaded or not."""
        out = [_info(n, sm) for sm in self.models for n in sm.names]
        out += [_info(a, sm) for a, sm in self.aliases.items()]
        return out

    def info(self, name: str) -> ModelInfo:
        """The entry for one requested name, resolved as a generation request would be
        (aliases, globs, ``default``, the ``claude-*`` fallback) but never loading it.

        A listed name gets its listing entry; a name only a glob or a fallback
        answers to gets an entry under that name. ModelNotFound if none.
        """
        return _info(name, self.resolve(name))

    # ----------------------------------------------------------- leases

    async def get(self, name: str) -> ModelLease:
        """Resolve ``name``, load the model if needed (awaiting a load already under way),
        and return a lease on it. Raises ModelLoadError / ModelUnavailable for every waiter.

        A request that has to wait, or that arrives while earlier waiters have
        not submitted yet, gets a turn (see :meth:`ModelLease.turn`).
        """
        sm = self.resolve(name)
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

    def loading(self, name: str) -> bool:
        """Whether ``name``'s model is being loaded right now (room found, weights being
        read or downloaded): a wait for it ends in the model or a load failure, not in
        "no room". False while a load waits for room, and for a loaded model."""
        return self.resolve(name).state == "loading"

    def lease(self, name: str, timeout: float | None = None) -> ModelLease:
        """:meth:`get` for synchronous callers (tools, tests)."""
        sm = self.resolve(name)
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

    def preload(self, names: Iterable[str] | None = None) -> None:
        """Load ``names`` (all models when None) now; failures are logged and remembered."""
        targets = self.models if names is None else [self.resolve(n) for n in names]
        for sm in dict.fromkeys(targets):
            try:
                self._start_load(sm).result()
            except CairnError as e:
                log.error("%s", e.message)

    def load_all(self) -> None:
        """Load every model now (start-up); failures are logged and remembered."""
        self.preload(None)

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
            loader = self._loader or _default_loader
            factory = self._engine_factory or _default_engine_factory
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
            extra = getattr(loaded, "name", None)
            if isinstance(extra, str) and extra and extra not in self._by_name:
                sm.names.append(extra)
                self._by_name[extra] = sm
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
        """Close detached engines, drop the last references, and clear MLX's buffer cache."""
        if not taken:
            return
        while taken:
            sm, engine = taken.pop()
            self._finish_unload(sm, engine)
            del engine
        gc.collect()
        _clear_mlx_cache()

    def _finish_unload(self, sm: ServedModel, engine: Any) -> None:
        """Close a detached engine and give its memory back."""
        try:
            _wait_idle(engine)
            engine.close()
        except Exception:  # closing is best effort; the slot is free either way
            log.exception("closing the engine of %s", sm.name)
        with self._cond:
            sm.loaded = None
            sm.state = "unloaded"
            sm.unloads += 1
            sm.keep_alive = None  # a request's keep_alive lasts until the model goes
            self._cond.notify_all()
        life_log.info("model %s unloaded", sm.name)

    def unload(self, name: str) -> bool:
        """Unload a model now if it has no lease or waiter (False if it could not go)."""
        sm = self.resolve(name)
        with self._load_serial:
            with self._cond:
                if sm.engine is None or sm.active or sm.waiting:
                    return False
                taken = [(sm, self._take_locked(sm))]
            self._finish_unloads(taken)
        return True

    def keep_alive(self, name: str, seconds: float | None) -> None:
        """How long ``name``'s model stays loaded once idle, from now on: 0 unloads it
        when its last lease ends, ``math.inf`` never, None the server's ``idle_unload``.

        Example: ``registry.keep_alive("qwen3", 0)`` after a request frees its memory.
        """
        sm = self.resolve(name)
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

    def __enter__(self) -> ModelRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


def _info(name: str, sm: ServedModel) -> ModelInfo:
    return ModelInfo(
        name, sm.name, sm.created, sm.engine is not None, sm.context_length, _takes_images(sm)
    )


def _takes_images(sm: ServedModel) -> bool:
    """Whether ``sm`` reads pictures: the loaded model says; before a load, a local
    folder (or the local HF cache's copy of a hub name) whose config.json has a
    ``vision_config`` (models/vision.py loads those)."""
    if sm.loaded is not None:
        return bool(getattr(sm.loaded, "takes_images", False))
    if not sm.source:
        return False
    folder = Path(sm.source).expanduser()
    if is_hub_name(sm.source):  # the local HF cache's copy, if there is one (no download)
        try:
            folder = resolve(sm.source, allow_download=False)
        except (ModelNotFound, OSError, ValueError):
            return False
    config = folder / "config.json"
    try:
        if not config.is_file():
            return False
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("vision_config"), dict)


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
