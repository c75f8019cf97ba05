"""KV-cache events in vLLM's wire format over a ZMQ PUB socket (``--kv-events``).

A cache-aware router (vllm-router's ``kv_aware`` policy) subscribes to each
replica's socket and keeps, per replica, which token blocks it has cached; a
request then goes where most of its prompt is cached already. The engine
reports what its prefix cache does::

    block joins the prefix cache      -> BlockStored   (hashes, parent, token ids)
    cached block evicted (allocate)   -> BlockRemoved  (hashes)
    pools rebuilt, engine started/closed -> AllBlocksCleared

Threads: the engine thread only appends to a list (:meth:`stored`,
:meth:`removed`, :meth:`cleared`) and, once per step, hands that list over as
one batch (:meth:`flush`) to a bounded queue; a background thread owns the
socket, encodes and sends. The engine never waits on the network: when the
queue is full the oldest batch is dropped (``dropped`` counts them).

Wire format (docs/routers.md; what vllm-router 0.1.17 reads, as vLLM sends it):
multipart ``[topic, seq (8-byte big-endian), msgpack payload]``, the payload an
array ``[ts, [event, ...], data_parallel_rank]``, each event a tagged map::

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Hashes are the prefix cache's chained 128-bit block hashes (seeded from the
model, as the disk tier's: the same in every process), sent as 16 big-endian
bytes.

Replay (``replay_endpoint``, ``--kv-events-replay``): PUB drops whatever it
sends before a subscriber's subscription arrives, and a subscriber that
reconnects has a gap. As vLLM does, a ROUTER socket answers a request carrying
a start ``seq`` (8 bytes, big-endian; ``[b"", seq]`` from a DEALER, or ``seq``
from a REQ) with every batch still buffered from that ``seq`` on, one
``[seq, payload]`` reply each, then the end marker ``[-1 (8 bytes, signed), b""]``.
The newest ``replay_batches`` batches sent are kept. A malformed request gets
the end marker alone. Example::

    pub = KVEventPublisher("tcp://127.0.0.1:5557")   # binds now, or raises KVEventsError
    pub.stored([h0, h1], None, tokens[:32], 16)
    pub.flush()                                      # one batch per engine step
    pub.close()
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import Any

log = logging.getLogger("mlx_cairn.engine.kv_events")

#: Batches (one per engine step that changed the cache) waiting for the sender at most.
MAX_QUEUED_BATCHES = 4096
#: How long closing waits for queued batches to go out.
CLOSE_LINGER_S = 1.0
#: Batches sent that a replay request can still get (as vLLM's default).
REPLAY_BATCHES = 10_000
#: The replay stream's last reply carries this ``seq``: -1, 8 bytes, signed.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How often the replay thread looks up from its socket to see if it should stop.
REPLAY_POLL_MS = 100
#: Where the events' blocks live (vLLM's name for the accelerator's pool).
MEDIUM = "GPU"

_Event = tuple[Any, ...]

_live: weakref.WeakSet[KVEventPublisher] = weakref.WeakSet()


class KVEventsError(ValueError):
    """The endpoint is malformed, cannot be bound, or pyzmq/msgpack are missing."""


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a ZMQ bind address this publisher takes (``tcp://HOST:PORT``
    or ``ipc://PATH``); raises KVEventsError otherwise."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return endpoint
    raise KVEventsError(
        f"expected a ZMQ bind address tcp://HOST:PORT (or ipc://PATH), got {endpoint!r}"
    )


def _wire_hash(h: int) -> bytes:
    return int(h).to_bytes(16, "big")


def _encode_event(ev: _Event) -> dict[str, Any]:
    kind = ev[0]
    if kind == "BlockStored":
        _, hashes, parent, tokens, block_size = ev
        return {
            "type": "BlockStored",
            "block_hashes": [_wire_hash(h) for h in hashes],
            "parent_block_hash": None if parent is None else _wire_hash(parent),
            "token_ids": [int(t) for t in tokens],
            "block_size": block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
        }
    if kind == "BlockRemoved":
        return {
            "type": "BlockRemoved",
            "block_hashes": [_wire_hash(h) for h in ev[1]],
            "medium": MEDIUM,
        }
    return {"type": "AllBlocksCleared"}


class KVEventPublisher:
    """A ZMQ PUB socket bound to ``endpoint`` and the thread that sends on it; with
    ``replay_endpoint``, a ROUTER socket there and a thread that answers replays.

    ``stored`` / ``removed`` / ``cleared`` / ``flush`` belong to one thread (the
    engine's); ``close`` and the counters may be used from any.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: bytes = b"",
        data_parallel_rank: int = 0,
        max_batches: int = MAX_QUEUED_BATCHES,
        replay_endpoint: str | None = None,
        replay_batches: int = REPLAY_BATCHES,
    ) -> None:
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
            if replay_endpoint == endpoint:
                raise KVEventsError(f"the replay endpoint must differ from {endpoint}")
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise KVEventsError(
                f"KV events need pyzmq and msgpack ({e.name} is missing): "
                "pip install 'mlx-cairn[kv-events]'"
            ) from None
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.max_batches = max_batches
        #: Batches sent, batches dropped (queue full, or a send that failed), events queued.
        self.sent = 0
        self.dropped = 0
        self.events = 0
        self._pending: list[_Event] = []
        self._queue: deque[tuple[float, list[_Event]]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._seq = 0
        self._packb = msgpack.packb
        #: (seq, payload) of the newest batches sent, for replay (None without it).
        self._sent: deque[tuple[int, bytes]] | None = None
        self._sent_lock = threading.Lock()
        self._ctx = zmq.Context()
        opened: list[Any] = []
        try:
            sock = self._bind(zmq.PUB, endpoint, opened)
            self._replay_sock = None
            if replay_endpoint is not None:
                self._replay_sock = self._bind(zmq.ROUTER, replay_endpoint, opened)
                self._sent = deque(maxlen=max(1, replay_batches))
        except KVEventsError:
            for bound in opened:
                bound.close(linger=0)
            self._ctx.term()
            raise
        # Bound on this thread; from here on each belongs to its own thread.
        self._sock = sock
        self._thread = threading.Thread(target=self._send_loop, name="cairn-kv-events", daemon=True)
        self._thread.start()
        self._replay_thread: threading.Thread | None = None
        if self._replay_sock is not None:
            self._replay_thread = threading.Thread(
                target=self._replay_loop, name="cairn-kv-replay", daemon=True
            )
            self._replay_thread.start()
        _live.add(self)

    def _bind(self, kind: int, endpoint: str, opened: list[Any]) -> Any:
        """A socket of ``kind`` bound to ``endpoint`` (added to ``opened``)."""
        import zmq

        sock = self._ctx.socket(kind)
        opened.append(sock)
        sock.setsockopt(zmq.LINGER, int(CLOSE_LINGER_S * 1000))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise KVEventsError(f"cannot bind {endpoint}: {e}") from None
        return sock

    # ------------------------------------------------------------ engine thread

    def stored(
        self, hashes: list[int], parent: int | None, token_ids: list[int], block_size: int
    ) -> None:
        """Blocks ``hashes`` (a chain, ``parent`` before the first) joined the cache;
        ``token_ids`` are their tokens, ``block_size`` per block."""
        self._pending.append(("BlockStored", hashes, parent, token_ids, block_size))

    def removed(self, hashes: list[int]) -> None:
        """Cached blocks ``hashes`` were evicted."""
        self._pending.append(("BlockRemoved", hashes))

    def cleared(self) -> None:
        """Every cached block is gone."""
        self._pending.append(("AllBlocksCleared",))

    def flush(self) -> None:
        """Hand this step's events to the sender as one batch (no-op when there are none)."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self.max_batches:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("KV events: %d batch(es) dropped (sender behind)", self.dropped)
            self._queue.append((time.time(), batch))
            self.events += len(batch)
            self._cond.notify()

    # ------------------------------------------------------------ sender thread

    def _send_loop(self) -> None:
        sock = self._sock
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if not self._queue:
                        return
                    ts, batch = self._queue.popleft()
                try:
                    payload = self._packb(
                        [ts, [_encode_event(e) for e in batch], self.data_parallel_rank],
                        use_bin_type=True,
                    )
                    sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
                    if self._sent is not None:
                        with self._sent_lock:
                            self._sent.append((self._seq, payload))
                    self._seq += 1
                    self.sent += 1
                except Exception:  # a cache hint: never take the server down over it
                    self.dropped += 1
                    log.exception("KV events: a batch could not be sent")
        finally:
            sock.close()

    # ------------------------------------------------------------ replay thread

    def _replay_loop(self) -> None:
        sock = self._replay_sock
        try:
            while not self._closing:
                if not sock.poll(REPLAY_POLL_MS):
                    continue
                try:
                    self._answer_replay(sock, sock.recv_multipart())
                except Exception:  # a cache hint: never take the server down over it
                    log.exception("KV events: a replay request could not be answered")
        finally:
            sock.close(linger=0)

    def _answer_replay(self, sock: Any, frames: list[bytes]) -> None:
        """``frames`` is ``[identity, b"", start seq]``: send the batches buffered from
        that seq on, then the end marker (alone when the request is malformed)."""
        if len(frames) < 2:
            return  # no envelope to answer on
        ident, start = frames[0], frames[-1]
        if len(frames) == 3 and not frames[1] and len(start) == 8:
            first = int.from_bytes(start, "big")
            with self._sent_lock:
                assert self._sent is not None
                batches = [(seq, p) for seq, p in self._sent if seq >= first]
            for seq, payload in batches:
                sock.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
        else:
            log.debug("KV events: a malformed replay request (%d frames)", len(frames))
        sock.send_multipart([ident, b"", END_SEQ, b""])

    # ------------------------------------------------------------------ any thread

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``CLOSE_LINGER_S`` for it to leave), then close."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._replay_thread is not None:
            self._replay_thread.join(timeout)
        if not any(t is not None and t.is_alive() for t in (self._thread, self._replay_thread)):
            self._ctx.term()
        _live.discard(self)


def close_all() -> None:
    """Close every publisher still open (server shutdown)."""
    for pub in list(_live):
        pub.close()
