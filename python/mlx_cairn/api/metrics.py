"""``GET /metrics``: the server and its engines in Prometheus text format.

Installed on every app by :func:`install` (one call in ``create_app``). The
route sits behind the same auth gate as every other route; the request
counter is ASGI middleware around the whole app, so it also counts the 401s
and 413s the gate sends.

Families (``model`` is a served model's primary name)::

    cairn_http_requests_total{route,method,status}      counter
    cairn_time_to_first_token_seconds{model}             histogram  (engine clock)
    cairn_time_per_output_token_seconds{model}           histogram  (per request mean)
    cairn_generations_total{model,outcome}               counter    (stop reason or error kind)
    cairn_model_loaded{model}                            gauge      (0 = not loaded or failed)
    cairn_model_memory_bytes{model}                      gauge      (weights + KV pool; 0 unloaded)
    cairn_model_last_used_timestamp_seconds{model}       gauge      (0 = never used)
    cairn_model_load_seconds{model}                      gauge      (its last load)
    cairn_model_loads_total{model}, cairn_model_unloads_total{model}   counters
    cairn_queue_depth{model}                             gauge      (waiting for admission)
    cairn_running_sequences{model}                       gauge
    cairn_kv_blocks{model,state="free|cached|in_use"}    gauge      (cached: hashed, free or not)
    cairn_kv_blocks_total{model}                         gauge      (usable blocks)
    cairn_kv_pool_tokens{model}                          gauge      (tokens the pool holds)
    cairn_prefix_cache_hit_tokens_total{model}           counter
    cairn_generated_tokens_total{model}                  counter
    cairn_preemptions_total{model}                       counter
    cairn_engine_requests_total{model,outcome}           counter    (completed / failed / cancelled)
    cairn_kv_event_batches_total{model,outcome}          counter    (--kv-events: sent / dropped)

A client that disconnects while sending its body gets no answer; it is
counted with ``status="499"`` (nginx's "client closed request"), not as a 500.

``route`` is the matched route's path template (``/v1/messages``), never the
raw path, and ``method`` is one of the standard methods or ``other``, so
hostile requests cannot grow the label set; anything unmatched is
``unmatched``. Engine figures are read from ``engine.stats()`` at scrape time.

Example::

    $ curl -s -H "x-api-key: $CAIRN_API_KEY" localhost:8080/metrics | grep kv_blocks
    cairn_kv_blocks{model="SmolLM2-135M-Instruct",state="free"} 1023.0
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_cairn.types import Done, Error, Event

Family = GaugeMetricFamily | CounterMetricFamily

#: Seconds; from a cached short prompt (milliseconds) to a long cold prefill on CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
#: Seconds per decoded token; 135M on CPU is ~0.07, a big model on a laptop ~0.2.
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
UNMATCHED = "unmatched"
#: Methods counted by name; any other (h11 accepts arbitrary tokens) is "other".
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: Scope key the auth gate sets when the client left while sending its body.
CLIENT_GONE_SCOPE_KEY = "cairn.client_gone"
#: The ``status`` label of such a request.
CLIENT_GONE_STATUS = 499


class Metrics:
    """The metric objects of one app (their own registry: apps never share counters)."""

    def __init__(self, registry_of_models: Any) -> None:
        self.models = registry_of_models
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "cairn_http_requests",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "cairn_time_to_first_token_seconds",
            "From submission to the first sampled token, per finished request.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "cairn_time_per_output_token_seconds",
            "Mean time per decoded token after the first, one observation per request.",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.generations = Counter(
            "cairn_generations",
            "Finished generations by outcome: a stop reason or an error kind.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(registry_of_models))

    def observe(self, model: str, ev: Event) -> None:
        """Record a final Event (Done or Error) of one generation; others are ignored."""
        if isinstance(ev, Done):
            self.generations.labels(model, ev.stop_reason).inc()
            t = ev.timings
            if t.ttft_ms > 0:
                self.ttft.labels(model).observe(t.ttft_ms / 1000.0)
            if t.decode_tokens_per_s > 0:
                self.tpot.labels(model).observe(1.0 / t.decode_tokens_per_s)
        elif isinstance(ev, Error):
            self.generations.labels(model, ev.kind).inc()

    def render(self) -> bytes:
        """The exposition text (reads every engine's stats)."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads ``engine.stats()`` of every loaded model at scrape time."""

    def __init__(self, models: Any) -> None:
        self.models = models

    def describe(self) -> list[Metric]:
        return []  # dynamic: names are checked at collect time only

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        loaded = gauge("cairn_model_loaded", "1 when the model is loaded and serving.", ["model"])
        queue = gauge("cairn_queue_depth", "Requests waiting for admission.", ["model"])
        running = gauge("cairn_running_sequences", "Sequences admitted to the batch.", ["model"])
        blocks = gauge(
            "cairn_kv_blocks",
            "KV blocks by state: free, in_use (referenced), cached (hashed, free or in use).",
            ["model", "state"],
        )
        total = gauge("cairn_kv_blocks_total", "Usable KV blocks.", ["model"])
        pool_tokens = gauge(
            "cairn_kv_pool_tokens",
            "Tokens the KV pool holds (more with --kv-bits for the same budget).",
            ["model"],
        )
        hits = counter(
            "cairn_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            ["model"],
        )
        generated = counter("cairn_generated_tokens", "Tokens sampled.", ["model"])
        preempt = counter("cairn_preemptions", "Sequences preempted for lack of blocks.", ["model"])
        outcomes = counter(
            "cairn_engine_requests", "Engine requests by outcome.", ["model", "outcome"]
        )
        disk_blocks = gauge("cairn_kv_disk_blocks", "KV blocks held by the disk tier.", ["model"])
        disk_bytes = gauge("cairn_kv_disk_bytes", "Bytes of the disk tier's files.", ["model"])
        disk_hits = counter(
            "cairn_kv_disk_hit_blocks", "Blocks read back from disk for prefix hits.", ["model"]
        )
        disk_io = counter(
            "cairn_kv_disk_io_bytes", "Bytes the disk tier read and wrote.", ["model", "op"]
        )
        disk_s = counter(
            "cairn_kv_disk_io_seconds",
            "Seconds the disk tier spent reading and writing (bytes / seconds = throughput).",
            ["model", "op"],
        )
        snaps = gauge(
            "cairn_state_snapshots", "Recurrent-state prefix snapshots stored.", ["model"]
        )
        snap_bytes = gauge(
            "cairn_state_snapshot_bytes", "Bytes of the stored state snapshots.", ["model"]
        )
        snap_hits = counter(
            "cairn_state_snapshot_hit_tokens",
            "Prompt tokens skipped by restoring a state snapshot.",
            ["model"],
        )
        spec = counter(
            "cairn_speculative_tokens",
            "Speculative decoding: draft tokens scored and accepted (accepted / draft = "
            "the acceptance rate).",
            ["model", "kind"],
        )
        kv_events = counter(
            "cairn_kv_event_batches",
            "KV-event batches for a router (--kv-events): sent, or dropped while the "
            "sender was behind.",
            ["model", "outcome"],
        )
        spec_rows = counter(
            "cairn_speculative_verify_rows",
            "Verify rows run (one per request and step).",
            ["model"],
        )
        memory = gauge(
            "cairn_model_memory_bytes", "Weights + KV pool of a loaded model.", ["model"]
        )
        last_used = gauge(
            "cairn_model_last_used_timestamp_seconds", "When a request last used it.", ["model"]
        )
        load_s = gauge("cairn_model_load_seconds", "Duration of its last load.", ["model"])
        loads = counter("cairn_model_loads", "Loads that succeeded.", ["model"])
        unloads = counter("cairn_model_unloads", "Unloads (LRU, idle or explicit).", ["model"])
        # Each sample of an engine's stats: (family, labels after the model name, stats field).
        per_engine: tuple[tuple[Family, tuple[str, ...], str], ...] = (
            (queue, (), "queue_depth"),
            (running, (), "running"),
            (blocks, ("free",), "blocks_free"),
            (blocks, ("cached",), "blocks_cached"),
            (blocks, ("in_use",), "blocks_in_use"),
            (total, (), "blocks_total"),
            (pool_tokens, (), "kv_pool_tokens"),
            (hits, (), "prefix_hit_tokens"),
            (generated, (), "generated_tokens"),
            (preempt, (), "preemptions"),
            (outcomes, ("completed",), "requests_completed"),
            (outcomes, ("failed",), "requests_failed"),
            (outcomes, ("cancelled",), "requests_cancelled"),
            (disk_blocks, (), "disk_blocks"),
            (disk_bytes, (), "disk_bytes"),
            (disk_hits, (), "disk_hit_blocks"),
            (disk_io, ("read",), "disk_read_bytes"),
            (disk_io, ("write",), "disk_write_bytes"),
            (disk_s, ("read",), "disk_read_seconds"),
            (disk_s, ("write",), "disk_write_seconds"),
            (snaps, (), "state_snapshots"),
            (snap_bytes, (), "state_snapshot_bytes"),
            (snap_hits, (), "state_snapshot_hit_tokens"),
            (spec, ("draft",), "spec_draft_tokens"),
            (spec, ("accepted",), "spec_accepted_tokens"),
            (spec_rows, (), "spec_verify_rows"),
            (kv_events, ("sent",), "kv_events_batches"),
            (kv_events, ("dropped",), "kv_events_dropped"),
        )
        # The registry's own per-model fields (absent or None on a model never loaded: 0).
        per_model: tuple[tuple[Family, str], ...] = (
            (last_used, "last_used"),
            (load_s, "load_seconds"),
            (loads, "loads"),
            (unloads, "unloads"),
        )
        for sm in self.models.models:
            name = sm.name
            engine = sm.engine
            loaded.add_metric([name], 1.0 if engine is not None else 0.0)
            memory.add_metric([name], float(sm.memory_bytes) if engine is not None else 0.0)
            for family, field in per_model:
                family.add_metric([name], float(getattr(sm, field, None) or 0))
            if engine is None:
                continue
            st = engine.stats()
            for family, labels, field in per_engine:
                family.add_metric([name, *labels], float(getattr(st, field)))
        yield from (
            loaded,
            queue,
            running,
            blocks,
            total,
            pool_tokens,
            hits,
            generated,
            preempt,
            outcomes,
        )
        yield from (
            snaps,
            snap_bytes,
            snap_hits,
            disk_blocks,
            disk_bytes,
            disk_hits,
            disk_io,
            disk_s,
            spec,
            spec_rows,
            kv_events,
        )
        yield from (memory, last_used, load_s, loads, unloads)


class RequestCounter:
    """ASGI middleware: one ``cairn_http_requests_total`` increment per HTTP response."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before any response start is a 500 to the client

        async def watch(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, watch)
            if scope.get(CLIENT_GONE_SCOPE_KEY):  # set only when nothing was sent
                status = CLIENT_GONE_STATUS
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or UNMATCHED
            method = scope.get("method", "")
            method = method if method in METHODS else "other"
            self.metrics.requests.labels(label, method, str(status)).inc()


def metrics_of(scope: Scope) -> Metrics | None:
    """The :class:`Metrics` of the app serving ``scope`` (None if not installed)."""
    app = scope.get("app")
    state = getattr(app, "state", None)
    return getattr(state, "metrics", None)


def observe_event(scope: Scope, model: str, ev: Event) -> None:
    """Record ``ev`` if it ends a generation (called by the generation runner)."""
    m = metrics_of(scope)
    if m is not None:
        m.observe(model, ev)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics`` (Prometheus text exposition format 0.0.4)."""
    m: Metrics = request.app.state.metrics
    body = await asyncio.to_thread(m.render)
    return Response(body, media_type=CONTENT_TYPE_PLAIN_0_0_4)


def install(app: Any) -> None:
    """Add ``/metrics`` and the request counter to ``app`` (call after its other middleware)."""
    m = Metrics(app.state.cairn.registry)
    app.state.metrics = m
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=True)
    app.add_middleware(RequestCounter, metrics=m)
