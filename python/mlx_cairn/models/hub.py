"""Hub-style model names (``ORG/NAME``, ``ORG/NAME@REVISION``) resolved through ``huggingface_hub``.

The local Hugging Face cache is looked at first, so a model downloaded once
(by ``cairn``, ``mlx_lm``, ``huggingface-cli`` ...) is served with no network.
The cache is ``HF_HUB_CACHE`` (default ``$HF_HOME/hub``); ``HF_HUB_OFFLINE=1``
forbids downloads; ``HF_ENDPOINT`` names the Hub (or a mirror). These are read
when a model is resolved, not when the module is imported. A missing model is
downloaded when allowed, with ``huggingface_hub``'s progress bar on the
terminal and a :class:`Progress` that ``/health`` reads (counted whether or
not a terminal shows the bar).

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


def endpoint() -> str | None:
    """``HF_ENDPOINT`` read now (None: the library's default Hub)."""
    value = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    return value or None


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
    """Download progress of one model, read by ``/health``.

    ``done`` / ``total``: bytes written, of the files being fetched (their
    sizes are added as each file starts, up to 8 at a time) or of ``expected``,
    the size of the whole download from the Hub's listing, whichever is larger;
    ``files_done`` / ``files_total``: files fetched of those the model needs
    (known once the file listing came). ``finished``: the snapshot is complete.
    """

    done: int = 0
    total: int = 0
    #: Bytes of the whole download from the Hub's file listing (0: not known).
    expected: int = 0
    files_done: int = 0
    files_total: int = 0
    finished: bool = False
    started: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _totals: dict[int, int] = field(default_factory=dict, repr=False)

    def snapshot(self) -> dict[str, Any]:
        """``{"bytes_done", "bytes_total", "fraction", "files_done", "files_total",
        "finished"}`` (fraction None while the size is unknown)."""
        with self._lock:
            done, total = self.done, max(self.total, self.expected)
            out: dict[str, Any] = {
                "bytes_done": done,
                "bytes_total": total,
                "fraction": round(min(done / total, 1.0), 4) if total else None,
                "files_done": self.files_done,
                "files_total": self.files_total,
                "finished": self.finished,
            }
        if out["finished"]:
            out["fraction"] = 1.0
        return out


def _tqdm_reporting_to(progress: Progress) -> type:
    """A tqdm class (the Hub's own bar, so a terminal still shows it) that mirrors its
    bars into ``progress``.

    ``snapshot_download`` (huggingface_hub 1.x / 2.x) makes three bars from it:
    files fetched (unit ``it``), bytes written (unit ``B``, the one counted) and
    bytes received (``...transfer``: its total is a guess, so it is skipped).
    Counts are kept here, not read from the bar: a bar with no terminal to draw
    on is disabled, and a disabled tqdm does not count.
    """
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Reporting(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            name = str(kwargs.get("name") or "")
            unit = kwargs.get("unit", "it")
            self._cairn_role = (
                "bytes"
                if unit == "B" and not name.endswith("transfer")
                else "files"
                if unit == "it"
                else None
            )
            self._cairn_n = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)
            self._cairn_mirror(0)

        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            self._cairn_mirror(int(n or 0))
            return out

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            super().refresh(*args, **kwargs)
            self._cairn_mirror(0)  # snapshot_download sets ``total`` then refreshes

        def _cairn_mirror(self, n: int) -> None:
            role = getattr(self, "_cairn_role", None)
            if role is None:
                return
            total = int(getattr(self, "total", 0) or 0)
            with progress._lock:
                self._cairn_n += n
                if role == "bytes":
                    progress.done += n
                    progress._totals[id(self)] = total
                    progress.total = sum(progress._totals.values())
                else:
                    progress.files_done = max(progress.files_done, self._cairn_n)
                    progress.files_total = max(progress.files_total, total)

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
    partly = ""
    try:
        # The same patterns as a download: a snapshot fetched with them (by us) is complete
        # for serving even though the repo holds more (README, other formats).
        local = snapshot_download(
            repo,
            revision=revision,
            cache_dir=where,
            local_files_only=True,
            allow_patterns=DOWNLOAD_PATTERNS,
        )
        return model_path(Path(local), name)
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x
            missing = str(e).split(":", 1)[-1].split(". ")[0].strip()
            partly = f" (only partly: {missing})"
    may_download = (not offline()) if allow_download is None else allow_download
    if not may_download:
        raise ModelNotFound(
            f"model {name!r} is not in the Hugging Face cache ({where}){partly} and downloads "
            "are off (HF_HUB_OFFLINE=1); download it once with network access, or give a local path"
        )
    progress = progress or Progress()
    expected = _expected_bytes(repo, revision)
    if expected:
        with progress._lock:
            progress.expected = expected
    try:
        local = snapshot_download(
            repo,
            revision=revision,
            cache_dir=where,
            allow_patterns=DOWNLOAD_PATTERNS,
            tqdm_class=_tqdm_reporting_to(progress),
            endpoint=endpoint(),
        )
    except Exception as e:  # network, 401/404 from the Hub, disk: one clear line
        raise ModelNotFound(
            f"model {name!r} is not in the Hugging Face cache ({where}) and could not be "
            f"downloaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    with progress._lock:
        progress.finished = True
    return model_path(Path(local), name)


def _expected_bytes(repo: str, revision: str | None) -> int | None:
    """Bytes of the files a download of ``repo`` fetches, from the Hub's file listing
    (so ``/health`` has the whole size from the start; None if the listing fails,
    then :func:`snapshot_download` reports the reason)."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile
        from huggingface_hub.utils import filter_repo_objects

        files = [
            f
            for f in HfApi(endpoint=endpoint()).list_repo_tree(
                repo, revision=revision, recursive=True
            )
            if isinstance(f, RepoFile)
        ]
        keep = set(filter_repo_objects([f.path for f in files], allow_patterns=DOWNLOAD_PATTERNS))
        return sum(int(f.size or 0) for f in files if f.path in keep)
    except Exception:  # the download itself says what is wrong
        return None


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
