"""Hub-style model names (``ORG/NAME``, ``ORG/NAME@REVISION``) resolved through ``huggingface_hub``.

The local Hugging Face cache is looked at first, so a model downloaded once
(by ``cairn``, ``mlx_lm``, ``huggingface-cli`` ...) is served with no network.
The cache is ``HF_HUB_CACHE`` (default ``$HF_HOME/hub``); ``HF_HUB_OFFLINE=1``
forbids downloads. A missing model is downloaded when allowed, with a
progress bar on the terminal and a :class:`Progress` that ``/health`` reads.

Example::

    >>> is_hub_name("mlx-community/Qwen3-4B-4bit@main")
    True
    >>> path = resolve("mlx-community/Qwen3-4B-4bit")   # snapshot folder in the cache

The cache layout the lookup reads (what ``snapshot_download`` writes)::

    $HF_HUB_CACHE/models--ORG--NAME/refs/main             -> "<commit>"
    $HF_HUB_CACHE/models--ORG--NAME/snapshots/<commit>/config.json ...
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_cairn.errors import ModelNotFound

#: ``ORG/NAME`` or ``ORG/NAME@REVISION`` (Hub repo-id characters; no leading dot).
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}(@[\w./-]{1,200})?$")

#: Files fetched for a model repo: weights, configs, tokenizer, templates.
DOWNLOAD_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "tokenizer*",
]


def is_hub_name(text: str) -> bool:
    """Whether ``text`` names a Hub repo rather than a path on disk (an existing path wins)."""
    if not _HUB_NAME.match(text) or text.endswith((".gguf", ".safetensors")):
        return False
    return not Path(text).expanduser().exists()


def split_name(text: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; no ``@``: revision None (``main``)."""
    repo, _, revision = text.partition("@")
    return repo, revision or None


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as ``huggingface_hub`` reads it (read now, not at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> Path:
    """The Hub cache in use: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the library default."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


@dataclass
class Progress:
    """Download progress of one model, read by ``/health`` (bytes; total 0 = unknown)."""

    done: int = 0
    total: int = 0
    started: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, Any]:
        """``{"bytes_done", "bytes_total", "fraction"}`` (fraction None while the size is unknown)."""
        with self._lock:
            done, total = self.done, self.total
        return {
            "bytes_done": done,
            "bytes_total": total,
            "fraction": round(done / total, 4) if total else None,
        }


def _tqdm_reporting_to(progress: Progress) -> type:
    """A tqdm class (the Hub's own bar, so the terminal still shows it) that mirrors
    the byte counts of its bars into ``progress``."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Reporting(hf_tqdm):  # type: ignore[misc, valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            if getattr(self, "unit", None) == "B":
                with progress._lock:
                    progress.done = max(progress.done, int(self.n))
                    progress.total = max(progress.total, int(self.total or 0))
            return out

    return Reporting


def model_path(snapshot: Path, name: str) -> Path:
    """The loadable model inside a snapshot: the folder (config.json) or its one GGUF file."""
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        files = ", ".join(p.name for p in ggufs)
        raise ModelNotFound(
            f"model {name!r} holds several GGUF files ({files}); serve one with --model PATH"
        )
    raise ModelNotFound(f"model {name!r} in the Hugging Face cache has no config.json or GGUF file")


def resolve(
    name: str,
    *,
    allow_download: bool | None = None,
    progress: Progress | None = None,
    cache: str | Path | None = None,
) -> Path:
    """The local path of hub model ``name`` (``ORG/NAME[@REVISION]``), downloading if allowed.

    Args:
        allow_download: None: unless ``HF_HUB_OFFLINE`` is set.
        progress: filled with byte counts while downloading.
        cache: the Hub cache folder (default: :func:`cache_dir`).

    Raises:
        ModelNotFound: not cached and no download allowed, or the Hub refused it;
            the message says which and where the cache is.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, revision = split_name(name)
    where = Path(cache) if cache is not None else cache_dir()
    try:
        local = snapshot_download(repo, revision=revision, cache_dir=where, local_files_only=True)
        return model_path(Path(local), name)
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    may_download = (not offline()) if allow_download is None else allow_download
    if not may_download:
        raise ModelNotFound(
            f"model {name!r} is not in the Hugging Face cache ({where}) and downloads are off "
            "(HF_HUB_OFFLINE=1); download it once with network access, or give a local path"
        )
    try:
        local = snapshot_download(
            repo,
            revision=revision,
            cache_dir=where,
            allow_patterns=DOWNLOAD_PATTERNS,
            tqdm_class=_tqdm_reporting_to(progress or Progress()),
        )
    except Exception as e:  # network, 401/404 from the Hub, disk: one clear line
        raise ModelNotFound(
            f"model {name!r} is not in the Hugging Face cache ({where}) and could not be "
            f"downloaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    return model_path(Path(local), name)


def write_cache_entry(
    cache: str | Path, repo: str, files_from: str | Path, *, revision: str = "main"
) -> Path:
    """Lay out ``files_from``'s files as a cached snapshot of ``repo`` (tests, offline installs).

    Writes ``models--ORG--NAME/refs/<revision>`` and ``snapshots/<commit>/...``
    the way ``snapshot_download`` does (copies, not blob links). Returns the snapshot.
    """
    import hashlib
    import shutil

    src = Path(files_from)
    commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    root = Path(cache) / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    items = [src] if src.is_file() else sorted(src.iterdir())
    for f in items:
        if f.is_file():
            shutil.copy2(f, snap / f.name)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return snap
