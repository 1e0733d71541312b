"""The App: listeners declared with a decorator, run inside Kafka transactions.

An App owns the client configuration, the process identity used in
transactional.ids, the event bus, and the containers (one thread each) that
run its listeners.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, Unpack

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from kafkatx._client_log import client_log
from kafkatx.context import bind_sink
from kafkatx.database._backend import Backend, backend_for
from kafkatx.database.session import bind_db
from kafkatx.errors import (
    ClusterUnreachableError,
    ContainerError,
    InvalidConfigurationError,
    KafkaClientError,
    KafkaTxError,
)
from kafkatx.events import Event, EventBus
from kafkatx.listener.container import ListenerContainer
from kafkatx.listener.options import (
    LISTENER_DEFAULTS,
    ListenerOptions,
    SparkListenerOptions,
    signature_with_options,
)
from kafkatx.listener.spec import ListenerSpec, build_spec
from kafkatx.local import is_embedded_broker, warn_about_chained_listeners
from kafkatx.outputs import PendingOutput, encode, encode_headers
from kafkatx.producer import TransactionalProducer

__all__ = ["App", "Transaction"]

log = logging.getLogger("kafkatx.app")

F = TypeVar("F", bound=Callable[..., Any])
E = TypeVar("E", bound=Event)

ENV_BOOTSTRAP = "KAFKATX_BOOTSTRAP_SERVERS"
ENV_INSTANCE = "KAFKATX_INSTANCE_ID"

# Settings kafkatx owns: overriding them would silently break exactly-once.
_FORBIDDEN_CONSUMER = {
    "enable.auto.commit": "true would commit offsets outside the transaction",
    "isolation.level": "read_uncommitted would let handlers see aborted records",
}
_FORBIDDEN_PRODUCER = {
    "transactional.id": "kafkatx derives it from the app name, group and instance id (see fencing=)",
    "enable.idempotence": "transactions require idempotence",
}

#: Default transaction.timeout.ms. Shorter means an instance that crashed
#: without a stable instance id blocks its partitions for less time; longer
#: tolerates slower batches (Spark jobs, in-place retries). 30 s is 10x a
#: slow batch and half of librdkafka's 60 s default.
DEFAULT_TRANSACTION_TIMEOUT_MS = 30_000


class App:
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
    do not move keep flowing during a rebalance).
    """

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
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise InvalidConfigurationError(f"App name must be a non-empty string, got {name!r}")
        if isinstance(transaction_timeout_ms, bool) or not isinstance(transaction_timeout_ms, int) or transaction_timeout_ms < 1000:
            raise InvalidConfigurationError(f"transaction_timeout_ms must be an integer >= 1000, got {transaction_timeout_ms!r}")
        self.name = name
        self.bootstrap_servers = bootstrap_servers
        self.group_id = group_id or name
        self.transactional_id_prefix = transactional_id_prefix or name
        self._instance_id = instance_id
        self._random_id = False  # True once a random instance id was made up (no static membership then)
        self.config = dict(config or {})
        self.consumer_config_overrides = dict(consumer_config or {})
        self.producer_config_overrides = dict(producer_config or {})
        self.transaction_timeout_ms = transaction_timeout_ms
        self.create_topics = create_topics
        self.topic_partitions = topic_partitions
        self.shutdown_timeout = shutdown_timeout
        self.max_producer_recreations = max_producer_recreations
        if rebalance not in ("eager", "cooperative"):
            raise InvalidConfigurationError(f"rebalance must be 'eager' or 'cooperative', got {rebalance!r}")
        self.static_membership = static_membership
        self.rebalance = rebalance
        self.cluster_id: str | None = None
        self.events = EventBus()
        self.listeners: list[ListenerSpec] = []
        self.containers: list[ListenerContainer] = []
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._exited: set[int] = set()  # ids of the containers that finished their exit path
        self._running = False
        self._tx_local = threading.local()
        self._backends: dict[object, Backend] = {}  # app.transaction(database=...): one per database given
        self._tx_counter = 0
        self._shutdown_hooks: list[Callable[[], None]] = []
        for key in _FORBIDDEN_PRODUCER:
            if key in self.config or key in self.producer_config_overrides:
                raise InvalidConfigurationError(f"do not set {key!r}: {_FORBIDDEN_PRODUCER[key]}")
        self._check_consumer_overrides({**self.config, **self.consumer_config_overrides})

    # -- declaring listeners ------------------------------------------------------
    def listener(self, *topics: str, **options: Unpack[ListenerOptions]) -> Callable[[F], F]:
        """Declare a handler for ``topics``; see the README for the options.

        ``@app.listener("orders", output="orders-enriched", max_attempts=3, dlq=True)``

        The options are checked now: an unknown or invalid one raises
        :class:`~kafkatx.InvalidConfigurationError` naming it.
        """
        if len(topics) == 1 and callable(topics[0]) and not isinstance(topics[0], str):
            raise InvalidConfigurationError("use @app.listener('topic', ...) with at least one topic name")

        def decorator(handler: F) -> F:
            self.add_listener(handler, *topics, **options)
            return handler

        return decorator

    def add_listener(self, handler: Callable[..., Any], *topics: str, **options: Unpack[ListenerOptions]) -> ListenerSpec:
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
            self._check_consumer_overrides(spec.consumer_config)
            self.listeners.append(spec)
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

    # -- identity and client configuration (the containers' runtime) ---------------
    @property
    def instance_id(self) -> str:
        """This process's stable identity (made up at random, with a warning, when none was given)."""
        if self._instance_id is None:
            env = os.environ.get(ENV_INSTANCE)
            if env:
                self._instance_id = env
            else:
                self._random_id = True
                self._instance_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return self._instance_id

    @instance_id.setter
    def instance_id(self, value: str) -> None:
        self._instance_id = value
        self._random_id = False

    def _warn_without_instance_id(self) -> None:
        if self._random_id:
            log.warning(
                "no instance id (App(instance_id=...), --instance-id or $%s): using %s. After a crash, "
                "the transaction this process left open blocks its partitions until transaction.timeout.ms "
                "(%d ms) expires; a stable id lets the restarted process abort it at once.",
                ENV_INSTANCE, self._instance_id, self.transaction_timeout_ms,
            )  # fmt: skip

    def resolved_bootstrap_servers(self) -> str:
        """The bootstrap servers: the App's, its config's, or $KAFKATX_BOOTSTRAP_SERVERS; a clear error if none."""
        servers = self.bootstrap_servers or self.config.get("bootstrap.servers") or os.environ.get(ENV_BOOTSTRAP)
        if not servers:
            raise InvalidConfigurationError(
                f"App {self.name!r} has no Kafka bootstrap servers: pass App(..., bootstrap_servers='host:9092'), "
                f"set ${ENV_BOOTSTRAP}, or use `kafkatx run --local` for an embedded broker"
            )
        return str(servers)

    @property
    def transaction_retry_timeout(self) -> float:
        """Seconds a transactional call is retried before the transaction is given up: half the transaction timeout."""
        return self.transaction_timeout_ms / 2000.0

    def _base_config(self) -> dict[str, Any]:
        # librdkafka's log lines go through logging (kafkatx.librdkafka), not raw to stderr.
        return {"logger": client_log(), **self.config, "bootstrap.servers": self.resolved_bootstrap_servers()}

    def consumer_config(self, spec: ListenerSpec, group_id: str, worker: int) -> dict[str, Any]:
        """The librdkafka configuration of a container's consumer (read_committed, no auto commit, static id)."""
        cfg = {
            "auto.offset.reset": "earliest",
            **self._base_config(),
            **self.consumer_config_overrides,
            **spec.consumer_config,
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
        }
        cfg.setdefault("client.id", f"{self.name}-{self.instance_id}-{spec.name}-{worker}")
        if self.static_membership and not self._random_id:
            # KIP-345: the consumer keeps its membership across a restart under the same instance id.
            cfg.setdefault("group.instance.id", f"{self.instance_id}-{spec.name}-{worker}")
        if self.rebalance == "cooperative":
            cfg.setdefault("partition.assignment.strategy", "cooperative-sticky")
        return cfg

    def producer_config(self, spec: ListenerSpec | None, transactional_id: str) -> dict[str, Any]:
        """The librdkafka configuration of a transactional producer (idempotent, the App's transaction timeout)."""
        cfg = {
            "linger.ms": 5,
            "allow.auto.create.topics": False,
            **self._base_config(),
            **self.producer_config_overrides,
            **(spec.producer_config if spec is not None else {}),
            "transaction.timeout.ms": self.transaction_timeout_ms,
            "enable.idempotence": True,
        }
        cfg.setdefault("client.id", transactional_id)
        mto = cfg.get("message.timeout.ms")
        if mto is not None and int(mto) > self.transaction_timeout_ms:
            raise InvalidConfigurationError(
                f"message.timeout.ms ({mto}) must not exceed transaction_timeout_ms ({self.transaction_timeout_ms})"
            )
        return cfg

    def group_transactional_id(self, group_id: str, index: int) -> str:
        """KIP-447 mode: stable per process and container, so a restart fences its predecessor."""
        return f"{self.transactional_id_prefix}-{group_id}-{self.instance_id}-{index}"

    def partition_transactional_id(self, group_id: str, topic: str, partition: int) -> str:
        """KIP-98 mode: one id per input partition, the same in every process."""
        return f"{self.transactional_id_prefix}-{group_id}.{topic}.{partition}"

    def _check_consumer_overrides(self, cfg: Mapping[str, Any]) -> None:
        if str(cfg.get("enable.auto.commit", "false")).lower() == "true":
            raise InvalidConfigurationError(f"enable.auto.commit=true is not allowed: {_FORBIDDEN_CONSUMER['enable.auto.commit']}")
        if str(cfg.get("isolation.level", "read_committed")) != "read_committed":
            raise InvalidConfigurationError(f"isolation.level must be read_committed: {_FORBIDDEN_CONSUMER['isolation.level']}")

    # -- startup checks ---------------------------------------------------------
    def _admin(self) -> AdminClient:
        return AdminClient({**self._base_config(), "log_level": 3})

    def _check_client_config(self) -> None:
        """Create (and drop) each client once, so that a misspelt librdkafka property is a configuration
        error naming it now, not a container dying at start."""
        checks: list[tuple[str, Callable[[], Any]]] = [("App config", self._admin)]
        for spec in self.listeners:
            consumer_cfg = self.consumer_config(spec, spec.group_id or self.group_id, 0)
            producer_cfg = self.producer_config(spec, f"{self.transactional_id_prefix}-check")
            checks.append((f"consumer config of listener {spec.name!r}", functools.partial(_try_consumer, consumer_cfg)))
            checks.append((f"producer config of listener {spec.name!r}", functools.partial(Producer, producer_cfg)))
        for what, create in checks:
            try:
                create()
            except (KafkaException, ValueError, TypeError) as exc:
                raise InvalidConfigurationError(f"{what}: {_client_error_text(exc)}") from None

    def _prepare_topics(self) -> None:
        """Fail fast, before any consumer starts, on missing topics (or create them if allowed)."""
        admin = self._admin()
        try:
            meta = admin.list_topics(timeout=15)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT,
                                                                  KafkaError._ALL_BROKERS_DOWN):  # fmt: skip
                raise ClusterUnreachableError(
                    f"cannot reach Kafka at {self.resolved_bootstrap_servers()} (no answer within 15 s): is the "
                    "broker running, and is that its address? Set bootstrap_servers or $KAFKATX_BOOTSTRAP_SERVERS, "
                    "or use `kafkatx run --local` for an embedded broker",
                    error=error, operation="list_topics (startup)",
                ) from None  # fmt: skip
            raise KafkaTxError.from_kafka(exc, operation="list_topics (startup)") from exc
        setup = _SetupContext(self, admin, meta)
        for spec in self.listeners:
            for topic in spec.topics:
                setup.require(topic, f"input topic of listener {spec.name!r}")
            if spec.output:
                setup.require(spec.output, f"output topic of listener {spec.name!r}")
            for topic in spec.sends_to:
                setup.require(topic, f"topic listener {spec.name!r} sends to")
            setup.input_topics = spec.topics
            spec.recoverer.setup(setup)
        self.cluster_id = meta.cluster_id
        self._resolve_fencing()

    def _resolve_fencing(self) -> None:
        """``fencing="auto"``: KIP-447 group fencing, except on a broker known to lack KIP-447.

        The embedded broker accepts offsets sent with a stale group generation,
        so with group fencing a worker that comes back under a new instance id
        can commit records its successor has already committed (measured:
        thousands of duplicates). Per-partition transactional.ids fence by
        themselves (KIP-98), which it does honour.
        """
        embedded = is_embedded_broker(self.resolved_bootstrap_servers(), self.cluster_id)
        for spec in self.listeners:
            if spec.fencing == "auto":
                spec.fencing = "partition" if embedded else "group"
                if embedded:
                    log.info("listener %s: fencing='partition' (the embedded broker has no KIP-447)", spec.name)
            elif spec.fencing == "group" and embedded:
                log.warning(
                    "listener %s: fencing='group' on the embedded broker, which does not enforce KIP-447: a worker "
                    "that restarts under a new instance id can commit duplicates. Use fencing='partition' or "
                    "'auto' (the default), or stable instance ids.", spec.name,
                )  # fmt: skip

    # -- running --------------------------------------------------------------
    def start(self) -> None:
        """Start all listener containers in background threads and return."""
        with self._lock:
            if self._running:
                raise RuntimeError(f"App {self.name!r} is already running")
            if not self.listeners:
                raise InvalidConfigurationError(f"App {self.name!r} has no listeners: declare one with @app.listener(...)")
            warn_about_chained_listeners(self.listeners, self.resolved_bootstrap_servers())
            _ = self.instance_id
            self._check_client_config()
            self._prepare_topics()
            self._warn_without_instance_id()
            self._stopped.clear()
            self._exited = set()
            self.containers = []
            index = 0
            for spec in self.listeners:
                for worker in range(spec.concurrency):
                    self.containers.append(ListenerContainer(spec, self, worker, index))
                    index += 1
            self._running = True
            for c in self.containers:
                c.start()
        log.info("app %s started %d container(s), instance %s", self.name, len(self.containers), self.instance_id)

    def container_exited(self, container: ListenerContainer) -> None:
        """Called by a container thread as it ends; a failure stops the whole App."""
        if container.failure is not None and not self._stopped.is_set():
            log.error("stopping app %s because listener %s failed", self.name, container.name)
            self.stop(wait=False)
        # Counted, not read from thread liveness: two containers exiting together would each see the
        # other still alive, and nobody would say that all had stopped.
        with self._lock:
            self._exited.add(id(container))
            if len(self._exited) >= len(self.containers):
                self._stopped.set()

    def stop(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stop all containers. Thread-safe. Each finishes (or aborts) its open
        transaction and closes its clients; nothing half-done is committed."""
        for c in list(self.containers):
            c.stop()
        if wait and threading.current_thread() not in {getattr(c, "_thread", None) for c in self.containers}:
            deadline = time.monotonic() + (self.shutdown_timeout if timeout is None else timeout)
            for c in list(self.containers):
                if not c.join(max(0.0, deadline - time.monotonic())):
                    log.warning("listener %s did not stop within the shutdown timeout%s", c.name,
                                f": blocked in {c.blocked_in()}" if c.blocked_in() else "")  # fmt: skip
        with self._lock:
            if all(not c.alive for c in self.containers):
                self._running = False
                self._stopped.set()
                if wait:
                    self._run_shutdown_hooks()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every container has stopped; True if they have."""
        return self._stopped.wait(timeout)

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped a container, if one did."""
        return next((c.failure for c in self.containers if c.failure is not None), None)

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Start and block until :meth:`stop`, SIGINT or SIGTERM (a second signal forces the exit).

        Raises the error that stopped a container, if one did.
        """
        handlers_installed = install_signal_handlers and threading.current_thread() is threading.main_thread()
        previous: dict[int, Any] = {}
        signals_seen = 0

        def on_signal(signum: int, _frame: Any) -> None:
            nonlocal signals_seen
            signals_seen += 1
            if signals_seen == 1:
                log.info("%s received: stopping gracefully (send it again to force exit)", signal.Signals(signum).name)
                for c in self.containers:
                    c.stop()
            else:
                log.warning("second signal: forcing exit")
                raise SystemExit(128 + signum)

        if handlers_installed:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            self.start()
            stopping_since: float | None = None
            while not self._stopped.wait(0.2):
                if stopping_since is None and any(c.stop_event.is_set() for c in self.containers):
                    stopping_since = time.monotonic()
                if stopping_since is not None and time.monotonic() - stopping_since > self.shutdown_timeout:
                    raise ContainerError(self._not_stopped_message())
            self.stop()
        finally:
            if handlers_installed:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
            self._running = any(c.alive for c in self.containers)
        failure = self.failure
        if failure is not None:
            raise failure

    def _not_stopped_message(self) -> str:
        stuck = [f"listener {c.name} is blocked in {c.blocked_in() or 'an unknown call'}" for c in self.containers if c.alive]
        return (
            f"app {self.name} did not stop within shutdown_timeout={self.shutdown_timeout:g}s: {'; '.join(stuck)}. "
            "Its open transactions are aborted when it restarts with the same instance id; nothing is lost."
        )

    # -- producer-initiated transactions --------------------------------------------
    @contextmanager
    def transaction(self, *, database: Any = None) -> Iterator[Transaction]:
        """``with app.transaction() as tx: tx.send(...)``: commit on exit, abort on error.

        The exception is re-raised after the abort; kafkatx does not retry a
        producer-initiated transaction (the caller decides). ``kafkatx.send()``
        inside the block joins it too.

        With ``database=`` (as on a listener) a database transaction joins it:
        ``kafkatx.db()`` inside the block; the database commits first, then
        Kafka, and an exception rolls back both. There is no consumed input to
        replay here, so a crash between the two commits leaves the database
        work without its Kafka records (docs/DATABASE.md): for exactly-once
        output from database changes, write them from a listener.
        """
        producer = self._thread_producer()
        backend = self._database_backend(database) if database is not None else None
        conn = backend.connect() if backend is not None else None
        previous_db = None
        if backend is not None:
            backend.begin(conn)
            previous_db = bind_db(backend.user_handle(conn))
        try:
            producer.begin()
        except BaseException:
            if backend is not None:
                bind_db(previous_db)
                backend.rollback(conn)
                backend.close(conn)
            raise
        tx = Transaction(producer)
        previous = bind_sink(tx)
        try:
            yield tx
            if backend is not None:
                backend.commit(conn)
        except BaseException:
            try:
                producer.abort()
            except KafkaClientError:
                producer.discard()
                log.warning("abort failed; the producer was replaced", exc_info=True)
            if backend is not None:
                try:
                    backend.rollback(conn)
                except Exception:
                    log.debug("database rollback failed", exc_info=True)
            raise
        finally:
            bind_sink(previous)
            if backend is not None:
                bind_db(previous_db)
                backend.close(conn)
        try:
            producer.commit()
        except KafkaClientError as exc:
            try:
                producer.abort()
            except KafkaClientError:
                producer.discard()
            if backend is not None:
                log.error("the database transaction committed but the Kafka transaction did not: %s", exc)
            raise

    def _database_backend(self, database: Any) -> Backend:
        with self._lock:
            key = database if isinstance(database, str) else id(database)
            backend = self._backends.get(key)
            if backend is None:
                backend = self._backends[key] = backend_for(database)
            return backend

    def _thread_producer(self) -> TransactionalProducer:
        producer: TransactionalProducer | None = getattr(self._tx_local, "producer", None)
        if producer is None:
            with self._lock:
                self._tx_counter += 1
                n = self._tx_counter
            txn_id = f"{self.transactional_id_prefix}-{self.instance_id}-producer-{n}"
            producer = TransactionalProducer(self.producer_config(None, txn_id), txn_id, retry_timeout=self.transaction_retry_timeout)
            self._tx_local.producer = producer
        return producer


class Transaction:
    """A producer-initiated transaction (see :meth:`App.transaction`)."""

    serializer = None

    def __init__(self, producer: TransactionalProducer) -> None:
        self._producer = producer
        self.sent = 0

    def add(self, output: PendingOutput) -> None:
        """Produce an already encoded record in the transaction (what ``kafkatx.send()`` calls)."""
        self._producer.produce(output)
        self.sent += 1

    def send(self, topic: str, value: Any, key: Any = None, headers: Any = None, partition: int | None = None) -> None:
        """Produce a record in the transaction: ``value``/``key`` as bytes or str, ``headers`` a mapping or pairs."""
        self.add(PendingOutput(topic, encode(value, "value"), encode(key, "key"), encode_headers(headers), partition))


def _try_consumer(config: dict[str, Any]) -> None:
    Consumer(config).close()


def _client_error_text(exc: BaseException) -> str:
    """confluent-kafka's reason, without the KafkaError{...} wrapping: e.g. "No such configuration property: "lingr.ms""."""
    error = exc.args[0] if exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)


