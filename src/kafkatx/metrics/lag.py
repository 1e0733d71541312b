"""Consumer lag of an App's listeners, from librdkafka's statistics.

Needs no prometheus_client, so the status line of ``kafkatx run`` uses it
as well as the metrics (:mod:`kafkatx.metrics`).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kafkatx._validate import is_int
from kafkatx.client.offsets import TP
from kafkatx.errors import InvalidConfigurationError
from kafkatx.events import ContainerStopped, HandlerFailed, PartitionsAssigned, PartitionsRevoked

if TYPE_CHECKING:
    from kafkatx.events import EventBus
    from kafkatx.listener.spec import ListenerSpec

log = logging.getLogger("kafkatx.metrics")

#: librdkafka ``statistics.interval.ms`` set for lag, unless the App sets its own.
__all__ = [
    "DEFAULT_STATS_INTERVAL_MS",
    "InstrumentedApp",
    "LagSink",
    "LagTracker",
    "listener_label",
    "shared_lag_tracker",
]


class InstrumentedApp(Protocol):
    """What metrics read of a :class:`kafkatx.App` (a Protocol: the App may import metrics without a circle)."""

    @property
    def name(self) -> str: ...
    @property
    def group_id(self) -> str: ...
    @property
    def events(self) -> EventBus: ...
    @property
    def consumer_config_overrides(self) -> dict[str, Any]: ...
    @property
    def containers(self) -> Sequence[MeteredContainer]: ...
    @property
    def listeners(self) -> Sequence[ListenerSpec]: ...
    def consumer_config(self, spec: ListenerSpec, group_id: str, worker: int) -> dict[str, Any]: ...


#: Building the statistics JSON costs librdkafka some CPU, so not every second.
DEFAULT_STATS_INTERVAL_MS = 5_000

_LIVE_STATES = frozenset({"active", "offset-query", "offset-wait", "validate-epoch-wait"})
_INVALID = -1001  # RD_KAFKA_OFFSET_INVALID in librdkafka statistics

LagSink = Callable[[str, str, int, "int | None"], None]


class _Container(Protocol):
    """What the tracker reads of a running container: which partitions it owns and what it committed there."""

    @property
    def name(self) -> str: ...
    @property
    def worker(self) -> int: ...
    @property
    def assigned(self) -> set[TP]: ...

    def committed_offset(self, tp: TP) -> int | None: ...


class MeteredContainer(_Container, Protocol):
    @property
    def alive(self) -> bool: ...


def listener_label(listener: str, worker: int) -> str:
    """The listener's declared name: ``orders#2`` (worker 2 of ``orders``) becomes ``orders``.

    Workers of one listener share its series, so dashboards aggregate by
    listener without regex tricks; per-partition lag still tells them apart.
    """
    suffix = f"#{worker}"
    return listener[: -len(suffix)] if listener.endswith(suffix) else listener


class LagTracker:
    """Per-partition consumer lag of one App's listeners, from librdkafka statistics.

    Why not librdkafka's own ``consumer_lag``: it is measured from the
    consumer's committed offset, which a transactional App never updates in
    the consumer (offsets commit through the producer), so it stays -1. We
    use ``ls_offset - app_offset`` instead: the last stable offset (what a
    read_committed consumer can reach) minus the consumer's position (the
    next record it will hand to the handler). A container commits each batch
    before it polls again, so this is the committed lag to within one batch.

    librdkafka forgets the position (``app_offset`` -1001) when kafkatx seeks:
    after a failure with ``backoff=`` (the partition is paused and its held
    records handled from memory) and after any rewind; it comes back only with
    the next record consumed from that partition, which may never come. Then
    the position is what kafkatx knows itself: the next offset the container
    committed there, or, before its first commit, the first record that failed
    since the assignment (it is waiting). Without that, a listener with
    ``backoff=`` showed no lag at all (issue 29).
    """

    def __init__(self, app: InstrumentedApp) -> None:
        self._app_ref = weakref.ref(app)  # the App owns us (through its event bus), not the reverse
        self._lock = threading.Lock()
        self._lag: dict[tuple[str, str, int], int] = {}
        self._assigned: dict[str, set[TP]] = {}
        self._failed_at: dict[tuple[str, str, int], int] = {}  # first failed record since the assignment
        self._clients: dict[str, str] = {}
        self._sinks: list[LagSink] = []
        self._user_cb: Callable[[str], None] | None = None
        self._interval_ms: int | None = None
        self._installed = False
        app.events.subscribe(PartitionsAssigned, self._on_assigned)
        app.events.subscribe(PartitionsRevoked, self._on_revoked)
        app.events.subscribe(ContainerStopped, self._on_stopped)
        app.events.subscribe(HandlerFailed, self._on_failed)

    # -- wiring --------------------------------------------------------------
    def install(self, interval_ms: int) -> None:
        """Ask librdkafka for statistics through ``app.consumer_config_overrides``.

        A ``statistics.interval.ms`` the user set is kept; a ``stats_cb`` the
        user set still receives every statistics JSON. Only consumers created
        after this call report lag, hence the warning for a running App.
        """
        if not is_int(interval_ms, 1):
            raise InvalidConfigurationError(f"stats_interval_ms must be an integer >= 1, got {interval_ms!r}")
        app = self._app_ref()
        if app is None:
            return
        overrides = app.consumer_config_overrides
        with self._lock:
            if not self._installed:
                existing = overrides.get("stats_cb")
                if existing is not None and existing is not self._on_stats:
                    self._user_cb = existing
                overrides["stats_cb"] = self._on_stats
                self._installed = True
                if "statistics.interval.ms" not in overrides:
                    self._interval_ms = interval_ms
                    overrides["statistics.interval.ms"] = interval_ms
            elif self._interval_ms is not None and interval_ms < self._interval_ms:
                # A second user (the status line wants ~1 s) may ask for fresher data.
                self._interval_ms = interval_ms
                overrides["statistics.interval.ms"] = interval_ms
        if any(c.alive for c in app.containers):
            log.warning(
                "App %s is already running: consumer lag is reported for consumers created from now on "
                "(instrument the App before start() to get it at once)",
                app.name,
            )

    def add_sink(self, sink: LagSink) -> None:
        """``sink(listener, topic, partition, lag)`` on each update; ``lag=None`` drops the series."""
        with self._lock:
            self._sinks.append(sink)

    def total(self) -> int | None:
        """Sum of all partitions' lag, or None before the first statistics arrived."""
        with self._lock:
            return sum(self._lag.values()) if self._lag else None

    def snapshot(self) -> dict[tuple[str, str, int], int]:
        with self._lock:
            return dict(self._lag)

    # -- events -----------------------------------------------------------------
    def _on_assigned(self, event: PartitionsAssigned) -> None:
        with self._lock:
            self._assigned.setdefault(listener_label(event.listener, event.worker), set()).update(event.partitions)

    def _on_failed(self, event: HandlerFailed) -> None:
        record = event.record
        if record is not None:
            with self._lock:
                key = (listener_label(event.listener, event.worker), record.topic, record.partition)
                self._failed_at.setdefault(key, record.offset)

    def _on_revoked(self, event: PartitionsRevoked) -> None:
        self._drop(listener_label(event.listener, event.worker), event.partitions)

    def _on_stopped(self, event: ContainerStopped) -> None:
        listener = listener_label(event.listener, event.worker)
        with self._lock:
            tps = tuple(self._assigned.get(listener, ()))
        self._drop(listener, tps)

    def _drop(self, listener: str, tps: tuple[TP, ...]) -> None:
        dropped = []
        with self._lock:
            assigned = self._assigned.get(listener, set())
            for tp in tps:
                assigned.discard(tp)
                self._failed_at.pop((listener, *tp), None)
                if self._lag.pop((listener, *tp), None) is not None:
                    dropped.append(tp)
            sinks = tuple(self._sinks)
        for topic, partition in dropped:
            for sink in sinks:
                sink(listener, topic, partition, None)

    # -- statistics (runs inside consumer.consume() on a container thread) -----------
    def _on_stats(self, stats_json: str) -> None:
        # An exception here would propagate out of consume() and stop the container.
        if self._user_cb is not None:
            try:
                self._user_cb(stats_json)
            except Exception:
                log.exception("the App's own stats_cb failed")
        try:
            self._update(json.loads(stats_json))
        except Exception:
            log.debug("could not read consumer lag from librdkafka statistics", exc_info=True)

    def _update(self, stats: dict[str, Any]) -> None:
        if stats.get("type") != "consumer":
            return
        listener = self._listener_for(str(stats.get("client_id", "")))
        updates: list[tuple[str, int, int]] = []
        with self._lock:
            assigned = self._assigned.get(listener, set())
            for topic, tstats in (stats.get("topics") or {}).items():
                for pid, p in (tstats.get("partitions") or {}).items():
                    partition = int(pid)
                    if partition < 0 or (topic, partition) not in assigned:
                        continue  # -1 is librdkafka's internal "unassigned" partition
                    lag = _partition_lag(p, functools.partial(self._known_position, listener, (topic, partition)))
                    if lag is not None:
                        self._lag[(listener, topic, partition)] = lag
                        updates.append((topic, partition, lag))
            sinks = tuple(self._sinks)
        for topic, partition, lag in updates:
            for sink in sinks:
                sink(listener, topic, partition, lag)

    def _known_position(self, listener: str, tp: TP) -> int | None:
        """kafkatx's own position of ``tp`` when librdkafka's is unknown: its committed offset, else a waiting
        failed record's (see the class docstring). Called with the lock held."""
        app = self._app_ref()
        containers: list[_Container] = list(app.containers) if app is not None else []
        for container in containers:
            if tp in container.assigned and listener_label(container.name, container.worker) == listener:
                committed = container.committed_offset(tp)
                if committed is not None:
                    return committed
        return self._failed_at.get((listener, *tp))

    def _listener_for(self, client_id: str) -> str:
        """Which listener a consumer's statistics belong to, from its client.id.

        kafkatx's default client.id is ``<app>-<listener>-<worker>``; with a
        custom client.id shared by several listeners, the client.id itself is
        used as the listener label.
        """
        name = self._clients.get(client_id)
        if name is None:
            app = self._app_ref()
            if app is None:
                return client_id
            owners: dict[str, set[str]] = {}
            for spec in app.listeners:
                group = spec.group_id or app.group_id
                for worker in range(spec.concurrency):
                    try:
                        cid = str(app.consumer_config(spec, group, worker).get("client.id"))
                    except Exception:
                        continue
                    owners.setdefault(cid, set()).add(spec.name)
            name = next(iter(owners[client_id])) if len(owners.get(client_id, ())) == 1 else client_id
            self._clients[client_id] = name
        return name


