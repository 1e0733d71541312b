"""What a listener container needs from the application that runs it.

The :class:`~kafkatx.App` implements it; the container knows only this
protocol, so ``listener/`` never imports ``app`` (packages import downwards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kafkatx.events import EventBus
    from kafkatx.listener.container import ListenerContainer
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["Runtime"]


class Runtime(Protocol):
    """Client configuration, identity and the event bus of the process running the containers."""

    group_id: str
    events: EventBus
    transaction_timeout_ms: int
    max_producer_recreations: int

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

    def container_exited(self, container: ListenerContainer) -> None:
        """Called by a container's thread as it ends."""
