"""KV-cache events for a cache-aware router (engine/kv_events.py), read off the wire.

A ZMQ SUB socket decodes what a real engine (tiny random llama) publishes:
the BlockStored chain of a prompt (parent links, the prompt's token blocks,
the disk tier's chained hashes), a second prompt sharing the prefix stores
only its own blocks, BlockRemoved as a small pool evicts, and replaying the
events gives exactly the set of blocks the engine has cached. Also: a slow
sender drops the oldest batches without holding the engine up; a replay socket
gives back what a late subscriber missed; ``cairn serve --kv-events`` over 2
ranks publishes from rank 0; what ``serve`` refuses.
(2 replicas behind the real vllm-router: tests/test_router_kv_events.py.)
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.disk import stable_seed
from mlx_cairn.engine.kv_events import (
    END_SEQ,
    KVEventPublisher,
    KVEventsError,
    check_endpoint,
)
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.testing.engine_checks import generate_from_ids, wait_idle
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Message, SamplingParams

TIMEOUT = 60.0
BS = 16
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=4)


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Wire:
    """A SUB socket on ``pub``'s endpoint, joined (a probe got through) before use."""

    def __init__(self, pub: KVEventPublisher) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub.endpoint)
        self.batches: list[tuple[int, list]] = []  # since the last clear
        self.all: list[tuple[int, list]] = []  # since the probe
        deadline = time.monotonic() + 10
        while True:  # PUB drops what it sends before the subscription arrives
            pub.cleared()
            pub.flush()
            if self.sub.poll(100):
                break
            assert time.monotonic() < deadline, "the subscriber never joined"
        self.drain(0.2)
        self.batches.clear()
        self.all.clear()

    def drain(self, quiet_s: float = 0.5) -> list[tuple[int, list]]:
        """Read until nothing arrives for ``quiet_s``."""
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            batch = msgpack.unpackb(payload, raw=False)
            assert isinstance(batch, list) and len(batch) == 3, batch
            ts, events, rank = batch
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
            assert events and all(isinstance(e, dict) for e in events)
            self.batches.append((int.from_bytes(seq, "big"), events))
            self.all.append(self.batches[-1])
        return self.batches

    def events(self, everything: bool = False) -> list[dict]:
        return [e for _, evs in (self.all if everything else self.batches) for e in evs]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def generate(engine: Engine, prompt: list[int]) -> list[int]:
    out, _ = generate_from_ids(engine, prompt, max_tokens=MAX_TOKENS, timeout=TIMEOUT)
    return prompt + out