class _SetupContext:
    """What recoverers see at startup: topic metadata and topic creation."""

    def __init__(self, app: App, admin: AdminClient, meta: Any) -> None:
        self._app, self._admin, self._meta = app, admin, meta
        self.input_topics: tuple[str, ...] = ()

    def partitions(self, topic: str) -> int | None:
        t = self._meta.topics.get(topic)
        if t is None or t.error is not None:
            return None
        return len(t.partitions)

    def require(self, topic: str, what: str) -> None:
        if self.partitions(topic) is not None:
            return
        if not self._app.create_topics:
            raise InvalidConfigurationError(
                f"{what}: topic {topic!r} does not exist. Create it, or pass App(create_topics=True) "
                "to let kafkatx create missing topics"
            )
        self.create_topic(topic, self._app.topic_partitions, why=what)

    def create_topic(self, topic: str, partitions: int, *, why: str) -> None:
        fut = self._admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=-1)])[topic]
        try:
            fut.result(15)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() != 36:  # TOPIC_ALREADY_EXISTS: someone else won the race
                raise InvalidConfigurationError(
                    f"could not create {why} {topic!r} ({partitions} partitions): {err.str()}. Create it yourself "
                    "or grant CREATE on the cluster/topic", error=err, operation="create_topics",
                ) from exc  # fmt: skip
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            self._meta = self._admin.list_topics(timeout=5)
            if self.partitions(topic) == partitions:
                break
            time.sleep(0.05)
        log.info("created %s %r with %d partition(s)", why, topic, partitions)


# help(App.listener) and editors that read signatures show every option with its default.
App.listener.__signature__ = signature_with_options(App.listener, ListenerOptions, LISTENER_DEFAULTS)  # type: ignore[attr-defined]
App.add_listener.__signature__ = signature_with_options(App.add_listener, ListenerOptions, LISTENER_DEFAULTS)  # type: ignore[attr-defined]
App.spark_listener.__signature__ = signature_with_options(  # type: ignore[attr-defined]
    App.spark_listener, SparkListenerOptions, {**LISTENER_DEFAULTS, "max_batch_records": 50_000, "max_batch_ms": 2_000, "max_bisect_jobs": 128}
)
