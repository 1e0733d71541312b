"""What an App checks and prepares before its containers start: client settings, topics, fencing mode."""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from kafkatx._suggest import closest_topic
from kafkatx.client.brokers import is_embedded_broker
from kafkatx.client.topics import create_topic
from kafkatx.errors import (
    ClusterUnreachableError,
    InvalidConfigurationError,
    KafkaTxError,
)
from kafkatx.retry_topics.plan import RetryTopicPlan

if TYPE_CHECKING:
    from kafkatx.app.config import ClientConfig
    from kafkatx.dlq.publisher import DeadLetterTrace
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["check_client_config", "prepare_topics", "resolve_fencing"]


#: How long the startup check waits for the cluster's metadata before it says the cluster is unreachable. A
#: module attribute so that a test can shorten it (an address that refuses connections fails the same way sooner).
STARTUP_METADATA_TIMEOUT_S = 15.0

log = logging.getLogger("kafkatx.app")


def _admin(client: ClientConfig) -> AdminClient:
    return AdminClient({**client.base_config(), "log_level": 3})


def check_client_config(client: ClientConfig, listeners: Sequence[ListenerSpec]) -> None:
    """Create (and drop) each client once, so that a misspelt librdkafka property is a configuration
    error naming it now, not a container dying at start."""
    checks: list[tuple[str, Callable[[], Any]]] = [("App config", functools.partial(_admin, client))]
    for spec in listeners:
        consumer_cfg = client.consumer_config(spec, spec.group_id or client.group_id, 0)
        producer_cfg = client.producer_config(spec, f"{client.transactional_id_prefix}-check")
        checks.append((f"consumer config of listener {spec.name!r}", functools.partial(_try_consumer, consumer_cfg)))
        checks.append((f"producer config of listener {spec.name!r}", functools.partial(Producer, producer_cfg)))
    for what, create in checks:
        try:
            create()
        except (KafkaException, ValueError, TypeError) as exc:
            raise InvalidConfigurationError(f"{what}: {_client_error_text(exc)}") from None


def prepare_topics(
    client: ClientConfig,
    listeners: Sequence[ListenerSpec],
    *,
    create_topics: bool,
    topic_partitions: int,
    dead_letter_trace: DeadLetterTrace | None = None,
) -> str | None:
    """Fail fast, before any consumer starts, on missing topics (or create them if allowed); the cluster id.

    Each listener's recoverer is set up here, and given ``dead_letter_trace`` (the App's tracing, None when off).
    """
    check_resolvable(client.resolved_bootstrap_servers())
    admin = _admin(client)
    try:
        meta = admin.list_topics(timeout=STARTUP_METADATA_TIMEOUT_S)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if isinstance(error, KafkaError) and error.code() in (
            KafkaError._TRANSPORT,
            KafkaError._TIMED_OUT,
            KafkaError._ALL_BROKERS_DOWN,
        ):
            raise ClusterUnreachableError(
                f"cannot reach Kafka at {client.resolved_bootstrap_servers()} "
                f"(no answer within {STARTUP_METADATA_TIMEOUT_S:g} s): is the "
                "broker running, and is that its address? Set bootstrap_servers or $KAFKATX_BOOTSTRAP_SERVERS, "
                "or use `kafkatx run --local` for an embedded broker",
                error=error,
                operation="list_topics (startup)",
            ) from None
        raise KafkaTxError.from_kafka(exc, operation="list_topics (startup)") from exc
    setup = _SetupContext(admin, meta, create_topics=create_topics, topic_partitions=topic_partitions)
    setup.dead_letter_trace = dead_letter_trace  # the recoverers' port to the App's tracing
    for spec in listeners:
        for topic in spec.topics:
            setup.require(topic, f"input topic of listener {spec.name!r}")
        if spec.output:
            setup.require(spec.output, f"output topic of listener {spec.name!r}")
        for topic in spec.sends_to:
            setup.require(topic, f"send() target of listener {spec.name!r}")
        setup.input_topics = spec.topics
        spec.recoverer.setup(setup)
        if spec.retry == "topics":
            _retry_topics(setup, spec, create=getattr(spec.recoverer, "create_topics", create_topics))
    cluster_id: str | None = meta.cluster_id
    return cluster_id


def _retry_topics(setup: _SetupContext, spec: ListenerSpec, *, create: bool) -> None:
    """``retry="topics"``: each input topic's retry topics, created as the dead-letter topic is when its
    ``create_topics`` allows (the App's ``create_topics`` for a recoverer without one), else checked; as many
    partitions as the input topic (a hop keeps the record's partition)."""
    plan = RetryTopicPlan(spec.policy)
    for topic in spec.topics:
        partitions = setup.partitions(topic) or 1
        for retry in plan.topics(topic):
            have = setup.partitions(retry)
            what = f"retry topic {retry!r} of listener {spec.name!r} (input topic {topic!r}, {plan!r})"
            if have is None and create:
                setup.create_topic(retry, partitions, why=f"retry topic for {topic!r}")
            elif have is None:
                raise InvalidConfigurationError(
                    f"{what} does not exist{closest_topic(retry, setup.topic_names())} and create_topics is off: "
                    f"create it with {partitions} partition(s), as many as {topic!r} (a retry keeps the record's "
                    "partition), or let kafkatx create it (dlq=DeadLetterPublishingRecoverer(create_topics=True), "
                    "or App(create_topics=True) without a dead-letter topic)"
                )
            elif have < partitions:
                raise InvalidConfigurationError(
                    f"{what} has {have} partition(s) where {topic!r} has {partitions}: a retry keeps the record's "
                    f"partition, so it needs at least {partitions}"
                )


