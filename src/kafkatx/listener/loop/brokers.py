"""Whether the cluster answers a container: for /readyz, and for the hint when no partition comes.

librdkafka says when every broker is down (``_ALL_BROKERS_DOWN``, through the
consumer's ``error_cb``) but not when one answers again. So while the cluster
is down, the loop's idle stage asks it for metadata, at most every
:data:`PROBE_INTERVAL_S`; any answer, or any record fetched, ends it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from kafkatx.events import ClusterReachable, ClusterUnreachable, Event

__all__ = ["PROBE_INTERVAL_S", "BrokerWatch"]

log = logging.getLogger("kafkatx.container")

#: How often a container whose cluster is down asks it for metadata (seconds), each ask waiting half a second.
PROBE_INTERVAL_S = 2.0


class BrokerWatch:
    """Since when no broker of the cluster has answered this container (``down_since``, None while one does)."""

    def __init__(
        self, name: str, worker: int, bootstrap_servers: str, publish: Callable[[Event], None] = lambda event: None
    ) -> None:
        self._name, self._worker, self.bootstrap_servers = name, worker, bootstrap_servers
        self._publish = publish
        self.down_since: float | None = None
        self._probed = 0.0

    def error_cb(self, chained: Callable[[KafkaError], Any] | None) -> Callable[[KafkaError], None]:
        """The consumer's ``error_cb``: this watch's, then the one the App's configuration set, if any."""

        def on_error(err: KafkaError) -> None:
            if err.code() == KafkaError._ALL_BROKERS_DOWN and self.down_since is None:
                self.down_since = time.monotonic()
                log.warning("listener %s: no broker of %s answers (%s)", self._name, self.bootstrap_servers, err.str())
                self._publish(ClusterUnreachable(self._name, self._worker, self.bootstrap_servers))
            if chained is not None:
                chained(err)

        return on_error

    def answered(self) -> None:
        """The cluster answered (records were fetched, or metadata came)."""
        since, self.down_since = self.down_since, None
        if since is not None:
            seconds = time.monotonic() - since
            log.warning("listener %s: %s answers again after %.0fs", self._name, self.bootstrap_servers, seconds)
            self._publish(ClusterReachable(self._name, self._worker, self.bootstrap_servers, seconds))

    def probe(self, consumer: Any) -> None:
        """While the cluster is down: ask it for metadata, at most every :data:`PROBE_INTERVAL_S`."""
        now = time.monotonic()
        if self.down_since is None or consumer is None or now - self._probed < PROBE_INTERVAL_S:
            return
        self._probed = now
        try:
            consumer.list_topics(timeout=0.5)
        except KafkaException:
            return
        self.answered()

    def down_for(self, now: float) -> float | None:
        """Seconds since no broker answers, or None while one does."""
        since = self.down_since
        return None if since is None else max(0.0, now - since)
