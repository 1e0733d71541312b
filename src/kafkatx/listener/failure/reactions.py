"""KIP-1050 reactions to Kafka errors (inside a transaction, and from a poll), and producer replacement.

Inside a transaction the unit decides (``TransactionUnit.transact``) and
calls on this module for what outlives it: the producer and the positions.

- Abortable: abort and redo the transaction from memory, up to
  ``max_abortable_retries`` times in a row; then escalate to a new producer.
- Application-recoverable (fencing, a producer gone fatal, a stuck call):
  discard the producer, rewind to the committed offsets; the next
  transaction creates a new producer with the same transactional.id. The
  after-rollback processor is not involved: after fencing, the partitions
  may belong to another consumer already.
- Group membership lost mid-transaction: abort and rewind.

A producer replaced more than ``max_producer_recreations`` times within a
minute stops the container (:class:`~kafkatx.FencedTooOftenError`): another
process is almost certainly using the same transactional.id.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import KafkaError, Message, TopicPartition

from kafkatx._suggest import closest_topic
from kafkatx.client.offsets import first_offsets
from kafkatx.errors import (
    FencedTooOftenError,
    InvalidConfigurationError,
    KafkaClientError,
    KafkaTxError,
    StuckCallError,
)
from kafkatx.errors.classification import ErrorClass, classify
from kafkatx.events import KafkaErrorHandled, ProducerRecreated
from kafkatx.listener.host import ContainerIdentity, ContainerMembership, ContainerPositions, ContainerTransactions
from kafkatx.record import ConsumedMessage

if TYPE_CHECKING:
    from kafkatx.client.producer import TransactionalProducer

__all__ = ["KafkaErrorReactions"]

log = logging.getLogger("kafkatx.container")

_FENCE_WINDOW_S = 60.0


class ReactionsHost(ContainerIdentity, ContainerPositions, ContainerMembership, ContainerTransactions, Protocol):
    """What the reactions use of their container: its positions, its consumer, its producers' limits, its events."""