def check_resolvable(servers: str) -> None:
    """Raise ClusterUnreachableError at once when no bootstrap host name resolves.

    librdkafka would retry the lookup until list_topics timed out, and then
    say only that nothing answered within the startup wait.
    """
    hosts = [_host_of(server) for server in servers.split(",") if server.strip()]
    unresolved = []
    for host in hosts:
        try:
            socket.getaddrinfo(host, None)
        except socket.gaierror as exc:
            unresolved.append((host, str(exc.strerror)))
        except UnicodeError as exc:
            unresolved.append((host, str(exc)))
    if unresolved and len(unresolved) == len(hosts):
        host, reason = unresolved[0]
        raise ClusterUnreachableError(
            f"cannot resolve host {host!r} of the bootstrap servers {servers} ({reason}): is the name right, "
            "and is DNS reachable from here?",
            operation="resolve bootstrap servers",
        )
    for host, _ in unresolved:
        log.warning("bootstrap server host %r does not resolve; trying the others of %s", host, servers)


def _host_of(server: str) -> str:
    """The host of ``[PROTOCOL://]host:port`` (an IPv6 address may be in brackets)."""
    address = server.strip().rpartition("://")[2]
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def resolve_fencing(client: ClientConfig, listeners: Sequence[ListenerSpec], cluster_id: str | None) -> None:
    """``fencing="auto"``: KIP-447 group fencing, except on a broker known to lack KIP-447.

    The embedded broker accepts offsets sent with a stale group generation,
    so with group fencing a worker that comes back under a new instance id
    can commit records its successor has already committed (measured:
    thousands of duplicates). Per-partition transactional.ids fence by
    themselves (KIP-98), which it does honour.
    """
    embedded = is_embedded_broker(client.resolved_bootstrap_servers(), cluster_id)
    for spec in listeners:
        if spec.fencing == "auto":
            spec.fencing = "partition" if embedded else "group"
            if embedded:
                log.info("listener %s: fencing='partition' (the embedded broker has no KIP-447)", spec.name)
        elif spec.fencing == "group" and embedded:
            log.warning(
                "listener %s: fencing='group' on the embedded broker, which does not enforce KIP-447: a worker "
                "that restarts under a new instance id can commit duplicates. Use fencing='partition' or "
                "'auto' (the default), or stable instance ids.",
                spec.name,
            )


def _try_consumer(config: dict[str, Any]) -> None:
    Consumer(config).close()


def _client_error_text(exc: BaseException) -> str:
    """confluent-kafka's reason, without the KafkaError{...} wrapping: e.g. "No such configuration property: "lingr.ms""."""
    error = exc.args[0] if exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)


class _SetupContext:
    """What recoverers see at startup: topic metadata and topic creation, and the App's tracing."""

    def __init__(self, admin: AdminClient, meta: Any, *, create_topics: bool, topic_partitions: int) -> None:
        self._admin, self._meta = admin, meta
        self._create_topics, self._topic_partitions = create_topics, topic_partitions
        self.input_topics: tuple[str, ...] = ()
        #: A dead letter's trace headers (the App's tracing, None when off), for the dead-letter publisher.
        self.dead_letter_trace: DeadLetterTrace | None = None

    def topic_names(self) -> list[str]:
        """The cluster's topics (for a did-you-mean)."""
        return list(self._meta.topics)

    def partitions(self, topic: str) -> int | None:
        t = self._meta.topics.get(topic)
        if t is None or t.error is not None:
            return None
        return len(t.partitions)

    def require(self, topic: str, what: str) -> None:
        if self.partitions(topic) is not None:
            return
        hint = closest_topic(topic, self._meta.topics)  # a misspelt name is the likeliest reason
        if not self._create_topics:
            raise InvalidConfigurationError(
                f"{what}: topic {topic!r} does not exist{hint}. Create it, or pass App(create_topics=True) "
                "to let kafkatx create missing topics"
            )
        if hint:
            log.warning("%s: creating the missing topic %r%s", what, topic, hint)
        self.create_topic(topic, self._topic_partitions, why=what)

    def create_topic(self, topic: str, partitions: int, *, why: str) -> None:
        try:
            create_topic(self._admin, topic, partitions, exist_ok=True)  # exists: someone else won the race
        except KafkaException as exc:
            err = exc.args[0]
            raise InvalidConfigurationError(
                f"could not create {why} {topic!r} ({partitions} partitions): {err.str()}. Create it yourself "
                "or grant CREATE on the cluster/topic",
                error=err,
                operation="create_topics",
            ) from exc
        self._meta = self._admin.list_topics(timeout=5)
        log.info("created %s %r with %d partition(s)", why, topic, partitions)
