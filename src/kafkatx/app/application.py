"""The App: listeners declared with a decorator, run inside Kafka transactions.

An App owns its client configuration (:class:`~kafkatx.app.config.ClientConfig`:
bootstrap servers, the process identity used in transactional.ids, librdkafka
settings), the event bus, and the containers (one thread each) that run its
listeners. The startup checks and ``app.transaction()`` are given the
configuration, not the App.
"""

from __future__ import annotations

import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack

from kafkatx.app.batch_listeners import BatchListeners
from kafkatx.app.config import DEFAULT_TRANSACTION_TIMEOUT_MS, ClientConfig, ClientSetting
from kafkatx.app.heap import StartupFreeze
from kafkatx.app.membership import StaleMemberWatch, leave_group_on_clean_stop, watch_for_stale_members
from kafkatx.app.signals import StopRequests
from kafkatx.app.startup import check_client_config, prepare_topics, resolve_fencing
from kafkatx.app.transactions import ProducerTransactions, Transaction
from kafkatx.client.brokers import is_embedded_broker, warn_about_chained_listeners
from kafkatx.errors import (
    ContainerError,
    InvalidConfigurationError,
)
from kafkatx.events import Event, EventBus
from kafkatx.health.checks import DEFAULT_NOT_READY_AFTER, check_health_options
from kafkatx.health.stable_offsets import StableOffsetWatch
from kafkatx.listener.failure.outage import ListenerOutage
from kafkatx.listener.loop.container import ListenerContainer
from kafkatx.listener.options import (
    LISTENER_DEFAULTS,
    ListenerOptions,
    SparkListenerOptions,
    check_option_names,
    signature_with_options,
)
from kafkatx.listener.spec import ListenerSpec, build_spec
from kafkatx.tracing import Tracing, check_tracing_option

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from kafkatx.health.server import HealthServer

__all__ = ["App", "Transaction"]

log = logging.getLogger("kafkatx.app")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
E = TypeVar("E", bound=Event)


