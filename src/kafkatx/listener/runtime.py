"""What a listener container needs from the application that runs it.

The :class:`~kafkatx.App` implements it; the container knows only this
protocol, so ``listener/`` never imports ``app`` (packages import downwards).
It is generic in the container it is told about (``Runtime[ListenerContainer]``),
so this module needs no import of the container either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from kafkatx.events import EventBus
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["Runtime"]

#: The container a runtime is told about when it exits.
C_contra = TypeVar("C_contra", contravariant=True)


class Runtime(Protocol[C_contra]):
    """Client configuration, identity and the event bus of the process running the containers."""

    group_id: str
    events: EventBus
    transaction_timeout_ms: int
    max_producer_recreations: int
    #: False on a broker that answers a fetch finding nothing at once instead of holding it up to
    #: ``fetch.wait.max.ms`` (the embedded one): the container then pauses input partitions read to their end a
    #: moment (listener/loop/quiet_partitions.py).
    broker_holds_empty_fetches: bool

    @property
    def transaction_retry_timeout(self) -> float:
        """Seconds a transactional call is retried before the transaction is given up."""

    def consumer_config(self, spec: ListenerSpec, group_id: str, worker: int) -> dict[str, Any]:
        """The librdkafka configuration of a container's consumer."""

    def producer_config(self, spec: ListenerSpec | None, transactional_id: str) -> dict[str, Any]:
        """The librdkafka configuration of a transactional producer."""

    def group_transactional_id(self, group_id: str, index: int) -> str:
        """The transactional.id of container ``index`` in ``fencing="group"`` mode."""

    def partition_transactional_id(self, group_id: str, topic: str, partition: int) -> str:
        """The transactional.id of an input partition in ``fencing="partition"`` mode."""

    def container_exited(self, container: C_contra) -> None:
        """Called by a container's thread as it ends."""
