"""What the serving layer measures, and its Prometheus exposition.

The controller sees every chunk it routes, and a router (:mod:`cadence_fx.serve.router`) reports the
chunks it sent straight to workers in batches, so it records per conversation the latency of each
chunk (as the controller or the router saw it: the worker's call and the hops to it) and the deadline
misses, the routing overhead by path (that latency minus the worker's own seconds: what serving adds
to a session call; ``path="controller"``, two hops, or ``"router"``, one), and every move: migrations, checkpoints, resumes after a failure, with their seconds and
bytes. Workers' load, capacity, lanes and lanes busy come from the controller's table of them.

Percentiles are over a bounded window of the latest chunks (nearest rank, as the benchmarks), so a
long conversation's early chunks do not hide a later backlog. :meth:`ServeMetrics.exposition` is
the Prometheus text format (``prometheus_client``'s own encoder over a collector of this object, in
a registry of its own: two controllers in one process never clash); the front end serves it.
Closed conversations leave the per-conversation families (their label would grow without bound).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cadence_fx.serve.calibration import percentile

__all__ = ["COUNTERS", "LatencyWindow", "ServeMetrics"]

PREFIX = "cadence_fx_serve"
QUANTILES = (50.0, 99.0)
COUNTERS = {  # name -> help
    "admission_refused": "conversations refused because every worker was at capacity",
    "overcommit": "resumes placed past a worker's capacity (no worker had room)",
    "failovers": "workers found dead whose conversations were resumed elsewhere",
    "replayed_chunks": "chunks re-run from the journal after a failover",
    "sequence_refused": "chunks refused for a wrong sequence number",
    "handoff_fallback": "moves between workers on one GPU that went through the object store (the target "
                        "could not map the source's buffer)",
}
EVENTS = ("migration", "checkpoint", "resume")
PATHS = ("controller", "router")  # a chunk through the controller (two hops) or a router (one)
WORKER_GAUGES = {  # name -> help
    "conversations": "conversations placed on the worker",
    "capacity": "conversations the worker admits (measured or given)",
    "load": "conversations / capacity",
    "lanes": "lanes of the worker's program",
    "lanes_busy": "chunks in flight on the worker (at most its lanes run at once)",
    "ready_seconds": "construction to ready: artifact load, warm-up, calibration",
    "up": "1 while the worker is alive",
}


@dataclass
class LatencyWindow:
    """The latest ``size`` samples (seconds) plus the running count, sum and deadline misses."""

    size: int = 1024
    samples: collections.deque[float] = field(default_factory=collections.deque)
    count: int = 0
    total: float = 0.0
    misses: int = 0

    def add(self, seconds: float, deadline_s: float | None = None) -> None:
        self.samples.append(seconds)
        while len(self.samples) > self.size:
            self.samples.popleft()
        self.count += 1
        self.total += seconds
        if deadline_s is not None and seconds > deadline_s:
            self.misses += 1

    def quantile(self, q: float) -> float:
        return percentile(list(self.samples), q)

    def summary(self) -> dict[str, float]:
        """p50/p99 in ms, count, misses."""
        return {"p50_ms": self.quantile(50) * 1e3, "p99_ms": self.quantile(99) * 1e3, "count": self.count,
                "misses": self.misses}


class ServeMetrics:
    """The controller's measurements (see the module docstring)."""

    def __init__(self, window: int = 1024) -> None:
        self.window = window
        self._lock = threading.Lock()
        self.conversations: dict[str, LatencyWindow] = {}
        self.conversation_worker: dict[str, str] = {}
        self.routing = {path: LatencyWindow(window) for path in PATHS}
        self.events = {k: LatencyWindow(window) for k in EVENTS}
        self.event_bytes = {k: 0 for k in EVENTS}
        self.counters = {k: 0 for k in COUNTERS}
        self.workers: dict[str, dict[str, float]] = {}
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(self))

    # ------------------------------------------------------------------ recording
    def chunk(self, conv_id: str, worker: str, latency_s: float, worker_s: float, deadline_s: float,
              path: str = "controller") -> None:
        with self._lock:
            w = self.conversations.setdefault(conv_id, LatencyWindow(self.window))
            w.add(latency_s, deadline_s)
            self.conversation_worker[conv_id] = worker
            self.routing[path].add(max(0.0, latency_s - worker_s))

    def event(self, kind: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self.events[kind].add(seconds)
            self.event_bytes[kind] += int(nbytes)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def worker(self, name: str, **gauges: float) -> None:
        with self._lock:
            self.workers.setdefault(name, {}).update(gauges)

    def forget(self, conv_id: str) -> None:
        with self._lock:
            self.conversations.pop(conv_id, None)
            self.conversation_worker.pop(conv_id, None)

    # ------------------------------------------------------------------ reading
    def summary(self) -> dict[str, Any]:
        """Everything as plain numbers (status, the benchmark)."""
        with self._lock:
            return {"routing": self.routing["controller"].summary(),
                    "routing_router": self.routing["router"].summary(),
                    "events": {k: {**v.summary(), "bytes": self.event_bytes[k]} for k, v in self.events.items()},
                    "counters": dict(self.counters),
                    "conversations": {c: w.summary() for c, w in self.conversations.items()},
                    "workers": {n: dict(g) for n, g in self.workers.items()}}

    def exposition(self) -> bytes:
        """The Prometheus text exposition (``text/plain; version=0.0.4``)."""
        return generate_latest(self._registry)


def _summary(name: str, doc: str, labels: dict[str, str], w: LatencyWindow, metric: Metric | None = None) -> Metric:
    m = metric if metric is not None else Metric(name, doc, "summary")
    for q in QUANTILES:
        m.add_sample(name, {**labels, "quantile": str(q / 100)}, w.quantile(q) if w.samples else float("nan"))
    m.add_sample(name + "_count", labels, float(w.count))
    m.add_sample(name + "_sum", labels, w.total)
    return m


class _Collector:
    """A ``prometheus_client`` collector reading one :class:`ServeMetrics` at scrape time."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        with m._lock:
            lat = Metric(f"{PREFIX}_chunk_latency_seconds", "chunk latency as the controller saw it, per "
                         "conversation (worker call and routing; recent window)", "summary")
            misses = CounterMetricFamily(f"{PREFIX}_deadline_misses", "chunks later than their deadline",
                                         labels=["conversation", "worker"])
            for conv, w in m.conversations.items():
                labels = {"conversation": conv, "worker": m.conversation_worker.get(conv, "")}
                _summary(lat.name, "", labels, w, lat)
                misses.add_metric([labels["conversation"], labels["worker"]], w.misses)
            yield lat
            yield misses
            routing = Metric(f"{PREFIX}_routing_overhead_seconds", "chunk latency less the worker's own call "
                             "(what routing adds, by path: controller or router; recent window)", "summary")
            for path, w in m.routing.items():
                _summary(routing.name, "", {"path": path}, w, routing)
            yield routing
            ev = Metric(f"{PREFIX}_event_seconds", "seconds per migration, checkpoint and resume", "summary")
            evb = CounterMetricFamily(f"{PREFIX}_event_bytes", "state bytes moved by migrations, checkpoints "
                                      "and resumes", labels=["kind"])
            for kind, w in m.events.items():
                _summary(ev.name, "", {"kind": kind}, w, ev)
                evb.add_metric([kind], m.event_bytes[kind])
            yield ev
            yield evb
            for name, doc in COUNTERS.items():
                c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
                c.add_metric([], m.counters[name])
                yield c
            for gname, doc in WORKER_GAUGES.items():
                g = GaugeMetricFamily(f"{PREFIX}_worker_{gname}", doc, labels=["worker"])
                for wname, gauges in m.workers.items():
                    if gname in gauges:
                        g.add_metric([wname], float(gauges[gname]))
                yield g
