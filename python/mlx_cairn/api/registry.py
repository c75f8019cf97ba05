"""Which model names the server answers to, and which served model answers each one.

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

Loading, leases and unloading (what happens once a name is resolved) live in
:mod:`mlx_cairn.api.loading` and :mod:`mlx_cairn.api.leases`; the registry
resolves the name and hands the served model on.
"""

from __future__ import annotations

import fnmatch
import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlx_cairn.api.dialects import ModelInfo
from mlx_cairn.api.leases import ModelLease, ServedModel
from mlx_cairn.api.loading import (
    DEFAULT_LOAD_WAIT,
    MODEL_FILE_SUFFIXES,
    EngineFactory,
    Loader,
    ModelLifecycle,
    disk_size,
)
from mlx_cairn.errors import ModelNotFound
from mlx_cairn.models.hub import is_hub_name, resolve, split_name

__all__ = [
    "DEFAULT_LOAD_WAIT",
    "DEFAULT_MODEL_NAME",
    "ModelLease",
    "ModelRegistry",
    "ServedModel",
    "names_for_source",
    "scan_models_dir",
]

#: Name of the embedded default model (docs/design.md §5).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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
    if p.suffix.lower() in MODEL_FILE_SUFFIXES and not p.is_dir():
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


class ModelRegistry:
    """Model names -> served models; loading and unloading go to its :class:`ModelLifecycle`."""

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
        self.lifecycle = ModelLifecycle(
            self.models,
            loader=loader,
            engine_factory=engine_factory,
            max_loaded=max_loaded,
            memory_budget_gb=memory_budget_gb,
            idle_unload=idle_unload,
            load_wait=load_wait,
            allow_download=allow_download,
            on_loaded=self._name_loaded,
        )
        #: Set by ``cairn serve`` once start-up (preloading) is over.
        self.serving = threading.Event()

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

    def _name_loaded(self, sm: ServedModel, loaded: Any) -> None:
        """Serve ``sm`` under the name its loader reports too (lifecycle lock held)."""
        extra = getattr(loaded, "name", None)
        if isinstance(extra, str) and extra and extra not in self._by_name:
            sm.names.append(extra)
            self._by_name[extra] = sm

    # ------------------------------------------- leases, loads, unloads

    async def get(self, name: str) -> ModelLease:
        """Resolve ``name``, load the model if needed (awaiting a load already under way),
        and return a lease on it. Raises ModelLoadError / ModelUnavailable for every waiter.

        A request that has to wait, or that arrives while earlier waiters have
        not submitted yet, gets a turn (see :meth:`ModelLease.turn`).
        """
        return await self.lifecycle.get(self.resolve(name))

    def loading(self, name: str) -> bool:
        """Whether ``name``'s model is being loaded right now (room found, weights being
        read or downloaded): a wait for it ends in the model or a load failure, not in
        "no room". False while a load waits for room, and for a loaded model."""
        return self.resolve(name).state == "loading"

    def lease(self, name: str, timeout: float | None = None) -> ModelLease:
        """:meth:`get` for synchronous callers (tools, tests)."""
        return self.lifecycle.lease(self.resolve(name), timeout)

    def preload(self, names: Iterable[str] | None = None) -> None:
        """Load ``names`` (all models when None) now; failures are logged and remembered."""
        targets = self.models if names is None else [self.resolve(n) for n in names]
        self.lifecycle.preload(targets)

    def load_all(self) -> None:
        """Load every model now (start-up); failures are logged and remembered."""
        self.preload(None)

    def unload(self, name: str) -> bool:
        """Unload a model now if it has no lease or waiter (False if it could not go)."""
        return self.lifecycle.unload(self.resolve(name))

    def keep_alive(self, name: str, seconds: float | None) -> None:
        """How long ``name``'s model stays loaded once idle, from now on: 0 unloads it
        when its last lease ends, ``math.inf`` never, None the server's ``idle_unload``.

        Example: ``registry.keep_alive("qwen3", 0)`` after a request frees its memory.
        """
        self.lifecycle.keep_alive(self.resolve(name), seconds)

    def idle_limit(self, sm: ServedModel) -> float | None:
        """Seconds ``sm`` may stay idle before it is unloaded (None: never)."""
        return self.lifecycle.idle_limit(sm)

    def reap_idle(self) -> list[str]:
        """Unload every model idle for its :meth:`idle_limit` (skipped while a load runs)."""
        return self.lifecycle.reap_idle()

    def __enter__(self) -> ModelRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every engine (shutdown)."""
        self.lifecycle.close()


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