class KafkaErrorReactions:
    """The reactions of one container (its producers share the recreation budget).

    The reaction to an error inside a transaction is the unit's
    (:meth:`TransactionUnit.transact <kafkatx.listener.transaction.unit.TransactionUnit.transact>`);
    it calls on these for what outlives the unit: the producer and the consumer's positions.
    """

    def __init__(self, container: ReactionsHost) -> None:
        self._c = container
        self._recreations: collections.deque[float] = collections.deque()

    def recreate_producer(
        self,
        producer: TransactionalProducer,
        exc: KafkaClientError,
        msgs: Sequence[ConsumedMessage],
        *,
        escalated: bool = False,
    ) -> None:
        """Application-recoverable: drop the producer, rewind to the committed offsets, carry on."""
        c = self._c
        now = time.monotonic()
        self._recreations.append(now)
        while self._recreations and self._recreations[0] < now - _FENCE_WINDOW_S:
            self._recreations.popleft()
        log.warning(
            "listener %s: %s%s; replacing producer %s and rewinding to the committed offsets",
            c.name,
            "escalated: " if escalated else "",
            exc,
            producer.transactional_id,
        )
        producer.discard()
        c.publish(ProducerRecreated(c.name, c.worker, producer.transactional_id, exc))
        self.note(exc, "recreate producer")
        limit = c.max_producer_recreations
        if len(self._recreations) > limit:
            raise FencedTooOftenError(
                f"listener {c.name!r}: producer {producer.transactional_id} had to be replaced "
                f"{len(self._recreations)} times within {_FENCE_WINDOW_S:.0f}s (max_producer_recreations={limit}; "
                f"last error: {exc}). Another process is probably using the same transactional.id: give each "
                "instance a unique instance_id."
            ) from exc
        if isinstance(exc, StuckCallError):
            # The abandoned call may still complete (a commit reaching the coordinator late). A new
            # producer's init_transactions fences it and settles its transaction first, so the
            # committed offsets read below are final: nothing is handled twice.
            producer.ensure()
        self.rewind_to_committed(msgs)
        if c.spec.fencing == "partition" and not escalated and exc.fenced:
            # KIP-98 mode: the transactional.id belongs to the partition, so a newer producer with
            # it means the partition was most likely given to another consumer, and this one has
            # not heard yet (it was dropped from the group while busy). Starting a new producer now
            # would fence that owner in turn, and both would commit the same records. So hold the
            # partition until the group says whose it is: a revoke ends the hold, and if it is
            # still ours after a couple of heartbeats, the next transaction takes the id back.
            for tp in first_offsets(msgs):
                log.warning(
                    "listener %s: holding %s[%d] for %.0fs after fencing (was it reassigned?)",
                    c.name,
                    tp[0],
                    tp[1],
                    c.fence_hold,
                )
                c.pause(tp, c.fence_hold)

    def rewind_to_committed(self, msgs: Sequence[ConsumedMessage]) -> None:
        """Seek the partitions of ``msgs`` that are still ours to their committed offsets."""
        c = self._c
        consumer = c.consumer
        if consumer is None:
            return
        starts = first_offsets(msgs)
        wanted = [TopicPartition(t, p) for (t, p) in starts if c.owns((t, p))]
        if not wanted:
            return
        try:
            committed = consumer.committed(wanted, timeout=10)
        except Exception:
            log.warning("could not read committed offsets; rewinding to the batch start", exc_info=True)
            committed = [TopicPartition(tp.topic, tp.partition, starts[(tp.topic, tp.partition)]) for tp in wanted]
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else starts[(tp.topic, tp.partition)]
            c.seek((tp.topic, tp.partition), offset)

    def note(self, exc: KafkaClientError, action: str) -> None:
        c = self._c
        c.publish(KafkaErrorHandled(c.name, c.worker, exc.operation or "", exc.error_class.name, exc, action))

    def on_retry(self, cls: ErrorClass, err: KafkaError, attempt: int) -> None:
        """A retriable error that the producer retries by itself (for events and metrics)."""
        c = self._c
        c.publish(KafkaErrorHandled(c.name, c.worker, "", cls.name, None, f"retry #{attempt}", {"code": err.name()}))

    def consumer_error(self, msg: Message) -> None:
        """A consumer error from a poll: raise what ends the container, log what librdkafka retries."""
        c = self._c
        err = msg.error()
        assert err is not None
        code = err.code()
        if code == KafkaError._PARTITION_EOF:
            return
        if code == KafkaError.FENCED_INSTANCE_ID or (code == KafkaError._FATAL and "group.instance.id" in err.str()):
            # confluent-kafka reports it as _FATAL, with fatal() False: another live consumer took this
            # consumer's static identity. Two processes share an instance id; carrying on is impossible.
            instance = c.consumer_config.get("group.instance.id")
            raise InvalidConfigurationError(
                f"listener {c.name!r}: another live process uses group.instance.id {instance!r} (the same "
                f"instance id): give each process its own --instance-id ({err.str()})",
                error=err,
                operation="consume",
            )
        if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            topic = msg.topic() or ""
            raise InvalidConfigurationError(
                f"listener {c.name!r}: input topic {topic!r} does not exist ({err.str()}); "
                f"create it, or fix the topic name{closest_topic(topic, _topic_names(c.consumer))}",
                error=err,
                operation="consume",
            )
        cls = classify(err)
        if cls is ErrorClass.INVALID_CONFIGURATION or err.fatal():
            raise KafkaTxError.from_kafka(err, operation="consume")
        log.warning("listener %s: consumer error %s: %s (librdkafka retries)", c.name, err.name(), err.str())


def _topic_names(consumer: Any) -> list[str]:
    """The cluster's topics, for a did-you-mean (none when the metadata cannot be had)."""
    try:
        return list(consumer.list_topics(timeout=5).topics) if consumer is not None else []
    except Exception:  # noqa: BLE001 - the error goes out without the hint
        return []