def disk_hashes(lm, tokens: list[int]) -> list[int]:
    """The chain hashes the disk tier keys these tokens' full blocks by."""
    cache = PrefixCache(BlockPool(num_blocks=2, block_size=BS), seed=stable_seed(str(lm.identity)))
    h = cache.hash_blocks(tokens[: len(tokens) // BS * BS], salt=f"{lm.identity}\x00")
    return [int(x) for x in h]


def wire(h: int) -> bytes:
    return h.to_bytes(16, "big")


def ask_replay(endpoint: str, start: int, *, frames: list[bytes] | None = None) -> list:
    """What the replay socket at ``endpoint`` answers a DEALER asking from ``start``:
    ``[(seq, events), ...]`` up to (not including) the end marker."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(frames if frames is not None else [b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(10_000), "no end marker"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    finally:
        dealer.close(linger=0)
        ctx.term()


def replay(events: list[dict]) -> set[bytes]:
    cached: set[bytes] = set()
    for e in events:
        if e["type"] == "BlockStored":
            cached.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            assert set(e["block_hashes"]) <= cached, "removed a block never stored"
            cached.difference_update(e["block_hashes"])
        else:
            assert e == {"type": "AllBlocksCleared"}
            cached.clear()
    return cached


def engine_cached(engine: Engine) -> set[bytes]:
    c = engine._cache
    return {
        wire(h) for b in range(1, engine._pool.num_blocks) if (h := c.block_hash(b)) is not None
    }


def test_stored_chain_shared_prefix_evictions_and_clear(lm):
    rng = np.random.default_rng(0)
    system = [int(x) for x in rng.integers(3, 300, size=3 * BS)]
    a = system + [int(x) for x in rng.integers(3, 300, size=20)]
    b = system + [int(x) for x in rng.integers(3, 300, size=21)]
    other = [int(x) for x in rng.integers(3, 300, size=5 * BS + 3)]
    pub = KVEventPublisher(free_endpoint())
    w = Wire(pub)
    try:
        # 10 usable blocks: the third prompt must evict the first two's blocks.
        engine = Engine(lm, EngineConfig(num_blocks=11, block_size=BS, max_batch=1, kv_events=pub))
        try:
            w.drain()
            assert w.events() == [{"type": "AllBlocksCleared"}]  # a fresh engine says so
            w.batches.clear()

            seq_a = generate(engine, a)
            wait_idle(engine)
            evs = [e for e in w.drain() for e in e[1]]
            stored = [e for e in evs if e["type"] == "BlockStored"]
            assert stored and not [e for e in evs if e["type"] != "BlockStored"]
            # One chain: each event's parent is the last block of the one before.
            full = (len(seq_a) - 1) // BS  # the last sampled token is never computed
            want = disk_hashes(lm, seq_a[: full * BS])
            got = [h for e in stored for h in e["block_hashes"]]
            assert got == [wire(h) for h in want]
            parent = None
            for e in stored:
                assert set(e) == {
                    "type", "block_hashes", "parent_block_hash", "token_ids",
                    "block_size", "lora_id", "medium", "lora_name",
                }  # fmt: skip
                assert e["parent_block_hash"] == parent and e["block_size"] == BS
                assert e["medium"] == "GPU" and e["lora_id"] is None
                n = len(e["block_hashes"])
                i = got.index(e["block_hashes"][0])
                assert e["token_ids"] == seq_a[i * BS : (i + n) * BS]
                parent = e["block_hashes"][-1]

            w.batches.clear()
            seq_b = generate(engine, b)
            wait_idle(engine)
            stored_b = [e for e in w.drain() for e in e[1] if e["type"] == "BlockStored"]
            hb = disk_hashes(lm, seq_b)
            # The shared system blocks were a hit: only b's own blocks are new.
            assert stored_b[0]["parent_block_hash"] == wire(hb[2])
            new_b = [h for e in stored_b for h in e["block_hashes"]]
            assert new_b == [wire(h) for h in hb[3 : (len(seq_b) - 1) // BS]]
            assert not {wire(h) for h in hb[:3]} & set(new_b)

            w.batches.clear()
            generate(engine, other)
            wait_idle(engine)
            w.drain()
            removed = [e for e in w.events() if e["type"] == "BlockRemoved"]
            assert removed, "a full pool evicted nothing?"
            assert all(e["medium"] == "GPU" for e in removed)
            # Replaying everything gives exactly what the engine holds.
            assert replay(w.events(everything=True)) == engine_cached(engine)
            seqs = [s for s, _ in w.all]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none lost
        finally:
            engine.close()
        w.drain()
        assert w.events()[-1] == {"type": "AllBlocksCleared"}
        assert 0 < engine.stats().kv_events_batches <= pub.sent  # the sender is async
    finally:
        pub.close()
        w.close()


def test_engine_owns_a_socket_named_by_address(lm):
    endpoint = free_endpoint()
    engine = Engine(lm, EngineConfig(num_blocks=32, block_size=BS, kv_events=endpoint))
    try:
        assert engine._events is not None and engine._events.endpoint == endpoint
        with pytest.raises(KVEventsError, match="cannot bind"):
            KVEventPublisher(endpoint)  # taken
        generate(engine, list(range(5, 5 + 2 * BS + 3)))
    finally:
        engine.close()
    pub = KVEventPublisher(endpoint)  # closed with the engine: free again
    pub.close()


def test_a_slow_sender_drops_the_oldest_batches_never_the_engine():
    """The sender is held inside a send: the engine's flushes still return, the
    queue keeps only the newest ``max_batches`` and counts the rest as dropped."""
    pub = KVEventPublisher(free_endpoint(), max_batches=4)
    w = Wire(pub)
    packb = pub._packb
    release = threading.Event()

    def held(*a, **k):
        release.wait(30)
        return packb(*a, **k)

    pub._packb = held
    sent0 = pub.sent
    try:
        for i in range(50):  # would hang here if flush waited for the sender
            pub.removed([i])
            pub.flush()
        assert pub.sent == sent0  # the sender is still in its first send
        # the sender took one batch (the first, or one of the newest if it was late)
        assert pub.dropped in (45, 46)
        release.set()
        deadline = time.monotonic() + 10
        while pub.sent - sent0 + pub.dropped < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        w.drain()
        assert pub.sent - sent0 + pub.dropped == 50
        got = [e["block_hashes"][0] for e in w.events()]
        assert got[-4:] == [wire(i) for i in range(46, 50)]  # the newest are kept
        assert got == sorted(got)
    finally:
        release.set()
        pub.close()
        w.close()


def test_replay_gives_back_what_a_late_subscriber_missed():
    """Batches sent before anyone subscribed are lost to PUB; the replay socket
    answers a start seq with the buffered batches from there on (the newest
    ``replay_batches``), then the end marker; a malformed request gets the marker alone."""
    pub = KVEventPublisher(free_endpoint(), replay_endpoint=free_endpoint(), replay_batches=4)
    try:
        for i in range(6):  # nobody listens: all six go nowhere on the PUB socket
            pub.removed([i])
            pub.flush()
        deadline = time.monotonic() + 10
        while pub.sent < 6:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pub.replay_endpoint is not None
        got = ask_replay(pub.replay_endpoint, 0)
        assert [seq for seq, _ in got] == [2, 3, 4, 5]  # the newest four
        assert [evs[0]["block_hashes"] for _, evs in got] == [[wire(i)] for i in range(2, 6)]
        assert [seq for seq, _ in ask_replay(pub.replay_endpoint, 4)] == [4, 5]
        assert ask_replay(pub.replay_endpoint, 6) == []
        assert ask_replay(pub.replay_endpoint, 0, frames=[b"", b"short"]) == []
        assert ask_replay(pub.replay_endpoint, 0, frames=[b"x", b"", b"y"]) == []
        assert len(ask_replay(pub.replay_endpoint, 5)) == 1  # still answering
        w = Wire(pub)  # live batches still go out, and are kept for replay too
        pub.removed([99])
        pub.flush()
        w.drain()
        (seq, evs), *_ = w.batches
        assert evs[0]["block_hashes"] == [wire(99)]
        assert ask_replay(pub.replay_endpoint, seq) == [(seq, evs)]
        w.close()
    finally:
        pub.close()
    # Both sockets are closed with the publisher; a busy replay address frees the PUB one.
    assert pub.replay_endpoint is not None
    busy = KVEventPublisher(pub.replay_endpoint)
    try:
        with pytest.raises(KVEventsError, match="cannot bind"):
            KVEventPublisher(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        KVEventPublisher(pub.endpoint).close()
    finally:
        busy.close()
    with pytest.raises(KVEventsError, match="must differ"):
        KVEventPublisher(pub.endpoint, replay_endpoint=pub.endpoint)


@pytest.mark.parametrize(
    "bad", ["127.0.0.1:5557", "tcp://:5557", "tcp://h:0", "tcp://h:x", "ipc://"]
)
def test_malformed_endpoints_are_refused(bad):
    with pytest.raises(KVEventsError, match="tcp://HOST:PORT"):
        check_endpoint(bad)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_across_ranks_rank_zero_publishes(tmp_path):
    """``cairn serve --kv-events`` over 2 ranks (MLX_HOSTFILE / MLX_RANK by hand): rank 0
    owns the scheduler and the socket; a request's blocks arrive as a BlockStored chain
    with the disk tier's hashes, and stopping rank 0 sends AllBlocksCleared."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from live_server import free_port, wait_healthy
    from mlx_cairn.models import load
    from mlx_cairn.models.export import save_folder
    from mlx_cairn.testing.tiny_models import tiny_zoo_model

    loaded = tiny_zoo_model("llama", seed=5)
    folder = save_folder(loaded, tmp_path / "tiny-llama")
    ring = free_port()
    while True:  # the ring backend takes two consecutive ports
        with socket.socket() as s1, socket.socket() as s2:
            try:
                s1.bind(("127.0.0.1", ring))
                s2.bind(("127.0.0.1", ring + 1))
                break
            except OSError:
                ring = free_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
    port, endpoint, replay_at = free_port(), free_endpoint(), free_endpoint()
    env = {k: v for k, v in os.environ.items() if k not in ("CAIRN_API_KEY", "MLX_RANK")}
    procs = []
    for rank in (0, 1):
        cmd = [
            sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(folder), "--kv-events", endpoint,
            "--kv-events-replay", replay_at, "--rank-timeout", "30", "--log-level", "warning",
        ]  # fmt: skip
        rank_env = {**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
        with open(tmp_path / f"rank{rank}.log", "wb") as f:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=rank_env, start_new_session=True
                )
            )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # before rank 0 binds; what it misses, replay gives back
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, procs[0], tmp_path / "rank0.log", timeout=90, what="the ranks")
        time.sleep(0.5)  # the subscription reaches the PUB socket
        body = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0}
        body["messages"] = [{"role": "user", "content": "Tell me about the ranks. " * 8}]
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        n_tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        live: list[tuple[int, list]] = []
        while sub.poll(1000):
            _, seq, payload = sub.recv_multipart()
            live.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
        assert live, "nothing published"
        seqs = [seq for seq, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # none lost
        # The batches PUB sent before the subscription arrived come back by replay.
        batches = ask_replay(replay_at, 0)
        assert [seq for seq, _ in batches] == list(range(seqs[-1] + 1))
        assert batches[seqs[0] :] == live
        events = [e for _, evs in batches for e in evs]
        assert events[0] == {"type": "AllBlocksCleared"}  # the engine's start
        metrics = httpx.get(url + "/metrics", timeout=30).text
        sent = f'cairn_kv_event_batches_total{{model="tiny-llama",outcome="sent"}} {len(batches)}.0'
        assert sent in metrics, metrics
        assert 'outcome="dropped"} 0.0' in metrics
        stored = [e for e in events if e["type"] == "BlockStored"]
        # One chain from the first block: parents link, and the hashes are the
        # disk tier's for the token ids carried (seeded by the served identity).
        chain: list[bytes] = []
        tokens: list[int] = []
        for e in stored:
            assert e["parent_block_hash"] == (chain[-1] if chain else None), events
            assert len(e["token_ids"]) == len(e["block_hashes"]) * BS
            chain += e["block_hashes"]
            tokens += e["token_ids"]
        assert len(chain) == (n_tokens - 1) // BS >= 3  # the last token is never computed
        served = load(str(folder))
        assert chain == [wire(h) for h in disk_hashes(served, tokens)]
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(60) == 0
        tail: list[dict] = []
        while sub.poll(1000):
            tail += msgpack.unpackb(sub.recv_multipart()[2])[1]
        assert tail and tail[-1] == {"type": "AllBlocksCleared"}
    finally:
        sub.close(linger=0)
        ctx.term()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_serve_refuses_what_cannot_publish(tmp_path, capsys):
    """Exit 2, one line naming the flag, before any model loads."""
    from mlx_cairn.cli import main

    ep = free_endpoint()
    two = ["--model", str(tmp_path / "a"), "--model", str(tmp_path / "b")]
    assert main(["serve", *two, "--kv-events", ep]) == 2
    assert "--kv-events publishes one model's KV cache" in capsys.readouterr().err
    busy = KVEventPublisher(ep)
    try:
        assert main(["serve", "--model", str(tmp_path / "a"), "--kv-events", ep]) == 2
        assert f"--kv-events: cannot bind {ep}" in capsys.readouterr().err
    finally:
        busy.close()
    replay_only = ["serve", "--model", str(tmp_path / "a"), "--kv-events-replay", ep]
    assert main(replay_only) == 2
    assert "--kv-events-replay replays what --kv-events publishes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--kv-events", "localhost:5557"])
    assert e.value.code == 2 and "tcp://HOST:PORT" in capsys.readouterr().err


