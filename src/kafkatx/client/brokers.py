"""What kafkatx knows about the embedded broker without starting one.

Every App checks at start whether it runs on the embedded broker (noida-db),
to work around what that broker does not do (docs/BROKERS.md). The check
lives here, apart from :mod:`kafkatx.local` (the broker's process management,
with its ctypes, temporary directories and subprocesses), so that an App on
a real cluster never imports that module.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Iterable
from typing import Protocol

__all__ = [
    "EMBEDDED_CLUSTER_ID",
    "EMBEDDED_CLUSTER_ID_PREFIX",
    "REIDENTIFIED_CLUSTER_ID_PREFIX",
    "ENV_BOOTSTRAP",
    "bootstrap_from_env",
    "ListenerTopics",
    "chained_listeners",
    "is_embedded_broker",
    "RunningBroker",
    "live_brokers",
    "local_broker_at",
    "port_in_use",
    "track",
    "untrack",
    "warn_about_chained_listeners",
]

log = logging.getLogger("kafkatx.local")  # the logger these warnings always had, for logging configs that name it

#: Where every kafkatx client (Apps, the CLI, the dead-letter tools) looks when given no bootstrap servers.
ENV_BOOTSTRAP = "KAFKATX_BOOTSTRAP_SERVERS"


def bootstrap_from_env() -> str | None:
    """``$KAFKATX_BOOTSTRAP_SERVERS``, if set and not empty."""
    return os.environ.get(ENV_BOOTSTRAP) or None


class RunningBroker(Protocol):
    """What the registry needs of an embedded broker (:class:`kafkatx.local.LocalBroker`)."""

    @property
    def running(self) -> bool: ...
    @property
    def port(self) -> int: ...


#: The running embedded brokers of this process (each one tracks and untracks itself).
_LIVE: weakref.WeakSet[RunningBroker] = weakref.WeakSet()


def track(broker: RunningBroker) -> None:
    """Register a broker this process started, so that Apps pointed at it know it is the embedded one."""
    _LIVE.add(broker)


def untrack(broker: RunningBroker) -> None:
    """Forget a broker that stopped."""
    _LIVE.discard(broker)


def live_brokers() -> list[RunningBroker]:
    """The tracked brokers (a copy: stopping one untracks it)."""
    return list(_LIVE)


def port_in_use(port: int) -> bool:
    """True if something listens on 127.0.0.1:``port`` (e.g. ``kafkatx broker`` on its default port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def local_broker_at(bootstrap_servers: str) -> RunningBroker | None:
    """The running :class:`LocalBroker` of this process that ``bootstrap_servers`` names, if any.

    An embedded broker started in another process (``kafkatx broker``) is
    not recognised: it looks like any other cluster from here.
    """
    wanted = set()
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        if host in ("127.0.0.1", "localhost") and port.isdigit():
            wanted.add(int(port))
    return next((b for b in list(_LIVE) if b.running and b.port in wanted), None)


class ListenerTopics(Protocol):
    """What :func:`chained_listeners` needs to know about a listener."""

    @property
    def name(self) -> str: ...
    @property
    def topics(self) -> tuple[str, ...]: ...
    @property
    def output(self) -> str | None: ...
    @property
    def dlq_topic(self) -> str | None: ...


#: The cluster id noida-db (the embedded broker) reports from a fresh start when nobody gave it one: how kafkatx
#: recognises one started elsewhere, to work around what it does not do (docs/BROKERS.md).
EMBEDDED_CLUSTER_ID = "MkU3OEVBNTctOEUyRi00"
#: How the cluster ids kafkatx gives the embedded brokers it starts begin (each start its own: kafkatx.local).
EMBEDDED_CLUSTER_ID_PREFIX = "kafkatx-local-"
#: How the id begins that kafkatx gives, once, a kept data dir still carrying EMBEDDED_CLUSTER_ID (made before
#: kafkatx seeded ids of their own): the same broker, so positions a database stored for the shared id are its own.
REIDENTIFIED_CLUSTER_ID_PREFIX = EMBEDDED_CLUSTER_ID_PREFIX + "was-shared-"


def is_embedded_broker(bootstrap_servers: str, cluster_id: str | None = None) -> bool:
    """True for the embedded broker: started in this process, or recognised by its cluster id."""
    if local_broker_at(bootstrap_servers) is not None:
        return True
    return cluster_id is not None and (
        cluster_id == EMBEDDED_CLUSTER_ID or cluster_id.startswith(EMBEDDED_CLUSTER_ID_PREFIX)
    )


def chained_listeners(listeners: Iterable[ListenerTopics]) -> list[tuple[str, str, str]]:
    """``(writer, topic, reader)`` for every listener that reads a topic another listener writes.

    Only the topics known at declaration are seen: ``output``, the ``send()``
    targets declared with ``sends_to=`` and the dead-letter topic; a topic a
    handler reaches with ``send()`` without declaring it is not.
    """
    listeners = list(listeners)
    chains: list[tuple[str, str, str]] = []
    for writer in listeners:
        written = (writer.output, *getattr(writer, "sends_to", ()), writer.dlq_topic)
        for topic in dict.fromkeys(t for t in written if t):
            chains.extend((writer.name, topic, reader.name) for reader in listeners if topic in reader.topics)
    return chains


def warn_about_chained_listeners(
    listeners: Iterable[ListenerTopics], bootstrap_servers: str
) -> list[tuple[str, str, str]]:
    """Warn when chained listeners run on the embedded broker, where the downstream one can lose records.

    noida-db 0.2.3 lists stale aborted transactions in read_committed fetches,
    so a consumer that has read past one of a producer's aborted transactions
    skips that producer's later records (docs/BROKERS.md). Returns the chains
    it warned about.
    """
    if local_broker_at(bootstrap_servers) is None:
        return []
    chains = chained_listeners(listeners)
    for writer, topic, reader in chains:
        log.warning(
            "listener %r reads %r, which listener %r writes in transactions: on the embedded broker "
            "(noida-db) a read_committed consumer skips a producer's committed records once it has read past "
            "one of that producer's aborted transactions, so %r can lose records that %r committed. "
            "Run chained listeners against a real Kafka cluster (see docs/BROKERS.md).",
            reader,
            topic,
            writer,
            reader,
            writer,
        )
    return chains
