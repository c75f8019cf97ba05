"""One model over several ranks with MLX distributed (``mx.distributed``; docs/design.md §8).

Rank 0 owns HTTP, admission, the scheduler, the block pool and the prefix
table, and samples. Every rank holds its shard of the weights (mlx-lm's
``model.shard(group)``: tensor parallel, or ``model.model.pipeline(group)``:
its layers) and KV pools over the same block ids, holding its heads or layers.

Each forward call's exact inputs are broadcast from rank 0 at the one seam where
they are final (:meth:`DistributedRunner._forward`), so every rank runs the same
batched call on its shard; so is each pool operation done outside a call (the
partial-block copies of a prefix hit)::

    rank 0                                         rank r > 0 (:func:`follow`)
    schedule -> plan -> runner.execute
      copy_rows(copies)   ── COPY  [src,dst,n]* ──► pools.copy_rows
      _forward(tokens, cache)
                          ── FORWARD tokens, ───► PagedKVCache(same tables) ;
                             offsets, lengths,    model(tokens, cache) ;
                             block tables,        eval (the shard's collectives
                             state slots          pair with rank 0's)
      logits, sample (rank 0 only)
    idle                  ── NOOP (heartbeat) ──►
    close                 ── STOP ──────────────► exit 0

A message is a fixed header ``[op, n, sequence number, magic]`` and an int32
payload of ``n`` values, each sent with ``mx.distributed.all_sum`` (the other
ranks add zeros): MLX's own collective, over whatever backend the group runs
(ring over TCP, JACCL, MPI).

Failure: every collective runs under a watchdog. A rank that dies makes the ring
raise; one that stops answering trips the watchdog after ``timeout`` seconds.
Either way rank 0 ends every request with a 503 (``unavailable``) and exits
(:data:`EXIT_RANK_LOST`) after :data:`EXIT_GRACE_S`; a follower that hears nothing
(rank 0 sends a heartbeat every ``timeout / 4`` seconds when idle) exits at once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_cairn.engine.config import EngineConfig
from mlx_cairn.engine.model_runner import ModelRunner, SampledStep, StepOutput
from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.errors import ModelLoadError, ModelUnavailable
from mlx_cairn.types import Error

log = logging.getLogger("mlx_cairn.distributed")

#: Seconds a collective (a step's broadcast, a step's forward pass) may take by default.
DEFAULT_RANK_TIMEOUT = 60.0
#: Exit status of a rank whose group lost a member.
EXIT_RANK_LOST = 3
#: Rank 0 waits this long after failing every request before it exits (the 503s go out).
EXIT_GRACE_S = 1.5

# Message kinds.
INIT, FORWARD, COPY, NOOP, STOP = 1, 2, 3, 4, 5
_MAGIC = 0x0CA1
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

#: Engine options that do not work across ranks yet: (argparse dest, flag, why).
UNSUPPORTED_FLAGS = (
    ("kv_disk_dir", "--kv-disk-dir", "the disk tier writes rank 0's pools only"),
    ("speculative", "--speculative", "speculative decoding is single-process for now"),
    ("draft_model", "--draft-model", "a draft model is single-process for now"),
    ("kv_bits", "--kv-bits", "quantized KV pools are not tested across ranks"),
    ("models_dir", "--models-dir", "ranks serve one model, named with --model"),
)


class RankLost(RuntimeError):
    """A rank of the group died or stopped answering: the group cannot go on."""


def group_from_env(env: dict[str, str] | None = None) -> Any:
    """The ``mx.distributed`` group this process belongs to, or None when it runs alone.

    ``mlx.launch`` (ring, JACCL, MPI) sets ``MLX_RANK``; so may a person, with
    ``MLX_HOSTFILE`` (ring). A group of one is the single-process server.
    """
    env = dict(os.environ) if env is None else env
    if "MLX_RANK" not in env and "OMPI_COMM_WORLD_RANK" not in env:
        return None
    group = mx.distributed.init(strict=True)
    return group if group.size() > 1 else None


def refusals(args: Any) -> list[str]:
    """What ``cairn serve``'s flags ask for that ranks cannot do (one line each)."""
    out = [
        f"{flag} cannot be used across ranks: {why}"
        for dest, flag, why in UNSUPPORTED_FLAGS
        if getattr(args, dest, None)
    ]
    models = list(getattr(args, "model", None) or [])
    if len(models) != 1:
        out.append("across ranks, name exactly one model folder with --model")
    return out


