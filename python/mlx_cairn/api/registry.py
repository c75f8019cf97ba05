"""Which model names the server answers to, loading, and one engine per model.

Names: each served model is known by its folder or file name (``Qwen3-0.6B``,
``model.gguf`` and ``model``), by the name its loader reports, and by
``--alias NAME=MODEL`` (NAME may be a glob such as ``claude-haiku-*``).
``default`` names the first served model. A ``claude-*`` name that matches
nothing resolves to the default model only when ``--default-model`` says so;
anything else unknown is a :class:`~mlx_cairn.errors.ModelNotFound` (404).

Resolution order: served names, exact aliases, glob aliases (in the order
given), ``default``, then the ``claude-*`` fallback.

Loading happens once per model (at start-up via :meth:`ModelRegistry.load_all`,
or lazily on first use); a failure is remembered and reported as
:class:`~mlx_cairn.errors.ModelLoadError` (500) while other models keep serving.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_cairn.api.dialects import ModelInfo
from mlx_cairn.errors import ModelLoadError, ModelNotFound

log = logging.getLogger("mlx_cairn.api")

#: Name of the embedded default model (DESIGN.md §5).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: File suffixes dropped to form a second name (``model.gguf`` is also ``model``).
_MODEL_FILE_SUFFIXES = (".gguf", ".safetensors")

Loader = Callable[[str | None], Any]
EngineFactory = Callable[[Any], Any]


def names_for_source(source: str | None) -> list[str]:
    """The names a model is served under, from its path or hub-style name."""
    if source is None:
        return [DEFAULT_MODEL_NAME]
    p = Path(source.rstrip("/"))
    names = [p.name]
    if p.suffix.lower() in _MODEL_FILE_SUFFIXES and not p.is_dir():
        names.append(p.stem)
    return names


@dataclass(eq=False)
class ServedModel:
    """One model slot: its names, and once loaded its LoadedModel and Engine."""

    names: list[str]
    source: str | None
    loaded: Any = None
    engine: Any = None
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        """The primary name."""
        return self.names[0]


class ModelRegistry:
    """Model names -> served models, with lazy, once-only loading."""

    def __init__(
        self,
        sources: Iterable[str | None] = (None,),
        *,
        aliases: dict[str, str] | None = None,
        default_model: str | None = None,
        loader: Loader | None = None,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self.models: list[ServedModel] = []
        self._by_name: dict[str, ServedModel] = {}
        for src in sources:
            sm = ServedModel(names_for_source(src), src)
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
        """One entry per served name and exact alias."""
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

    # ----------------------------------------------------------- loading

    async def get(self, name: str) -> ServedModel:
        """Resolve and make sure the model is loaded (in a worker thread)."""
        sm = self.resolve(name)
        if sm.engine is None:
            await asyncio.to_thread(self._load, sm)
        return sm

    def load_all(self) -> None:
        """Load every model now (start-up); failures are logged and remembered."""
        for sm in self.models:
            try:
                self._load(sm)
            except ModelLoadError as e:
                log.error("%s", e.message)

    def _load(self, sm: ServedModel) -> None:
        with sm._lock:
            if sm.engine is not None:
                return
            if sm.error is not None:
                raise ModelLoadError(sm.error)
            try:
                loader = self._loader or _default_loader
                factory = self._engine_factory or _default_engine_factory
                loaded = loader(sm.source)
                engine = factory(loaded)
            except Exception as e:  # any loader failure is a 500 for this model only
                sm.error = f"model {sm.name!r} failed to load: {type(e).__name__}: {e}"
                raise ModelLoadError(sm.error) from e
            sm.loaded, sm.engine = loaded, engine
            extra = getattr(loaded, "name", None)
            if isinstance(extra, str) and extra and extra not in self._by_name:
                sm.names.append(extra)
                self._by_name[extra] = sm

    def close(self) -> None:
        """Close every engine."""
        for sm in self.models:
            if sm.engine is not None:
                try:
                    sm.engine.close()
                except Exception:  # closing is best effort at shutdown
                    log.exception("closing the engine of %s", sm.name)


def _info(name: str, sm: ServedModel) -> ModelInfo:
    return ModelInfo(name, sm.name, sm.created, sm.engine is not None)


def _default_loader(source: str | None) -> Any:
    from mlx_cairn.models import load

    return load(source)


def _default_engine_factory(loaded: Any) -> Any:  # replaced by serve() with its flags
    from mlx_cairn.engine import Engine

    return Engine(loaded)