def _partition_lag(p: dict[str, Any], known_position: Callable[[], int | None] = lambda: None) -> int | None:
    """Lag of one partition's statistics, or None if neither librdkafka nor kafkatx knows it yet."""
    if p.get("fetch_state") not in _LIVE_STATES:
        return None
    end = p.get("ls_offset", _INVALID)
    if not isinstance(end, int) or end < 0:
        end = p.get("hi_offset", _INVALID)
    position = p.get("app_offset", _INVALID)
    if not isinstance(position, int) or position < 0:
        position = known_position()  # forgotten by a seek (see LagTracker)
    if not isinstance(position, int) or position < 0:
        position = p.get("committed_offset", _INVALID)  # nothing consumed yet since assignment
    if not isinstance(end, int) or not isinstance(position, int) or end < 0 or position < 0:
        return None
    return max(0, end - position)


_TRACKERS: weakref.WeakKeyDictionary[InstrumentedApp, LagTracker] = weakref.WeakKeyDictionary()
_TRACKERS_LOCK = threading.Lock()


def shared_lag_tracker(app: InstrumentedApp, interval_ms: int = DEFAULT_STATS_INTERVAL_MS) -> LagTracker:
    """The App's lag tracker, created and installed once (shared by metrics and the status line)."""
    with _TRACKERS_LOCK:
        tracker = _TRACKERS.get(app)
        if tracker is None:
            tracker = _TRACKERS[app] = LagTracker(app)
    tracker.install(interval_ms)
    return tracker
