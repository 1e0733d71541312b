"""Prometheus metrics for a kafkatx App, derived from its event bus.

Every counter is fed by events the containers publish once per transaction or
failure (never once per record), so instrumenting an App adds nothing to the
per-record path. Consumer lag comes from librdkafka's statistics callback,
which fires inside the consumer's poll every ``statistics.interval.ms``.

``serve_metrics(app, port)`` serves ``/metrics`` over HTTP (what
``kafkatx run --metrics-port`` does); ``instrument(app)`` only registers the
metrics, for applications that serve a registry themselves. Both need the
``metrics`` extra: ``pip install 'kafkatx[metrics]'``.

Metric names, labels and the lag definition are documented in
``docs/OBSERVABILITY.md``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kafkatx._served import ServedEndpoint
from kafkatx._validate import is_int
from kafkatx.errors import InvalidConfigurationError
from kafkatx.events import (
    ClusterReachable,
    ClusterUnreachable,
    ContainerStarted,
    ContainerStopped,
    HandlerFailed,
    KafkaErrorHandled,
    OutageEnded,
    OutageStarted,
    PartitionsAssigned,
    PartitionsRevoked,
    ProducerRecreated,
    RecordFollowed,
    RecordRecovered,
    RecordRetryScheduled,
    RecordsInRetry,
    RecoveryFailed,
    RetryHandled,
    RetryPartitionFlowing,
    RetryPartitionStalled,
    TransactionAborted,
    TransactionCommitted,
)
from kafkatx.metrics.lag import (
    DEFAULT_STATS_INTERVAL_MS,
    InstrumentedApp,
    LagTracker,
    listener_label,
    shared_lag_tracker,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


__all__ = ["Metrics", "MetricsServer", "instrument", "serve_metrics", "DEFAULT_STATS_INTERVAL_MS", "INSTALL_HINT"]

log = logging.getLogger("kafkatx.metrics")

INSTALL_HINT = "pip install 'kafkatx[metrics]'"

#: Commit latency buckets (seconds): a healthy commit takes a few ms to ~100 ms;
#: the top buckets catch batches that approach transaction.timeout.ms.
COMMIT_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _prometheus() -> Any:
    """Import prometheus_client, or explain how to install it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise InvalidConfigurationError(
            f"kafkatx metrics need the 'metrics' extra (prometheus_client), which is not installed: {INSTALL_HINT}"
        ) from exc
    return prometheus_client


# --------------------------------------------------------------------------
# Prometheus metrics
# --------------------------------------------------------------------------


