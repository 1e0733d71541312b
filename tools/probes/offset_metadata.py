"""Probe: offset-commit metadata sent through send_offsets_to_transaction, on noida-db.

    python tools/probes/offset_metadata.py

Checks that TopicPartition(topic, p, offset, metadata=...) given to
send_offsets_to_transaction is stored when the transaction commits, not when
it aborts, that consumer.committed() returns it (also to another member of
the group after a restart), and which sizes are accepted. Apache Kafka
rejects metadata longer than offset.metadata.max.bytes (broker default
4096) with OFFSET_METADATA_TOO_LARGE; each size is tried in its own
transaction with a fresh producer, since a failed TxnOffsetCommit leaves the
transaction needing an abort.
"""

from __future__ import annotations

import uuid

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kafkatx.local import LocalBroker

QUIET = {"log_level": 0}


def main() -> None:
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bs, **QUIET})
        topic, group = "meta-" + uuid.uuid4().hex[:6], "g-" + uuid.uuid4().hex[:6]
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(10)
        consumer = Consumer({"bootstrap.servers": bs, "group.id": group, "enable.auto.commit": False, **QUIET})

        def committed() -> tuple[int, str | None]:
            tp = consumer.committed([TopicPartition(topic, 0)], timeout=10)[0]
            return tp.offset, tp.metadata

        def producer() -> Producer:
            p = Producer({"bootstrap.servers": bs, "transactional.id": "meta-" + uuid.uuid4().hex[:6], **QUIET})
            p.init_transactions(10)
            return p

        def txn(offset: int, metadata: str | None, commit: bool, p: Producer | None = None) -> str:
            p = p or producer()
            p.begin_transaction()
            try:
                tp = (
                    TopicPartition(topic, 0, offset)
                    if metadata is None
                    else TopicPartition(topic, 0, offset, metadata=metadata)
                )
                p.send_offsets_to_transaction([tp], consumer.consumer_group_metadata(), 10)
                if commit:
                    p.commit_transaction(10)
                else:
                    p.abort_transaction(10)
                return "ok"
            except KafkaException as exc:
                err = exc.args[0]
                outcome = f"{err.name()} (fatal={err.fatal()}, abortable={err.txn_requires_abort()})"
                try:
                    p.abort_transaction(10)
                except KafkaException:
                    pass
                return outcome

        print("before any commit:           committed() =", committed())
        p = producer()
        print("abort  offset 5, 'attempt=1':", txn(5, "attempt=1", False, p), "-> committed() =", committed())
        print("commit offset 7, 'attempt=2':", txn(7, "attempt=2", True, p), "-> committed() =", committed())
        print("abort  offset 8, 'attempt=3':", txn(8, "attempt=3", False, p), "-> committed() =", committed())
        print("commit offset 9, no metadata:  ", txn(9, None, True, p), "-> committed() =", committed())
        print("commit offset 10, metadata '':", txn(10, "", True, p), "-> committed() =", committed())
        print("commit offset 11, non-ASCII 'ä→✓':", txn(11, "ä→✓", True, p), "-> committed() =", committed())

        other = Consumer({"bootstrap.servers": bs, "group.id": group, "enable.auto.commit": False, **QUIET})
        tp = other.committed([TopicPartition(topic, 0)], timeout=10)[0]
        print("another consumer of the group reads:", (tp.offset, tp.metadata))
        other.close()

        offset = 100
        for size in (1_000, 4_096, 4_097, 32_767, 32_768, 65_536, 500_000, 1_000_000, 5_000_000):
            offset += 1
            outcome = txn(offset, "x" * size, True)
            got_offset, got_meta = committed()
            stored = got_offset == offset and got_meta == "x" * size
            print(f"metadata of {size:>9,} bytes: {outcome:<60} stored and returned intact: {stored}")
        consumer.close()


if __name__ == "__main__":
    main()