# ------------------------------------------------------------------ sharding


def sharding_of(model_type: str) -> str:
    """``"tensor"`` or ``"pipeline"``: how mlx-lm can split ``model_type`` over ranks.

    Raises ModelLoadError naming the architecture when it can do neither.
    """
    from mlx_lm import __version__
    from mlx_lm.models.pipeline import PipelineMixin

    from mlx_cairn.models.zoo import model_classes

    model_cls, _ = model_classes({"model_type": model_type})
    if hasattr(model_cls, "shard"):
        return "tensor"
    module = importlib.import_module(model_cls.__module__)
    if any(
        isinstance(v, type) and issubclass(v, PipelineMixin) and v is not PipelineMixin
        for v in vars(module).values()
    ):
        return "pipeline"
    raise ModelLoadError(
        f"architecture {model_type!r} cannot run across ranks: mlx-lm {__version__} "
        "gives it neither shard() (tensor parallel) nor pipeline()"
    )


def head_problem(config: dict[str, Any], ranks: int) -> str | None:
    """Why tensor parallelism over ``ranks`` cannot split ``config``'s attention heads
    evenly (mlx-lm's ``shard()`` divides them by the rank count), or None."""
    text = config.get("text_config") or {}
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = text.get(key, config.get(key))
        if isinstance(n, int) and n % ranks:
            return (
                f"{key} = {n} cannot be split evenly over {ranks} ranks "
                "(tensor parallel gives each rank the same number of heads)"
            )
    return None


def shard_model(model: Any, group: Any) -> str:
    """Split a lazily loaded mlx-lm model over ``group`` in place; returns how."""
    if hasattr(model, "shard"):
        args = getattr(model, "args", None)
        config = vars(args) if args is not None and hasattr(args, "__dict__") else {}
        if (problem := head_problem(config, group.size())) is not None:
            raise ModelLoadError(problem)
        model.shard(group)
        return "tensor"
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "pipeline"):
        inner.pipeline(group)
        return "pipeline"
    model_type = getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]
    raise ModelLoadError(
        f"architecture {model_type!r} cannot run across ranks: neither shard() nor pipeline()"
    )


# ------------------------------------------------------------------ messages