class _Families:
    """The metric families of one registry; several Apps may share them, told apart by ``app``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        pc = _prometheus()
        base = ("app", "listener")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return pc.Counter(name, doc, (*base, *extra), registry=registry)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return pc.Gauge(name, doc, (*base, *extra), registry=registry)

        self.records = counter(
            "kafkatx_records_processed", "Records whose processing committed (handled, or recovered after failing)"
        )
        self.outputs = counter("kafkatx_outputs_produced", "Records produced by handlers in committed transactions")
        self.failures = counter("kafkatx_handler_failures", "Handler failures (each failed attempt counts)")
        self.retries = counter("kafkatx_record_retries", "Redeliveries scheduled after a handler failure")
        self.followed = counter(
            "kafkatx_records_followed",
            'Records sent to a retry topic behind their key\'s record in retry (retry="topics", ordering="key")',
        )
        self.in_retry = gauge(
            "kafkatx_records_in_retry",
            'Records in retry topics, not consumed back yet, of the partitions assigned (retry="topics")',
        )
        self.oldest_due = gauge(
            "kafkatx_retry_oldest_due_timestamp_seconds",
            "Unix time at which the listener's record in retry due first is due; no sample when none is in retry "
            "(alert on time() minus it: how long a due record has waited)",
        )
        self.retry_stalled = gauge(
            "kafkatx_retry_partitions_stalled",
            'Retry partitions whose first due record was not consumed for a check interval (retry="topics"; '
            "RetryPartitionStalled): their records wait past their back-off",
        )
        self.retries_handled = counter(
            "kafkatx_retries_handled", "Records read back from a retry topic and handled, their transaction committed"
        )
        self.recovered = counter(
            "kafkatx_records_recovered", "Records handed to the recoverer (e.g. sent to the DLQ)", ("recoverer",)
        )
        self.recovery_failures = counter(
            "kafkatx_recovery_failures", "Recoverer failures (the record is kept and recovery retried)"
        )
        self.committed = counter("kafkatx_transactions_committed", "Committed transactions", ("kind",))
        self.aborted = counter("kafkatx_transactions_aborted", "Aborted transactions")
        self.recreations = counter(
            "kafkatx_producer_recreations", "Producers replaced after fencing or another application-recoverable error"
        )
        self.kafka_errors = counter(
            "kafkatx_kafka_errors", "Kafka errors handled, by KIP-1050 error class", ("error_class",)
        )
        self.latency = pc.Histogram(
            "kafkatx_commit_latency_seconds",
            "Duration of committed transactions, begin to commit",
            base,
            buckets=COMMIT_LATENCY_BUCKETS,
            registry=registry,
        )
        self.last_commit = gauge("kafkatx_last_commit_timestamp_seconds", "Unix time of the last committed transaction")
        self.lag = gauge(
            "kafkatx_consumer_lag",
            "Records on the partition not processed yet (last stable offset - consumer position)",
            ("topic", "partition"),
        )
        self.assigned = gauge("kafkatx_assigned_partitions", "Partitions currently assigned to the listener")
        self.running = gauge("kafkatx_containers_running", "Listener containers (consumer threads) running")
        self.in_outage = gauge(
            "kafkatx_listener_in_outage", "1 while a dependency outage pauses the listener (every container of it)"
        )
        self.outages = counter("kafkatx_outages", "Dependency outages that paused the listener")
        self.unreachable = gauge(
            "kafkatx_cluster_unreachable", "1 while no broker of the cluster answers the listener's container"
        )
        self.lso_stuck = gauge(
            "kafkatx_last_stable_offset_stuck_seconds",
            "Seconds the last stable offset of a partition the listener writes has not moved while below its high "
            "watermark, once longer than the transaction timeout plus a margin (a transaction left open); else 0",
            ("topic", "partition"),
        )


_FAMILIES: weakref.WeakKeyDictionary[Any, _Families] = weakref.WeakKeyDictionary()
_METRICS: weakref.WeakKeyDictionary[InstrumentedApp, Metrics] = weakref.WeakKeyDictionary()
_METRICS_LOCK = threading.Lock()


class Metrics:
    """An App's Prometheus metrics. Create it with :func:`instrument`.

    ``registry`` holds them (a dedicated ``CollectorRegistry`` unless you
    passed one), so two Apps in one process never clash.
    """

    def __init__(self, app: InstrumentedApp, registry: CollectorRegistry, families: _Families, lag: LagTracker) -> None:
        self._app_ref = weakref.ref(app)
        self.registry = registry
        self._f = families
        self._app_name = app.name
        self._lag = lag
        self._assigned: dict[tuple[str, int], int] = {}
        self._in_retry: dict[tuple[str, int], tuple[int, float | None]] = {}
        self._retry_stalled: dict[tuple[str, int], set[tuple[str, int]]] = {}
        self._running: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        on = app.events.subscribe
        on(TransactionCommitted, self._committed)
        on(TransactionAborted, self._simple(families.aborted))
        on(HandlerFailed, self._simple(families.failures))
        on(RecordRetryScheduled, self._simple(families.retries))
        on(RecordFollowed, self._simple(families.followed))
        on(RecordsInRetry, self._records_in_retry)
        on(RetryHandled, self._simple(families.retries_handled))
        on(RetryPartitionStalled, self._retry_stall)
        on(RetryPartitionFlowing, self._retry_stall)
        on(RecordRecovered, self._recovered)
        on(RecoveryFailed, self._simple(families.recovery_failures))
        on(ProducerRecreated, self._simple(families.recreations))
        on(KafkaErrorHandled, self._kafka_error)
        on(ContainerStarted, self._started)
        on(ContainerStopped, self._stopped)
        on(PartitionsAssigned, self._partitions)
        on(PartitionsRevoked, self._partitions)
        on(OutageStarted, self._outage_started)
        on(OutageEnded, self._outage_ended)
        on(ClusterUnreachable, lambda event: self._f.unreachable.labels(*self._labels(event)).set(1))
        on(ClusterReachable, lambda event: self._f.unreachable.labels(*self._labels(event)).set(0))
        lag.add_sink(self._lag_update)
        watch = getattr(app, "stable_offsets", None)  # an App's check of its written topics (health/stable_offsets.py)
        if watch is not None:
            watch.add_sink(self._stuck_update)

    @property
    def app(self) -> InstrumentedApp | None:
        """The instrumented App (None once it was garbage-collected)."""
        return self._app_ref()

    def _labels(self, event: Any) -> tuple[str, str]:
        return self._app_name, listener_label(event.listener, event.worker)

    def _simple(self, family: Any) -> Callable[[Any], None]:
        def count(event: Any) -> None:
            family.labels(*self._labels(event)).inc()

        return count

    def _committed(self, event: TransactionCommitted) -> None:
        labels = self._labels(event)
        f = self._f
        f.committed.labels(*labels, event.kind).inc()
        if event.records:
            f.records.labels(*labels).inc(event.records)
        if event.outputs:
            f.outputs.labels(*labels).inc(event.outputs)
        f.latency.labels(*labels).observe(event.seconds)
        f.last_commit.labels(*labels).set_to_current_time()

    def _recovered(self, event: RecordRecovered) -> None:
        self._f.recovered.labels(*self._labels(event), event.recoverer or "unknown").inc()

    def _outage_started(self, event: OutageStarted) -> None:
        labels = self._labels(event)
        self._f.outages.labels(*labels).inc()
        self._f.in_outage.labels(*labels).set(1)

    def _outage_ended(self, event: OutageEnded) -> None:
        self._f.in_outage.labels(*self._labels(event)).set(0)

    def _kafka_error(self, event: KafkaErrorHandled) -> None:
        self._f.kafka_errors.labels(*self._labels(event), event.error_class or "UNKNOWN").inc()

    def _started(self, event: ContainerStarted) -> None:
        with self._lock:
            self._running.add((event.listener, event.worker))
        self._f.running.labels(*self._labels(event)).inc()
        self._f.in_outage.labels(*self._labels(event)).set(0)  # the series exists before any outage
        self._set_assigned(event.listener, event.worker, 0)  # the series exists before the first assignment

    def _stopped(self, event: ContainerStopped) -> None:
        with self._lock:
            was_running = (event.listener, event.worker) in self._running
            self._running.discard((event.listener, event.worker))
        if was_running:  # a container that failed to open stops without having started
            self._f.running.labels(*self._labels(event)).dec()
        self._set_assigned(event.listener, event.worker, 0)
        if (event.listener, event.worker) in self._in_retry:  # its partitions, and their records in retry, are gone
            self._records_in_retry(RecordsInRetry(event.listener, event.worker, 0))
        if self._retry_stalled.get((event.listener, event.worker)):  # so are its stalled retry partitions
            self._set_retry_stalled(event.listener, event.worker, lambda now: set())

    def _partitions(self, event: PartitionsAssigned | PartitionsRevoked) -> None:
        n = len(event.partitions)
        with self._lock:
            current = self._assigned.get((event.listener, event.worker), 0)
        delta = n if isinstance(event, PartitionsAssigned) else -n
        self._set_assigned(event.listener, event.worker, current + delta)

    def _records_in_retry(self, event: RecordsInRetry) -> None:
        """Per container, summed per listener as the assigned partitions are; the oldest due time is the
        earliest of the listener's containers'."""
        listener = listener_label(event.listener, event.worker)
        with self._lock:
            self._in_retry[(event.listener, event.worker)] = (event.records, event.oldest_due)
            mine = [v for (c, w), v in self._in_retry.items() if listener_label(c, w) == listener]
        total = sum(n for n, _ in mine)
        dues = [due for _, due in mine if due is not None]
        self._f.in_retry.labels(self._app_name, listener).set(total)
        if dues:
            self._f.oldest_due.labels(self._app_name, listener).set(min(dues))
        else:
            try:
                self._f.oldest_due.remove(self._app_name, listener)
            except KeyError:
                pass

    def _retry_stall(self, event: RetryPartitionStalled | RetryPartitionFlowing) -> None:
        tp = (event.topic, event.partition)
        stalled = isinstance(event, RetryPartitionStalled)
        self._set_retry_stalled(event.listener, event.worker, lambda now: (now | {tp}) if stalled else (now - {tp}))

    def _set_retry_stalled(
        self, container: str, worker: int, change: Callable[[set[tuple[str, int]]], set[tuple[str, int]]]
    ) -> None:
        """Per container, summed per listener: the retry partitions reported stalled and not flowing since."""
        listener = listener_label(container, worker)
        with self._lock:
            self._retry_stalled[(container, worker)] = change(self._retry_stalled.get((container, worker), set()))
            total = sum(len(v) for (c, w), v in self._retry_stalled.items() if listener_label(c, w) == listener)
        self._f.retry_stalled.labels(self._app_name, listener).set(total)

    def _set_assigned(self, container: str, worker: int, count: int) -> None:
        """Per container, summed per listener: workers of one listener share a series."""
        listener = listener_label(container, worker)
        with self._lock:
            self._assigned[(container, worker)] = max(0, count)
            total = sum(n for (c, w), n in self._assigned.items() if listener_label(c, w) == listener)
        self._f.assigned.labels(self._app_name, listener).set(total)

    def _lag_update(self, listener: str, topic: str, partition: int, lag: int | None) -> None:
        labels = (self._app_name, listener, topic, str(partition))
        if lag is None:
            try:
                self._f.lag.remove(*labels)
            except KeyError:
                pass
        else:
            self._f.lag.labels(*labels).set(lag)

    def _stuck_update(self, listener: str, topic: str, partition: int, seconds: float | None) -> None:
        labels = (self._app_name, listener, topic, str(partition))
        if seconds is None:
            try:
                self._f.lso_stuck.remove(*labels)
            except KeyError:
                pass
        else:
            self._f.lso_stuck.labels(*labels).set(seconds)

    def total_lag(self) -> int | None:
        """Sum of the App's consumer lag over all partitions (None until statistics arrive)."""
        return self._lag.total()

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, e.g. for your own /metrics endpoint."""
        return bytes(_prometheus().generate_latest(self.registry))


def instrument(
    app: InstrumentedApp,
    *,
    registry: CollectorRegistry | None = None,
    stats_interval_ms: int = DEFAULT_STATS_INTERVAL_MS,
) -> Metrics:
    """Register ``app``'s metrics and subscribe them to its events; idempotent per App.

    Call it before ``app.start()``: consumer lag needs librdkafka statistics,
    which are switched on (``statistics.interval.ms``, ``stats_cb``) in the
    consumers' configuration. ``registry`` defaults to a new
    ``CollectorRegistry`` for this App; pass ``prometheus_client.REGISTRY``
    to serve kafkatx's metrics along with your own. A second call returns the
    same :class:`Metrics` (``registry`` must then be omitted or the same).
    """
    pc = _prometheus()
    with _METRICS_LOCK:
        existing = _METRICS.get(app)
        if existing is not None:
            if registry is not None and registry is not existing.registry:
                raise InvalidConfigurationError(
                    f"App {app.name!r} is already instrumented with another registry; call instrument() once per App"
                )
            shared_lag_tracker(app, stats_interval_ms)
            return existing
        if registry is None:
            registry = pc.CollectorRegistry(auto_describe=True)
        families = _FAMILIES.get(registry)
        if families is None:
            families = _FAMILIES[registry] = _Families(registry)
        metrics = _METRICS[app] = Metrics(app, registry, families, shared_lag_tracker(app, stats_interval_ms))
    return metrics


class MetricsServer(ServedEndpoint):
    """A running ``/metrics`` HTTP endpoint; :meth:`stop` shuts it down."""

    path = "/metrics"

    def __init__(self, metrics: Metrics, server: Any, thread: threading.Thread, addr: str) -> None:
        super().__init__(server, thread, addr)
        self.metrics = metrics

    def __enter__(self) -> MetricsServer:
        return self


def serve_metrics(app: InstrumentedApp, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Instrument ``app`` and serve its metrics at ``http://addr:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port (read it from ``.port``). The default
    address only accepts local scrapes; pass ``addr="0.0.0.0"`` for a
    Prometheus running elsewhere.
    """
    pc = _prometheus()
    if not is_int(port, 0, 65535):
        raise InvalidConfigurationError(f"metrics port must be an integer in 0..65535, got {port!r}")
    metrics = instrument(app)
    try:
        server, thread = pc.start_http_server(port, addr, registry=metrics.registry)
    except OSError as exc:
        raise InvalidConfigurationError(
            f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}. Pick another port (0 picks a free one)"
        ) from exc
    handle = MetricsServer(metrics, server, thread, addr)
    log.info("serving metrics of app %s at %s", app.name, handle.url)
    return handle
