"""Downloading a hub model that is not in the cache, through huggingface_hub's real
``snapshot_download``, from a fake Hub on loopback.

:class:`FakeHub` answers the four requests ``snapshot_download`` makes
(huggingface_hub 2.x): the revision's commit (``/api/models/R/revision/REV``), its
file listing (``/api/models/R/tree/COMMIT``), and per file a ``HEAD`` and a
``GET`` of ``/R/resolve/COMMIT/PATH`` with the headers the library checks
(``X-Repo-Commit``, ``ETag``, ``Content-Length``). No other network is touched:
``HF_ENDPOINT`` points at it and the cache is a temp dir.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
import orjson
import pytest

from live_server import serve, wait_until
from mlx_cairn.api import ModelRegistry, ServerConfig
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models import hub
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_model

pytestmark = pytest.mark.timeout(180)

REPO = "org/tiny-dl"
#: The file whose body the hub holds back until the test lets it go.
HELD = "model.safetensors"


class FakeHub:
    """A tiny Hub on 127.0.0.1: one model repo at one commit; logs every request."""

    def __init__(self, repo: str, files: dict[str, bytes]) -> None:
        self.repo = repo
        self.files = files
        self.commit = hashlib.sha1(b"".join(files.values())).hexdigest()
        self.requests: list[tuple[str, str]] = []
        self.release = threading.Event()  # lets the held file's body go
        self.held = threading.Event()  # the held file was asked for
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub_.answer(self, head=True)

            def do_GET(self) -> None:
                hub_.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def etag(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def answer(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append(("HEAD" if head else "GET", path))
        api = f"/api/models/{self.repo}/"
        resolve = f"/{self.repo}/resolve/{self.commit}/"
        if path.startswith(api + "revision/"):
            siblings = [{"rfilename": p} for p in self.files]
            return self.json(h, {"id": self.repo, "sha": self.commit, "siblings": siblings})
        if path.startswith(api + "tree/"):
            listing = [
                {"type": "file", "path": p, "size": len(b), "oid": self.etag(p)}
                for p, b in self.files.items()
            ]
            return self.json(h, listing)
        if path.startswith(resolve) and path[len(resolve) :] in self.files:
            name = path[len(resolve) :]
            body = self.files[name]
            if name == HELD and not head:
                self.held.set()
                self.release.wait(60)
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.send_header("ETag", f'"{self.etag(name)}"')
            h.send_header("X-Repo-Commit", self.commit)
            h.send_header("Content-Type", "application/octet-stream")
            h.end_headers()
            if not head:
                h.wfile.write(body)
            return None
        h.send_response(404)
        h.send_header("X-Error-Code", "RepoNotFound")
        h.send_header("X-Error-Message", "Repository not found")
        h.send_header("Content-Length", "2")
        h.end_headers()
        if not head:
            h.wfile.write(b"{}")
        return None

    @staticmethod
    def json(h: BaseHTTPRequestHandler, obj: Any) -> None:
        body = orjson.dumps(obj)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = save_folder(tiny_model("qwen3", seed=7), tmp_path_factory.mktemp("dl") / "tiny")
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    files["README.md"] = b"# not fetched: no pattern asks for it\n"
    return files


@pytest.fixture
def fake_hub(
    model_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeHub]:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    # The library reads HF_HUB_OFFLINE once, at import (maybe under another test's env).
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # The held file must not time out and be asked for again while the test looks.
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 120)
    with FakeHub(REPO, model_files) as fh:
        monkeypatch.setenv("HF_ENDPOINT", fh.url)
        yield fh


def test_a_missing_hub_model_is_downloaded_with_progress_in_health_and_loads(
    fake_hub: FakeHub, model_files: dict[str, bytes], tmp_path: Path
) -> None:
    cache = tmp_path / "hf" / "hub"
    assert not (cache / "models--org--tiny-dl").exists()
    fetched = {n: b for n, b in model_files.items() if n != "README.md"}
    reg = ModelRegistry([REPO])
    key = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    body = {"model": "tiny-dl", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    try:
        with serve(reg, ServerConfig(api_token="k")) as srv:
            results: list[httpx.Response] = []
            t = threading.Thread(
                target=lambda: results.append(
                    httpx.post(srv.url + "/v1/messages", json=body, headers=key, timeout=120)
                ),
                daemon=True,
            )
            t.start()

            def download() -> dict[str, Any] | None:
                r = httpx.get(srv.url + "/health", headers=key, timeout=10)
                (m,) = r.json()["models"]
                return m.get("download")  # type: ignore[no-any-return]

            # Held in the middle: every small file is written, the weights are not.
            assert fake_hub.held.wait(60), fake_hub.requests
            small = sum(len(b) for n, b in fetched.items() if n != HELD)
            wait_until(
                lambda: (download() or {}).get("bytes_done") == small,
                "the small files never showed in /health",
                timeout=60,
            )
            mid = download()
            assert mid is not None
            assert mid["bytes_total"] == sum(len(b) for b in fetched.values())
            assert 0 < mid["fraction"] < 1 and not mid["finished"]
            assert mid["files_total"] == len(fetched) and mid["files_done"] == len(fetched) - 1
            assert reg.models[0].state == "loading"
            fake_hub.release.set()
            t.join(120)
            (r,) = results
            assert r.status_code == 200, r.text
            assert r.json()["content"][0]["type"] == "text"
            assert reg.models[0].download is not None
            done = reg.models[0].download.snapshot()
            assert done["finished"] and done["fraction"] == 1.0
            assert done["bytes_done"] == done["bytes_total"] == mid["bytes_total"]
            (m,) = httpx.get(srv.url + "/health", headers=key, timeout=10).json()["models"]
            assert m["state"] == "loaded" and "download" not in m
    finally:
        reg.close()
    # The real cache layout, exactly the files the patterns ask for, byte for byte.
    snap = cache / "models--org--tiny-dl" / "snapshots" / fake_hub.commit
    assert (cache / "models--org--tiny-dl" / "refs" / "main").read_text() == fake_hub.commit
    assert {p.name: p.read_bytes() for p in snap.iterdir()} == fetched
    gets = {p.rsplit("/", 1)[1] for m, p in fake_hub.requests if m == "GET" and "/resolve/" in p}
    assert gets == set(fetched)  # README.md was listed but not fetched


def test_a_downloaded_model_is_served_offline_afterwards(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.release.set()
    got = hub.resolve(REPO)
    assert (got / "config.json").is_file() and hub.cache_dir() in got.parents
    asked = len(fake_hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with ModelRegistry([REPO]) as reg:
        reg.lease("tiny-dl").release()
        assert reg.models[0].state == "loaded"
    assert len(fake_hub.requests) == asked  # the cache answered, the hub was not asked


def test_a_repo_the_hub_does_not_have_says_why(fake_hub: FakeHub) -> None:
    with ModelRegistry(["org/absent"]) as reg, pytest.raises(ModelLoadError) as e:
        reg.lease("absent")
    assert "could not be downloaded" in e.value.message
    assert "RepositoryNotFoundError" in e.value.message
    assert any(p.startswith("/api/models/org/absent") for _, p in fake_hub.requests)


def test_the_terminal_bar_shows_and_the_figure_counts_the_same(
    fake_hub: FakeHub,
    model_files: dict[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """With a terminal (forced here: no TTY under pytest) the Hub's bars draw, and the
    /health figure is the same as without one: counted once, not per bar."""
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub: bars on without a TTY
    fake_hub.release.set()
    progress = hub.Progress()
    hub.resolve(REPO, progress=progress)
    err = capfd.readouterr().err
    assert "Fetching 5 files" in err and "Download complete" in err
    fetched = sum(len(b) for n, b in model_files.items() if n != "README.md")
    snap = progress.snapshot()
    assert snap["bytes_done"] == snap["bytes_total"] == fetched
    assert snap["files_done"] == snap["files_total"] == 5 and snap["finished"]