class Watchdog:
    """Calls ``on_expire(what)`` once when a watched section runs past ``timeout``."""

    def __init__(self, timeout: float, on_expire: Callable[[str], None]) -> None:
        self.timeout = timeout
        self._on_expire = on_expire
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._fired = False
        threading.Thread(target=self._run, name="cairn-rank-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        with self._cond:
            self._deadline = time.monotonic() + self.timeout
            self._what = what
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._deadline = None

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                what, self._deadline = self._what, None
                if not self._fired:
                    self._fired = True
                    threading.Thread(target=self._on_expire, args=(what,), daemon=True).start()


class Channel:
    """Rank 0 -> every rank messages over ``all_sum``, each under the watchdog.

    ``on_lost(message)`` is called once when a collective raises or hangs; from
    then on every send or receive raises :class:`RankLost` without touching the group.
    """

    def __init__(self, group: Any, timeout: float, on_lost: Callable[[str], None]) -> None:
        self.group = group
        self.rank = group.rank()
        self.lost: str | None = None
        self._on_lost = on_lost
        self._seq = 0
        #: Messages sent so far.
        self.sent = 0
        self.watchdog = Watchdog(timeout, self._expired)

    def _expired(self, what: str) -> None:
        self.lose(f"a rank stopped answering ({what} took over {self.watchdog.timeout:g} s)")

    def lose(self, message: str) -> None:
        if self.lost is None:
            self.lost = message
            log.error("distributed group lost: %s", message)
            self._on_lost(message)

    def run(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (which evaluates collectives) under the watchdog; a failure is fatal."""
        if self.lost is not None:
            raise RankLost(self.lost)
        try:
            with self.watchdog.watch(what):
                return fn()
        except Exception as e:
            self.lose(f"{what} failed: {e}")
            raise RankLost(self.lost or str(e)) from e

    def _sum(self, x: mx.array) -> np.ndarray:
        y = mx.distributed.all_sum(x, group=self.group)
        mx.eval(y)
        return np.array(y, copy=False)

    def send(self, op: int, data: Sequence[int] | np.ndarray = ()) -> None:
        """Rank 0: one message to every other rank."""
        payload = np.asarray(data, dtype=np.int32)
        self._seq += 1
        self.sent += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("send %d #%d: %s", op, self._seq, payload[:24].tolist())
        header = mx.array([op, payload.size, self._seq & 0x7FFFFFFF, _MAGIC], dtype=mx.int32)

        def go() -> None:
            self._sum(header)
            if payload.size:
                self._sum(mx.array(payload))

        self.run(f"message {op}", go)

    def recv(self) -> tuple[int, np.ndarray]:
        """Rank > 0: the next message (zeros are this rank's part of each sum)."""

        def go() -> tuple[int, np.ndarray]:
            h = self._sum(mx.zeros((4,), dtype=mx.int32))
            op, n, _, magic = (int(v) for v in h)
            if magic != _MAGIC:
                raise RuntimeError(f"garbled step header {h.tolist()}")
            data = self._sum(mx.zeros((n,), dtype=mx.int32)) if n else np.zeros(0, np.int32)
            return op, data

        return self.run("waiting for rank 0", go)  # type: ignore[no-any-return]


def encode_forward(
    tokens: np.ndarray,
    tables: Sequence[Sequence[int]],
    offsets: Sequence[int],
    lengths: int | Sequence[int],
    state_slots: Sequence[tuple[int, Sequence[int]]] | None,
) -> np.ndarray:
    """One forward call's inputs as int32: ``[B, L, has_state] tokens[B*L] offsets[B]
    lengths[B] (len, ids...)*B ((read, n, writes...)*B if has_state)``."""
    b, length = tokens.shape
    lens = [lengths] * b if isinstance(lengths, int) else list(lengths)
    out: list[int] = [b, length, int(state_slots is not None)]
    out += tokens.reshape(-1).tolist()
    out += [int(o) for o in offsets]
    out += [int(n) for n in lens]
    for t in tables:
        out.append(len(t))
        out += [int(i) for i in t]
    if state_slots is not None:
        for read, writes in state_slots:
            out += [int(read), len(writes), *(int(w) for w in writes)]
    return np.asarray(out, dtype=np.int32)


def decode_forward(
    data: np.ndarray,
) -> tuple[mx.array, list[list[int]], list[int], list[int], list[tuple[int, list[int]]] | None]:
    """The inverse of :func:`encode_forward`."""
    v = data.tolist()
    b, length, has_state = v[0], v[1], v[2]
    at = 3
    tokens = mx.array(np.asarray(v[at : at + b * length], dtype=np.int32).reshape(b, length))
    at += b * length
    offsets = v[at : at + b]
    at += b
    lengths = v[at : at + b]
    at += b
    tables: list[list[int]] = []
    for _ in range(b):
        n = v[at]
        tables.append(v[at + 1 : at + 1 + n])
        at += 1 + n
    slots: list[tuple[int, list[int]]] | None = None
    if has_state:
        slots = []
        for _ in range(b):
            read, n = v[at], v[at + 1]
            slots.append((read, v[at + 2 : at + 2 + n]))
            at += 2 + n
    return tokens, tables, offsets, lengths, slots


# ------------------------------------------------------------------ rank 0


class DistributedRunner(ModelRunner):
    """The model runner of rank 0: every forward call and pool copy is sent first."""

    def __init__(self, model: Any, pools: KVPools, channel: Channel) -> None:
        super().__init__(model, pools)
        self.channel = channel
        #: Forward outputs built since the last :meth:`_queue`.
        self._outputs: list[mx.array] = []
        #: The engine thread wakes this often when idle, to send a heartbeat.
        self.idle_s = channel.watchdog.timeout / 4
        # Row identity (what a decode mirror keys on) is rank 0's alone: no mirrors.
        pools.mirror_min_positions = 1 << 62
        dtype = _DTYPES.index(pools.dtype)
        channel.send(INIT, [pools.num_blocks, pools.block_size, pools.num_slots, dtype])

    def _forward(
        self, tokens: mx.array, cache: PagedKVCache, rows: Any, width: int | None
    ) -> mx.array:
        tables, offsets, lengths, slots = cache.inputs
        # Placeholders (the tokens of the step in flight) are read here: followers
        # need every input on the host.
        host = np.asarray(tokens.tolist(), dtype=np.int32)
        self.channel.send(FORWARD, encode_forward(host, tables, offsets, lengths, slots))
        try:
            h = super()._forward(mx.array(host), cache, rows, width)
        except Exception as e:
            # The other ranks run this call; this rank cannot: they would wait forever.
            self.channel.lose(f"rank 0 could not build a call it sent: {e}")
            raise RankLost(str(self.channel.lost)) from e
        # Every rank must run every collective of the call, in the same order: the
        # followers evaluate ``h``, so must rank 0, even where it samples nothing
        # from it (a prompt's middle chunk; the last layer's sums feed ``h`` only).
        self._outputs.append(h)
        return h

    def execute(self, plan: Any) -> StepOutput:
        try:
            return super().execute(plan)
        except RankLost:
            raise
        except Exception:
            # A row failed after its calls were sent (its logits processors, say):
            # the other ranks run those calls, so this rank evaluates them too, or
            # the collectives would pair wrongly. The engine then retries the rows.
            outputs, self._outputs = self._outputs, []
            if outputs:
                self.channel.run("a failed step", functools.partial(mx.eval, outputs))
            raise

    def _queue(self, *arrays: mx.array) -> None:
        outputs, self._outputs = self._outputs, []
        super()._queue(*outputs, *arrays)

    def copy_rows(self, copies: Sequence[tuple[int, int, int]]) -> None:
        self.channel.send(COPY, [x for c in copies for x in c])
        super().copy_rows(copies)

    def read(self, out: StepOutput) -> SampledStep:
        # The step's own collectives (tensor-parallel sums, pipeline sends) run here.
        return self.channel.run("a step", lambda: super(DistributedRunner, self).read(out))  # type: ignore[no-any-return]

    def idle(self) -> None:
        self.channel.send(NOOP)

    def stop(self) -> None:
        if self.channel.lost is None:
            with contextlib.suppress(RankLost):
                self.channel.send(STOP)


def distributed_engine_class() -> type:
    """The Engine subclass rank 0 serves with (imported late: engine.py imports us not)."""
    from mlx_cairn.engine.engine import Engine

    class DistributedEngine(Engine):
        """An Engine whose steps run on every rank of ``group`` (rank 0 only)."""

        def __init__(
            self,
            loaded_model: Any,
            config: EngineConfig | None = None,
            *,
            group: Any,
            timeout: float,
        ) -> None:
            self._group = group
            self._timeout = timeout
            self._lost: str | None = None
            super().__init__(loaded_model, config)

        def _make_runner(self, model: Any, pools: KVPools) -> ModelRunner:
            channel = Channel(self._group, self._timeout, self._on_lost)
            return DistributedRunner(model, pools, channel)

        def _on_lost(self, message: str) -> None:
            """Any thread: fail every request with 503, refuse new ones, exit soon."""
            self._lost = message
            err = Error("unavailable", f"a rank of the distributed group was lost: {message}")
            with self._lock:
                seqs = [*self._update.seqs.values(), *self._inbox]
            for seq in seqs:
                seq.stream._finish(err)
            timer = threading.Timer(EXIT_GRACE_S, os._exit, args=(EXIT_RANK_LOST,))
            timer.daemon = True
            timer.start()

        def submit(self, request: Any) -> Any:
            if self._lost is not None:
                raise ModelUnavailable(
                    f"a rank of the distributed group was lost: {self._lost}", retry_after=5.0
                )
            return super().submit(request)

        def _serve_once(self) -> bool:
            alive = super()._serve_once()
            if not alive:
                assert isinstance(self._runner, DistributedRunner)
                self._runner.stop()
            return alive

    return DistributedEngine


# ------------------------------------------------------------------ ranks > 0


def follow(model: Any, group: Any, timeout: float) -> int:
    """Run rank ``group.rank() > 0``: mirror rank 0's pools and run its forward calls.

    Returns 0 when rank 0 says stop; exits the process (:data:`EXIT_RANK_LOST`)
    when the group is lost.
    """
    from mlx_cairn.engine.parts import layer_specs, materialize

    def lost(message: str) -> None:
        log.error("rank %d: exiting: %s", group.rank(), message)
        os._exit(EXIT_RANK_LOST)

    ch = Channel(group, timeout * 2, lost)  # rank 0 heartbeats every timeout / 4
    materialize(model)
    op, data = ch.recv()
    if op != INIT:
        lost(f"expected the pool sizes first, got message {op}")
    num_blocks, block_size, num_slots, dtype = (int(x) for x in data[:4])
    pools = KVPools(
        layers=layer_specs(model),
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=_DTYPES[dtype],
        num_slots=num_slots,
    )
    log.info("rank %d: KV pools of %d blocks for its shard", group.rank(), num_blocks)
    while True:
        op, data = ch.recv()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("recv %d: %s", op, data[:24].tolist())
        if op == STOP:
            return 0
        if op == NOOP:
            continue
        if op == COPY:
            v = data.tolist()
            pools.copy_rows([(v[i], v[i + 1], v[i + 2]) for i in range(0, len(v), 3)])
        elif op == FORWARD:
            tokens, tables, offsets, lengths, slots = decode_forward(data)
            cache = PagedKVCache(pools, tables, offsets, lengths, slots)
            h = model(tokens, cache)
            cache.commit()
            ch.run("a step", functools.partial(mx.eval, h, *pools.arrays()))
        else:
            lost(f"unknown message {op}")


# ------------------------------------------------------------------ start-up


def startup_problems(args: Any) -> list[str]:
    """Everything that stops ``cairn serve`` from running across ranks, before any load:
    unsupported flags, and an architecture mlx-lm cannot split."""
    import json
    from pathlib import Path

    out = refusals(args)
    if getattr(args, "idle_unload", None):
        out.append("--idle-unload cannot be used across ranks: every rank keeps its shard")
    if out:
        return out
    folder = Path(args.model[0]).expanduser()
    if not (folder / "config.json").is_file():
        return [f"{args.model[0]}: across ranks, serve a Hugging Face / MLX model folder"]
    try:
        config = json.loads((folder / "config.json").read_text())
        model_type = config.get("model_type")
        how = sharding_of(str(model_type))
        ranks = _world_size()
        if how == "tensor" and ranks > 1 and (problem := head_problem(config, ranks)):
            return [f"{folder.name}: {problem}"]
    except ModelLoadError as e:
        return [str(e)]
    except (OSError, ValueError) as e:
        return [f"{folder / 'config.json'}: {e}"]
    return []


def _world_size() -> int:
    """The number of ranks the launcher announced (0 when it does not say)."""
    hosts = os.environ.get("MLX_HOSTFILE")
    if hosts:
        import json

        with contextlib.suppress(OSError, ValueError), open(hosts) as f:
            return len(json.load(f))
    for key in ("OMPI_COMM_WORLD_SIZE", "MLX_WORLD_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def loader(group: Any) -> Callable[[str | None], Any]:
    """A model loader that loads this rank's shard (lazily, split, then evaluated)."""

    def load(source: str | None) -> Any:
        from mlx_cairn.models import load as load_model

        return load_model(source, shard=lambda m: log_sharding(shard_model(m, group), group))

    return load


def log_sharding(how: str, group: Any) -> str:
    log.info("rank %d of %d: %s parallel shard", group.rank(), group.size(), how)
    return how


def serve_follower(args: Any, group: Any) -> int:
    """``cairn serve`` on a rank > 0: load its shard, then run rank 0's steps."""
    try:
        lm = loader(group)(args.model[0])
    except Exception as e:
        log.error("rank %d: cannot load %s: %s", group.rank(), args.model[0], e)
        return 2
    return follow(lm.model, group, float(args.rank_timeout))