def test_rebuilt_pools_clear_the_routers_view(lm, monkeypatch):
    """Pools that cannot be evaluated are rebuilt empty (Engine._recover_pools): the
    events say AllBlocksCleared, and what follows is again what the engine holds."""
    import mlx_cairn.engine.core as engine_mod

    rng = np.random.default_rng(5)
    prompt = [int(x) for x in rng.integers(3, 300, size=3 * BS + 5)]
    pub = KVEventPublisher(free_endpoint())
    w = Wire(pub)
    engine = Engine(lm, EngineConfig(num_blocks=32, block_size=BS, kv_events=pub))
    try:
        generate(engine, prompt)
        wait_idle(engine)
        w.drain()
        assert replay(w.events(everything=True)) == engine_cached(engine) != set()

        real_eval, calls = engine_mod.mx.eval, []

        def broken(*a, **k):  # the first evaluation fails, as a broken graph would
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a broken pool graph")
            return real_eval(*a, **k)

        def rebuild() -> None:  # on the engine thread, before the next step's forward pass
            engine._fault_hook = None
            with monkeypatch.context() as m:
                m.setattr(engine_mod.mx, "eval", broken)
                engine._recover_pools()

        engine._fault_hook = rebuild
        base = engine.prepare(
            ChatRequest(messages=[Message("user", "x")], max_tokens=2, sampling=SamplingParams(0.0))
        )
        s = engine.submit(dataclasses.replace(base, prompt_ids=prompt[:20]))
        list(s.iter_sync(timeout=TIMEOUT))  # ended by the reset
        wait_idle(engine)
        w.drain()
        assert {"type": "AllBlocksCleared"} in w.events()
        assert engine_cached(engine) == set() == replay(w.events(everything=True))
        generate(engine, prompt)
        wait_idle(engine)
        w.drain()
        assert replay(w.events(everything=True)) == engine_cached(engine) != set()
    finally:
        engine.close()
        pub.close()
        w.close()