class App(BatchListeners):
    """A kafkatx application.

    ``name`` is the default group.id and transactional.id prefix.
    ``bootstrap_servers`` falls back to ``$KAFKATX_BOOTSTRAP_SERVERS`` (resolved
    at start, so ``kafkatx run --local`` can supply it). ``instance_id``
    (or ``$KAFKATX_INSTANCE_ID``) is this process's stable identity: with it,
    a restarted instance fences its predecessor and aborts its open
    transaction at once, and (``static_membership=True``) its consumers keep
    their group membership across the restart (KIP-345), so they get their
    partitions back without a rebalance; without it a random id is used and
    crash recovery waits for ``transaction.timeout.ms``.
    ``rebalance="cooperative"`` uses incremental rebalancing (partitions that
    do not move keep flowing during a rebalance). ``gc_freeze`` (on by
    default) keeps Python's garbage collector off the objects the process
    started with while the App runs (:mod:`kafkatx.app.heap`).
    """

    def __new__(cls, *args: Any, **options: Any) -> App:
        # Python's TypeError for App(create_topic=True) names neither the closest option nor kafkatx's error
        # class; checked here, before __init__ is called (type checkers still see __init__'s signature).
        check_option_names(options, _APP_OPTIONS, "App()")
        return super().__new__(cls)

    def __init__(
        self,
        name: str,
        *,
        bootstrap_servers: str | None = None,
        group_id: str | None = None,
        transactional_id_prefix: str | None = None,
        instance_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS,
        create_topics: bool = False,
        topic_partitions: int = 1,
        shutdown_timeout: float = 30.0,
        max_producer_recreations: int = 5,
        static_membership: bool = True,
        rebalance: Literal["eager", "cooperative"] = "eager",
        health_port: int | None = None,
        health_addr: str = "127.0.0.1",
        not_ready_after: float = DEFAULT_NOT_READY_AFTER,
        tracing: bool | TracerProvider = False,
        gc_freeze: bool = True,
    ) -> None:
        self.client_config = ClientConfig(
            name,
            bootstrap_servers=bootstrap_servers,
            group_id=group_id,
            transactional_id_prefix=transactional_id_prefix,
            instance_id=instance_id,
            config=config,
            consumer_config=consumer_config,
            producer_config=producer_config,
            transaction_timeout_ms=transaction_timeout_ms,
            max_producer_recreations=max_producer_recreations,
            static_membership=static_membership,
            rebalance=rebalance,
        )
        self.create_topics = create_topics
        check_health_options(health_port, health_addr, not_ready_after)
        #: Serve /livez, /readyz (and /metrics) on this port from start() (0: a free one; None: not at all).
        self.health_port = health_port
        self.health_addr = health_addr
        #: Seconds a listener may be stuck on a batch, or paused, before /readyz says it is not ready.
        self.not_ready_after = not_ready_after
        check_tracing_option(tracing)
        #: OpenTelemetry tracing (docs/OBSERVABILITY.md): False, True (the global tracer provider) or a provider.
        self.tracing = tracing
        self._tracing: Tracing | None = None
        if not isinstance(gc_freeze, bool):
            raise InvalidConfigurationError(f"gc_freeze= takes True or False, got {gc_freeze!r}")
        #: Keep the garbage collector off the objects the process started with while the App runs (app/heap.py).
        self.gc_freeze = gc_freeze
        self._heap = StartupFreeze()
        #: The health endpoint start() opened (``health_port``), if any.
        self.health_server: HealthServer | None = None
        self.topic_partitions = topic_partitions
        self.shutdown_timeout = shutdown_timeout
        self.cluster_id: str | None = None
        #: False on the embedded broker, which answers an empty fetch at once (listener/loop/quiet_partitions.py).
        self.broker_holds_empty_fetches = True
        #: On the embedded broker: the check for static members left behind by killed processes.
        self._stale_members: StaleMemberWatch | None = None
        self.events = EventBus()
        #: While running: the check of the written topics' last stable offsets (health/stable_offsets.py).
        self.stable_offsets = StableOffsetWatch(self.events.publish)
        self.listeners: list[ListenerSpec] = []
        self.containers: list[ListenerContainer] = []
        #: Per listener name: its outage state, shared by its containers (and app.pause/resume).
        self._outages: dict[str, ListenerOutage] = {}
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._exited: set[int] = set()  # ids of the containers that finished their exit path
        self._running = False
        self._transactions = ProducerTransactions(self.client_config)
        self._shutdown_hooks: list[Callable[[], None]] = []

    # -- declaring listeners ------------------------------------------------------
    def listener(self, *topics: str, **options: Unpack[ListenerOptions]) -> Callable[[F], F]:
        """Declare a handler for ``topics``: ``@app.listener("orders", output="enriched", dlq=True)``.

        The handler (a function, or an ``async def``) takes a :class:`~kafkatx.Record` and returns None, bytes,
        str, a ``(key, value)`` tuple, an :class:`~kafkatx.Output`, or an
        iterable of those (other objects with ``serializer=``). Each poll's
        records are handled in one Kafka transaction with their offsets.

        Options (keyword-only; default in brackets):

        - ``output`` [None]: the topic a returned value goes to.
        - ``sends_to`` [()]: topics the handler sends to with ``send()``, checked (or created) at start.
        - ``name`` [the handler's qualified name]: the listener's name in logs, metrics and ids.
        - ``max_attempts`` [3]: deliveries of a failing record, the first included, before it is recovered.
        - ``backoff`` [1.0]: seconds (or a tenacity wait) between attempts; the partition is paused, not
          the consumer. 0 retries at once (Spring's default back-off).
        - ``dlq`` [False]: True for ``<topic>-dlt``, a topic name, a recoverer or a function; False logs and skips.
        - ``not_retryable`` [()]: exception types recovered at their first failure.
        - ``retryable`` [()]: exception types retried although not-retryable by default.
        - ``default_not_retryable`` [True]: keep the built-in not-retryable types (TypeError, decoding errors...).
        - ``max_recovery_failures`` [None]: failed recoveries of one record before the container stops (None: never).
        - ``recovery_backoff`` [None: 0.5 s doubling to 30 s]: wait between recovery attempts.
        - ``after_rollback`` [None]: a custom AfterRollbackProcessor instead of the default one.
        - ``retry`` ["rollback"]: "topics": a failed record waits in a retry topic (docs/RETRY_TOPICS.md).
        - ``count_crashes`` [True]: count a record that kills the process as a failed attempt.
        - ``outages`` [(ConnectionError,)]: exception types meaning a dependency is down: pause, count nothing.
        - ``max_outage`` [None]: seconds of outage before the App stops (None: wait as long as it takes).
        - ``database`` [None]: a SQLAlchemy engine (or URL) committed in the same unit of work.
        - ``serializer`` [None]: turns returned objects into bytes (e.g. ``lambda v: json.dumps(v).encode()``).
        - ``max_batch_records`` [5000]: records per poll, so per transaction at most.
        - ``max_batch_ms`` [100]: how long a poll waits for records.
        - ``max_transaction_ms`` [None: a third of the smaller of transaction_timeout_ms and
          max.poll.interval.ms]: handling time after which a transaction commits what it has.
        - ``fencing`` ["auto"]: "group" (KIP-447) or "partition" transactional ids; auto picks by broker.
        - ``concurrency`` [1]: containers (threads, each with its own consumer) for this listener.
        - ``in_flight`` [1]: records of a container handled at once (an ``async def`` handler is awaited,
          a plain one runs on a pool of that many threads); outputs still go out in input order.
        - ``ordering`` [None: "key"]: which records wait for each other when ``in_flight`` > 1: "key",
          "partition" or "none"; with ``retry="topics"``, "key" makes a record follow its key's record in retry
          and "none" lets it pass ("partition" is refused there).
        - ``overlap_commit`` [False]: handle the next batch while a transaction commits, holding its outputs
          (docs/OVERLAP.md); not with ``database=``, ``in_flight`` > 1 or async handlers.
        - ``group_id`` [the App's]: the consumer group.
        - ``consumer_config`` / ``producer_config`` [{}]: librdkafka properties for this listener's clients.
        - ``max_abortable_retries`` [5]: abortable errors in a row before the producer is recreated.
        - ``idle_event_interval`` [None]: seconds without records after which a ListenerIdle event is published.
        - ``value_type`` / ``key_type`` [None]: a pydantic model, dataclass or other type the value (key) is decoded
          to, from JSON unless a deserializer is given (docs/TYPED.md); undecodable records are dead-lettered at once.
        - ``deserializer`` / ``key_deserializer`` [None]: bytes -> object, e.g. confluent-kafka's AvroDeserializer.

        Every option is checked now: an unknown or invalid one raises
        :class:`~kafkatx.InvalidConfigurationError` naming it (and the
        closest name, for a misspelt one).
        """
        if len(topics) == 1 and callable(topics[0]) and not isinstance(topics[0], str):
            raise InvalidConfigurationError("use @app.listener('topic', ...) with at least one topic name")

        def decorator(handler: F) -> F:
            self.add_listener(handler, *topics, **options)
            return handler

        return decorator

    def add_listener(
        self, handler: Callable[..., Any], *topics: str, **options: Unpack[ListenerOptions]
    ) -> ListenerSpec:
        """The non-decorator form of :meth:`listener`."""
        return self.register(build_spec(handler, topics, options, where="listener"))

    def register(self, spec: ListenerSpec) -> ListenerSpec:
        """Add a validated listener declaration (what :meth:`listener` and ``spark_listener`` build)."""
        if spec.max_transaction_ms is not None and spec.max_transaction_ms >= self.transaction_timeout_ms:
            raise InvalidConfigurationError(
                f"max_transaction_ms ({spec.max_transaction_ms}) must be below the App's transaction_timeout_ms "
                f"({self.transaction_timeout_ms}): the broker aborts a transaction that stays open longer"
            )
        with self._lock:
            if self._running:
                raise InvalidConfigurationError("listeners must be declared before the App starts")
            if any(s.name == spec.name for s in self.listeners):
                raise InvalidConfigurationError(f"a listener named {spec.name!r} already exists; pass name=...")
            self.client_config.check_consumer_overrides(spec.consumer_config)
            self.listeners.append(spec)
            self._outages[spec.name] = ListenerOutage.for_listener(spec, self.events.publish)
        return spec

    def spark_listener(self, *topics: str, **options: Unpack[SparkListenerOptions]) -> Callable[[F], F]:
        """Declare a PySpark job as a handler: each batch becomes a DataFrame (needs the ``spark`` extra)."""
        try:
            from kafkatx.spark import spark_listener
        except ImportError as exc:
            raise InvalidConfigurationError(
                f"spark listeners need the 'spark' extra: pip install 'kafkatx[spark]' ({exc})"
            ) from exc
        return spark_listener(self, topics, options)

    def add_shutdown_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once all containers have stopped (e.g. to stop a SparkSession)."""
        self._shutdown_hooks.append(hook)

    def _run_shutdown_hooks(self) -> None:
        hooks, self._shutdown_hooks = self._shutdown_hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("shutdown hook %r failed", hook)

    def on(self, event_type: type[E]) -> Callable[[Callable[[E], None]], Callable[[E], None]]:
        """Subscribe a callback to an event type: ``@app.on(RecordRecovered)``."""

        def decorator(callback: Callable[[E], None]) -> Callable[[E], None]:
            self.events.subscribe(event_type, callback)
            return callback

        return decorator

    # -- identity and client configuration (the containers' runtime), kept in self.client_config --
    name = ClientSetting[str]()
    bootstrap_servers = ClientSetting[str | None]()
    group_id = ClientSetting[str]()
    transactional_id_prefix = ClientSetting[str]()
    instance_id = ClientSetting[str]()
    config = ClientSetting[dict[str, Any]]()
    consumer_config_overrides = ClientSetting[dict[str, Any]]()
    producer_config_overrides = ClientSetting[dict[str, Any]]()
    transaction_timeout_ms = ClientSetting[int]()
    max_producer_recreations = ClientSetting[int]()
    static_membership = ClientSetting[bool]()
    rebalance = ClientSetting[Literal["eager", "cooperative"]]()

    def resolved_bootstrap_servers(self) -> str:
        """The bootstrap servers: the App's, its config's, or $KAFKATX_BOOTSTRAP_SERVERS; a clear error if none."""
        return self.client_config.resolved_bootstrap_servers()

    @property
    def transaction_retry_timeout(self) -> float:
        """Seconds a transactional call is retried before the transaction is given up: half the transaction timeout."""
        return self.client_config.transaction_retry_timeout

    def consumer_config(self, spec: ListenerSpec, group_id: str, worker: int) -> dict[str, Any]:
        """The librdkafka configuration of a container's consumer (read_committed, no auto commit, static id)."""
        return self.client_config.consumer_config(spec, group_id, worker)

    def producer_config(self, spec: ListenerSpec | None, transactional_id: str) -> dict[str, Any]:
        """The librdkafka configuration of a transactional producer (idempotent, the App's transaction timeout)."""
        return self.client_config.producer_config(spec, transactional_id)

    def group_transactional_id(self, group_id: str, index: int) -> str:
        """KIP-447 mode: stable per process and container, so a restart fences its predecessor."""
        return self.client_config.group_transactional_id(group_id, index)

    def partition_transactional_id(self, group_id: str, topic: str, partition: int) -> str:
        """KIP-98 mode: one id per input partition, the same in every process."""
        return self.client_config.partition_transactional_id(group_id, topic, partition)

    # -- running --------------------------------------------------------------
    def start(self) -> None:
        """Start all listener containers in background threads and return."""
        with self._lock:
            if self._running:
                raise RuntimeError(f"App {self.name!r} is already running")
            if not self.listeners:
                raise InvalidConfigurationError(
                    f"App {self.name!r} has no listeners: declare one with @app.listener(...)"
                )
            warn_about_chained_listeners(self.listeners, self.resolved_bootstrap_servers())
            _ = self.instance_id
            check_client_config(self.client_config, self.listeners)
            tracing = self._app_tracing()  # the dead-letter publisher gets it as its recoverer is set up
            self.cluster_id = prepare_topics(
                self.client_config,
                self.listeners,
                create_topics=self.create_topics,
                topic_partitions=self.topic_partitions,
                dead_letter_trace=tracing.dead_letter_headers if tracing is not None else None,
            )
            resolve_fencing(self.client_config, self.listeners, self.cluster_id)
            self.broker_holds_empty_fetches = not is_embedded_broker(self.resolved_bootstrap_servers(), self.cluster_id)
            self.client_config.warn_without_instance_id()
            self._stopped.clear()
            self._exited = set()
            workers = [(spec, worker) for spec in self.listeners for worker in range(spec.concurrency)]
            for outage in self._outages.values():
                outage.reset()
            self.containers = [
                ListenerContainer(self._traced(spec, worker), self, worker, index, self._outages[spec.name])
                for index, (spec, worker) in enumerate(workers)
            ]
            if self.health_port is not None and self.health_server is None:
                from kafkatx.health.server import serve_health

                self.health_server = serve_health(self, self.health_port, self.health_addr)
            self._running = True
            if self.gc_freeze:
                self._heap.hold()
            for c in self.containers:
                c.start()
            self._stale_members = watch_for_stale_members(
                self.client_config.base_config(), self.resolved_bootstrap_servers(), self.cluster_id, self.containers
            )
            self.stable_offsets.start(self.client_config, self.listeners)
        log.info("app %s started %d container(s), instance %s", self.name, len(self.containers), self.instance_id)

    def _app_tracing(self) -> Tracing | None:
        """The App's tracing, made at its first start (from the provider of then); None with tracing off."""
        if self.tracing is False:
            return None
        if self._tracing is None:
            self._tracing = Tracing(None if self.tracing is True else self.tracing)
            self._tracing.subscribe(self.events.subscribe)
        return self._tracing

    def _traced(self, spec: ListenerSpec, worker: int) -> ListenerSpec:
        """``spec`` as the containers run it: with tracing on, a copy whose handler is traced (kafkatx.tracing)."""
        tracing = self._app_tracing()
        if tracing is None or (spec.kind == "batch" and not spec.records_handler):  # a Spark job is not traced
            return spec
        wrap = tracing.wrap_batch if spec.records_handler else tracing.wrap  # a batch listener: a span per call
        return replace(  # wrap() first: the others read what it registered
            spec,
            handler=wrap(spec, spec.group_id or self.client_config.group_id, worker),
            while_committing=tracing.defer_spans(spec, worker),
            untraced_roots=tracing.untraced_roots(spec, worker),
            hop_trace=tracing.hop_links,  # retry="topics": a hop carries its failed attempts' spans
        )

    def pause(self, listener: str) -> None:
        """Hold every partition of ``listener`` (by name) until :meth:`resume`. Thread-safe.

        The consumers keep polling, so the group sees no change; a
        transaction under way finishes first. An outage of a dependency
        does the same by itself (see the listener's ``outages`` option).
        """
        self._outage_of(listener).pause()

    def resume(self, listener: str) -> None:
        """End :meth:`pause` of ``listener``: it goes on from where it stopped. Thread-safe."""
        self._outage_of(listener).resume()

    def listener_outage(self, listener: str) -> ListenerOutage:
        """The outage state of ``listener`` (by name): whether it is held, and for how long (read by /readyz)."""
        return self._outage_of(listener)

    def _outage_of(self, listener: str) -> ListenerOutage:
        if not isinstance(listener, str):
            raise TypeError(f"name the listener to pause or resume by its name (a str), got {listener!r}")
        with self._lock:
            outage = self._outages.get(listener)
            if outage is None:
                names = ", ".join(repr(s.name) for s in self.listeners) or "none"
                raise InvalidConfigurationError(
                    f"app {self.name} has no listener named {listener!r} (listeners: {names})"
                )
        return outage

    def container_exited(self, container: ListenerContainer) -> None:
        """Called by a container thread as it ends; a failure stops the whole App."""
        if self.failure is None:  # (fenced by a live process with our instance id: its membership is not ours)
            leave_group_on_clean_stop(self.resolved_bootstrap_servers(), self.cluster_id, container)
        if container.failure is not None and not self._stopped.is_set():
            log.error("stopping app %s because listener %s failed", self.name, container.name)
            self.stop(wait=False)
        # Counted, not read from thread liveness: two containers exiting together would each see the
        # other still alive, and nobody would say that all had stopped.
        with self._lock:
            self._exited.add(id(container))
            if len(self._exited) >= len(self.containers):
                self._heap.release()  # here too: an App whose containers failed may never be stopped
                self._stopped.set()

    def stop(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stop all containers. Thread-safe. Each finishes (or aborts) its open
        transaction and closes its clients; nothing half-done is committed.
        The producers of :meth:`transaction` are closed too."""
        if self._stale_members is not None:
            self._stale_members.stop()
        for c in list(self.containers):
            c.stop()
        if wait and threading.current_thread() not in {c.thread for c in self.containers}:
            deadline = time.monotonic() + (self.shutdown_timeout if timeout is None else timeout)
            for c in list(self.containers):
                if not c.join(max(0.0, deadline - time.monotonic())):
                    log.warning(
                        "listener %s did not stop within the shutdown timeout%s",
                        c.name,
                        f": blocked in {c.blocked_in()}" if c.blocked_in() else "",
                    )
        self.stable_offsets.stop(wait=wait)  # after the containers: a check under way must not delay them
        self._transactions.close()  # app.transaction()'s producers
        with self._lock:
            if all(not c.alive for c in self.containers):
                self._running = False
                if self._tracing is not None:
                    self._tracing.flush()  # the spans of records whose transaction never ended
                self._heap.release()
                self._stopped.set()
                if wait:
                    self._run_shutdown_hooks()
                    self._stop_health_server()

    def _stop_health_server(self) -> None:
        server, self.health_server = self.health_server, None
        if server is not None:
            server.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every container has stopped and its thread has ended (but the caller's own); True if so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.current_thread()  # _stopped is set as each thread's last step: join the threads too
        return self._stopped.wait(timeout) and all(
            c.thread is me or c.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for c in list(self.containers)
        )

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped a container, if one did."""
        return next((c.failure for c in self.containers if c.failure is not None), None)

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Start and block until :meth:`stop`, SIGINT or SIGTERM (a second signal forces the exit).

        Signals within ``SAME_REQUEST_WINDOW_S`` of the first are the same request (kafkatx.app.signals).
        Raises the error that stopped a container, if one did.
        """
        handlers_installed = install_signal_handlers and threading.current_thread() is threading.main_thread()
        previous: dict[int, Any] = {}
        on_signal = self._stop_signal_handler(StopRequests())
        if handlers_installed:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            self.start()
            self._wait_until_stopped()
            self.stop()
        finally:
            if handlers_installed:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
            self._running = any(c.alive for c in self.containers)
        failure = self.failure
        if failure is not None:
            raise failure

    def _stop_signal_handler(self, requests: StopRequests) -> Callable[[int, Any], None]:
        """The SIGINT/SIGTERM handler of :meth:`run`: a first request stops every container, a second forces the
        exit; ``requests`` folds the copies of one signal (forwarded, or sent to the whole group) into one request."""

        def on_signal(signum: int, _frame: Any) -> None:
            request = requests.receive(signum)
            if request is None:
                log.debug("%s received again at once: the same stop request", signal.Signals(signum).name)
            elif request == 1:
                log.info("%s received: stopping gracefully (send it again to force exit)", signal.Signals(signum).name)
                for c in self.containers:
                    c.stop()
            else:
                log.warning("second signal: forcing exit")
                raise SystemExit(128 + signum)

        return on_signal

    def _wait_until_stopped(self) -> None:
        """Block until every container has stopped; a ContainerError naming the stuck listeners if they have not
        within ``shutdown_timeout`` of the first stop request (a stuck handler must not hang the process)."""
        stopping_since: float | None = None
        while not self._stopped.wait(0.2):
            if stopping_since is None and any(c.stop_event.is_set() for c in self.containers):
                stopping_since = time.monotonic()
            if stopping_since is not None and time.monotonic() - stopping_since > self.shutdown_timeout:
                raise ContainerError(self._not_stopped_message())

    def _not_stopped_message(self) -> str:
        stuck = [
            f"listener {c.name} is blocked in {c.blocked_in() or 'an unknown call'}" for c in self.containers if c.alive
        ]
        return (
            f"app {self.name} did not stop within shutdown_timeout={self.shutdown_timeout:g}s: {'; '.join(stuck)}. "
            "Its open transactions are aborted when it restarts with the same instance id; nothing is lost."
        )

    # -- producer-initiated transactions --------------------------------------------
    def transaction(self, *, database: Any = None) -> AbstractContextManager[Transaction]:
        """``with app.transaction() as tx: tx.send(...)``: commit on exit, abort on error.

        The exception is re-raised after the abort; kafkatx does not retry a
        producer-initiated transaction (the caller decides). ``kafkatx.send()``
        inside the block joins it too.

        With ``database=`` (as on a listener) a database transaction joins it:
        ``kafkatx.db()`` inside the block; the database commits first, with
        the records produced, then Kafka; an exception rolls back both. A
        crash between the two commits is finished by the next
        ``app.transaction(database=...)`` of the same instance id (and
        thread order), which produces the stored records first
        (docs/DATABASE.md).

        Each thread gets a transactional producer of its own, kept for its
        next transactions; :meth:`stop` closes them (one in a transaction
        when it ends), and a later transaction opens its thread's again.
        """
        return self._transactions.transaction(database=database)


# help(App.listener) and editors that read signatures show every option with its default.
App.listener.__signature__ = signature_with_options(App.listener, ListenerOptions, LISTENER_DEFAULTS)  # type: ignore[attr-defined]
App.add_listener.__signature__ = signature_with_options(App.add_listener, ListenerOptions, LISTENER_DEFAULTS)  # type: ignore[attr-defined]
App.spark_listener.__signature__ = signature_with_options(  # type: ignore[attr-defined]
    App.spark_listener,
    SparkListenerOptions,
    {**LISTENER_DEFAULTS, "max_batch_records": 50_000, "max_batch_ms": 2_000, "max_bisect_jobs": 128},
)


_init_parameters = list(inspect.signature(App.__init__).parameters.values())[1:]  # without self
#: Every keyword App() takes.
_APP_OPTIONS = tuple(p.name for p in _init_parameters)
# help(App), IDEs and inspect.signature(App) show __init__'s options, not __new__'s (*args, **options).
App.__signature__ = inspect.Signature(_init_parameters)  # type: ignore[attr-defined]
