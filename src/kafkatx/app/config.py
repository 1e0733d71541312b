"""An App's client configuration: bootstrap servers, process identity, librdkafka settings, transactional ids.

Kept apart from the App so that what reads it (the startup checks, producer-initiated
transactions, the containers) depends on this object alone, not on the App that owns it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, overload

from kafkatx._validate import is_int
from kafkatx.client.brokers import ENV_BOOTSTRAP, bootstrap_from_env
from kafkatx.client.log import client_log
from kafkatx.client.properties import check_property_names
from kafkatx.errors import InvalidConfigurationError

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["DEFAULT_TRANSACTION_TIMEOUT_MS", "ENV_INSTANCE", "ClientConfig"]

log = logging.getLogger("kafkatx.app")

ENV_INSTANCE = "KAFKATX_INSTANCE_ID"

#: Default transaction.timeout.ms. Shorter means an instance that crashed
#: without a stable instance id blocks its partitions for less time; longer
#: tolerates slower batches (Spark jobs, in-place retries). 30 s is 10x a
#: slow batch and half of librdkafka's 60 s default.
DEFAULT_TRANSACTION_TIMEOUT_MS = 30_000

#: The listener consumer's ``fetch.queue.backoff.ms``, in place of librdkafka's 1000. Once a partition's local
#: queue is over its thresholds (``queued.min.messages``, ``queued.max.messages.kbytes``), librdkafka looks at
#: it again only this much later; a listener that empties its queue within that second then waits for input
#: (confluentinc/librdkafka#2879). 50 ms is ~10k records of a 200k records/s listener, far below the 100k a
#: partition's queue holds by default; the check it adds is a timer, not a request (docs/BENCHMARKS.md, "Waiting
#: for input").
FETCH_QUEUE_BACKOFF_MS = 50

# Settings kafkatx owns: overriding them would silently break exactly-once.
_FORBIDDEN_CONSUMER = {
    "enable.auto.commit": "true would commit offsets outside the transaction",
    "isolation.level": "read_uncommitted would let handlers see aborted records",
}
_FORBIDDEN_PRODUCER = {
    "transactional.id": "kafkatx derives it from the app name, group and instance id (see fencing=)",
    "enable.idempotence": "transactions require idempotence",
}


class ClientConfig:
    """The client half of an App's options (see :class:`kafkatx.App` for what each means)."""

    def __init__(
        self,
        name: str,
        *,
        bootstrap_servers: str | None,
        group_id: str | None,
        transactional_id_prefix: str | None,
        instance_id: str | None,
        config: Mapping[str, Any] | None,
        consumer_config: Mapping[str, Any] | None,
        producer_config: Mapping[str, Any] | None,
        transaction_timeout_ms: int,
        max_producer_recreations: int,
        static_membership: bool,
        rebalance: Literal["eager", "cooperative"],
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise InvalidConfigurationError(f"App name must be a non-empty string, got {name!r}")
        if not is_int(transaction_timeout_ms, 1000):
            raise InvalidConfigurationError(
                f"transaction_timeout_ms must be an integer >= 1000, got {transaction_timeout_ms!r}"
            )
        if rebalance not in ("eager", "cooperative"):
            raise InvalidConfigurationError(f"rebalance must be 'eager' or 'cooperative', got {rebalance!r}")
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
        self.max_producer_recreations = max_producer_recreations
        self.static_membership = static_membership
        self.rebalance = rebalance
        check_property_names("App config", self.config)
        check_property_names("App consumer_config", self.consumer_config_overrides)
        check_property_names("App producer_config", self.producer_config_overrides)
        for key in _FORBIDDEN_PRODUCER:
            if key in self.config or key in self.producer_config_overrides:
                raise InvalidConfigurationError(f"do not set {key!r}: {_FORBIDDEN_PRODUCER[key]}")
        self.check_consumer_overrides({**self.config, **self.consumer_config_overrides})

    @property
    def instance_id(self) -> str:
        """This process's stable identity (made up at random, with a warning, when none was given)."""
        if self._instance_id is None:
            env = os.environ.get(ENV_INSTANCE)
            if env:
                self._instance_id = env
            else:
                self._random_id = True
                self._instance_id = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        return self._instance_id

    @instance_id.setter
    def instance_id(self, value: str) -> None:
        self._instance_id = value
        self._random_id = False

    def warn_without_instance_id(self) -> None:
        """Say what a random instance id costs after a crash (once the id is resolved)."""
        if self._random_id:
            log.warning(
                "no instance id (App(instance_id=...), --instance-id or $%s): using %s. After a crash, "
                "the transaction this process left open blocks its partitions until transaction.timeout.ms "
                "(%d ms) expires; a stable id lets the restarted process abort it at once.",
                ENV_INSTANCE,
                self._instance_id,
                self.transaction_timeout_ms,
            )

    def resolved_bootstrap_servers(self) -> str:
        """The bootstrap servers: the App's, its config's, or $KAFKATX_BOOTSTRAP_SERVERS; a clear error if none."""
        servers = self.bootstrap_servers or self.config.get("bootstrap.servers") or bootstrap_from_env()
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

    def base_config(self) -> dict[str, Any]:
        """What every client of the App shares: the App's config and the resolved bootstrap servers."""
        # librdkafka's log lines go through logging (kafkatx.librdkafka), not raw to stderr.
        return {"logger": client_log(), **self.config, "bootstrap.servers": self.resolved_bootstrap_servers()}

    def consumer_config(self, spec: ListenerSpec, group_id: str, worker: int) -> dict[str, Any]:
        """The librdkafka configuration of a container's consumer (read_committed, no auto commit, static id)."""
        cfg = {
            "auto.offset.reset": "earliest",
            **self.base_config(),
            **self.consumer_config_overrides,
            **spec.consumer_config,
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
        }
        cfg.setdefault("client.id", f"{self.name}-{self.instance_id}-{spec.name}-{worker}")
        cfg.setdefault("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
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
            **self.base_config(),
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

    def producer_transactional_id(self, n: int) -> str:
        """The transactional.id of the ``n``-th thread's producer for ``app.transaction()``."""
        return f"{self.transactional_id_prefix}-{self.instance_id}-producer-{n}"

    def check_consumer_overrides(self, cfg: Mapping[str, Any]) -> None:
        """Refuse consumer settings that would break exactly-once (auto commit, read_uncommitted)."""
        if str(cfg.get("enable.auto.commit", "false")).lower() == "true":
            raise InvalidConfigurationError(
                f"enable.auto.commit=true is not allowed: {_FORBIDDEN_CONSUMER['enable.auto.commit']}"
            )
        if str(cfg.get("isolation.level", "read_committed")) != "read_committed":
            raise InvalidConfigurationError(
                f"isolation.level must be read_committed: {_FORBIDDEN_CONSUMER['isolation.level']}"
            )


T = TypeVar("T")


class HasClientConfig(Protocol):
    """What a :class:`ClientSetting` lives on: the App, whose client settings are kept in one place."""

    client_config: ClientConfig


class ClientSetting(Generic[T]):
    """An App attribute kept in its :class:`ClientConfig` (``app.bootstrap_servers = ...`` sets it there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, app: None, owner: type) -> ClientSetting[T]: ...
    @overload
    def __get__(self, app: HasClientConfig, owner: type) -> T: ...
    def __get__(self, app: HasClientConfig | None, owner: type) -> T | ClientSetting[T]:
        if app is None:
            return self
        value: T = getattr(app.client_config, self._name)
        return value

    def __set__(self, app: HasClientConfig, value: T) -> None:
        setattr(app.client_config, self._name, value)