def test_blocks_read_back_from_the_disk_tier_are_stored_again(lm, tmp_path):
    """With a disk tier, blocks evicted (BlockRemoved) and later read back for a prefix
    hit join the cache again (BlockStored): the events still match the cache."""
    rng = np.random.default_rng(6)
    prefixes = [[int(x) for x in rng.integers(3, 300, size=3 * BS)] for _ in range(6)]
    pub = KVEventPublisher(free_endpoint())
    w = Wire(pub)
    engine = Engine(
        lm,
        EngineConfig(
            num_blocks=12, block_size=BS, kv_events=pub, kv_disk_dir=tmp_path, kv_disk_gb=0.1
        ),
    )
    try:
        for _ in range(2):
            for p in prefixes:
                generate(engine, p + [int(x) for x in rng.integers(3, 300, size=3)])
            engine._disk.drain()
        st = wait_idle(engine)
        w.drain()
        assert st.disk_hit_blocks > 0, "nothing was read back from disk"
        assert replay(w.events(everything=True)) == engine_cached(engine) != set()
        stored = [h for e in w.events(everything=True) if e["type"] == "BlockStored"
                  for h in e["block_hashes"]]  # fmt: skip
        assert len(stored) > len(set(stored))  # some blocks joined twice (evicted, read back)
    finally:
        engine.close()
        pub.close()
        w.close()
