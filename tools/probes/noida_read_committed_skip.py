"""Probe: why a read_committed consumer loses committed records on noida-db.

    python tools/probes/noida_read_committed_skip.py wire            # the FetchResponse, field by field
    python tools/probes/noida_read_committed_skip.py live [REPS]     # client settings, REPS runs each (default 20)
    python tools/probes/noida_read_committed_skip.py fresh           # a fresh reader whose read takes several fetches

Each mode starts its own LocalBroker (kafkatx.local) and needs nothing else.

``wire`` writes commit/abort/commit/commit/abort/commit from one
transactional producer plus one commit from another, then fetches
read_committed from every offset with a raw Fetch v5 (tools/probes/_wire.py)
and prints what noida answers next to what Apache Kafka would list as
aborted transactions, and which committed records librdkafka delivers from
that response (librdkafka's rule, src/rdkafka_msgset_reader.c: a
transactional data batch is dropped when its producer has a listed aborted
transaction starting at or before it whose ABORT marker has not yet been
seen in the same response).

``live`` runs the scenario of the conformance canary with plain
confluent-kafka consumers (assign(), no group) under each candidate client
setting and counts the runs that lost records: per run, a caught-up
consumer, then commit, abort, commit, commit from one producer, a sentinel
from another producer, two more commits and a second sentinel; the four
commits after the abort are the ones counted. ``fresh`` shows that a
reader starting from the beginning loses them too once its read of the
partition takes more than one fetch.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _wire  # noqa: E402

from kafkatx.local import LocalBroker  # noqa: E402

QUIET = {"log_level": 0}


def new_topic(admin: AdminClient) -> str:
    name = "probe-" + uuid.uuid4().hex[:8]
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(10)
    deadline = time.monotonic() + 10
    while name not in admin.list_topics(timeout=5).topics and time.monotonic() < deadline:
        time.sleep(0.02)
    return name


def txn_producer(bootstrap: str, txn_id: str) -> Producer:
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "linger.ms": 0, **QUIET})
    p.init_transactions(10)
    return p


def transaction(p: Producer, topic: str, value: bytes, commit: bool) -> None:
    p.begin_transaction()
    p.produce(topic, value, partition=0)
    p.flush(10)  # the records reach the log even when the transaction is aborted
    if commit:
        p.commit_transaction(10)
    else:
        p.abort_transaction(10)


def librdkafka_delivers(response: _wire.PartitionFetch) -> list[int]:
    """Offsets of the data batches librdkafka hands to the application from this response."""
    pending: dict[int, list[int]] = {}
    for pid, first in sorted(response.aborted_transactions or [], key=lambda t: t[1]):
        pending.setdefault(pid, []).append(first)
    delivered = []
    for b in response.batches:
        starts = pending.get(b.producer_id, [])
        if b.kind == "ABORT":
            if starts and starts[0] <= b.base_offset:
                starts.pop(0)
        elif b.kind == "data":
            if not (b.transactional and starts and b.base_offset >= starts[0]):
                delivered.append(b.base_offset)
    return delivered


def mode_wire() -> None:
    with LocalBroker() as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers, **QUIET})
        topic = new_topic(admin)
        a, b = txn_producer(broker.bootstrap_servers, "probe-a"), txn_producer(broker.bootstrap_servers, "probe-b")
        for i, commit in enumerate([True, False, True, True, False, True]):
            transaction(a, topic, b"a%d" % i, commit)
        transaction(b, topic, b"b0", True)
        conn = _wire.Connection("127.0.0.1", broker.port)
        full = _wire.fetch(conn, topic, 0, 0, isolation=_wire.READ_UNCOMMITTED).batches
        print("log (read_uncommitted):", " ".join(f"{x.base_offset}:{x.kind}/pid{x.producer_id}" for x in full))
        committed_data = [x.base_offset for x in _wire.fetch(conn, topic, 0, 0).batches if x.kind == "data"]
        print("committed data batches:", committed_data, "\n")
        print(
            f"{'fetch@':>6} {'hw':>3} {'lso':>3} {'lstart':>6}  {'noida aborted list':<28} {'Kafka would list':<22} "
            f"{'batches returned':<40} librdkafka delivers"
        )
        for offset in range(full[-1].last_offset + 2):
            r = _wire.fetch(conn, topic, 0, offset)
            upper = r.batches[-1].last_offset + 1 if r.batches else offset
            expected = _wire.kafka_aborted_list(full, offset, upper)
            batches = " ".join(f"{x.base_offset}{x.kind[0]}" for x in r.batches)
            wanted = [o for o in committed_data if o >= offset]
            got = librdkafka_delivers(r)
            lost = sorted(set(wanted) - set(got))
            print(
                f"{offset:>6} {r.high_watermark:>3} {r.last_stable_offset:>3} {r.log_start_offset!s:>6}  "
                f"{r.aborted_transactions!s:<28} {expected!s:<22} {batches:<40} {got}"
                + (f"  LOST {lost}" if lost else "")
            )
        conn.close()
    print("\n(batch kinds: d=data C=COMMIT marker A=ABORT marker; noida drops aborted data batches itself)")


CANDIDATES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "fetch.wait.max.ms=2000,fetch.min.bytes=1000000": {"fetch.wait.max.ms": 2000, "fetch.min.bytes": 1_000_000},
    "fetch.max.bytes=1000,message.max.bytes=1000,max.partition.fetch.bytes=1": {
        "fetch.max.bytes": 1000,
        "message.max.bytes": 1000,
        "max.partition.fetch.bytes": 1,
    },
    "fetch.max.bytes=max.partition.fetch.bytes=100 MB": {
        "fetch.max.bytes": 100_000_000,
        "max.partition.fetch.bytes": 100_000_000,
        "receive.message.max.bytes": 200_000_000,
    },
    "check.crcs=true": {"check.crcs": True},
    "enable.partition.eof=true": {"enable.partition.eof": True},
    "queued.max.messages.kbytes=1,queued.min.messages=1": {"queued.max.messages.kbytes": 1, "queued.min.messages": 1},
    "fetch.error.backoff.ms=0,fetch.queue.backoff.ms=0": {"fetch.error.backoff.ms": 0, "fetch.queue.backoff.ms": 0},
    "LocalBroker.client_config": dict(LocalBroker.client_config),
}


def live_run(
    bootstrap: str,
    admin: AdminClient,
    producer: Producer,
    other: Producer,
    extra: dict[str, Any],
    *,
    slow_poll: float = 0.0,
) -> tuple[int, int]:
    """One run: a caught-up consumer, then C A C C from one producer, a sentinel from another, C C, a sentinel.

    Returns (post-abort commits expected, post-abort commits received). The
    second phase shows whether a setting that got the first commits after the
    abort through keeps getting later ones.
    """
    topic = new_topic(admin)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "unused",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            **QUIET,
            **extra,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    got: list[bytes] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for m in consumer.consume(100, 0.05):
                if m.error() is None and m.value() is not None:
                    got.append(m.value())
            if slow_poll:
                time.sleep(slow_poll)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        transaction(producer, topic, b"c0", True)
        _wait(lambda: b"c0" in got, "c0")  # caught up: it fetched past the first commit
        transaction(producer, topic, b"x1", False)
        transaction(producer, topic, b"c2", True)
        transaction(producer, topic, b"c3", True)
        transaction(other, topic, b"sentinel-1", True)  # another producer id: never skipped
        _wait(lambda: b"sentinel-1" in got, "sentinel-1")
        transaction(producer, topic, b"c4", True)
        transaction(producer, topic, b"c5", True)
        transaction(other, topic, b"sentinel-2", True)
        _wait(lambda: b"sentinel-2" in got, "sentinel-2")
    finally:
        stop.set()
        thread.join()
        consumer.close()
    wanted = (b"c2", b"c3", b"c4", b"c5")
    return len(wanted), sum(v in wanted for v in got)


def _wait(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


def mode_live(reps: int) -> None:
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bs, **QUIET})
        producer, other = txn_producer(bs, "probe-a"), txn_producer(bs, "probe-b")
        runs = [(name, cfg, 0.0) for name, cfg in CANDIDATES.items()]
        runs.append(("defaults, application polls every 0.5 s", {}, 0.5))
        print(f"{'client setting':<66} runs  runs that lost records  records lost")
        for name, cfg, slow in runs:
            lossy = lost = 0
            for _ in range(reps):
                expected, received = live_run(bs, admin, producer, other, cfg, slow_poll=slow)
                lossy += received < expected
                lost += expected - received
            print(f"{name:<66} {reps:>4}  {lossy:>22}  {lost:>5} of {4 * reps}")


def mode_fresh() -> None:
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bs, **QUIET})
        topic = new_topic(admin)
        p = txn_producer(bs, "probe-a")
        transaction(p, topic, b"x-aborted", False)
        for i in range(200):
            transaction(p, topic, b"c%03d" % i + b"." * 1000, True)
        for max_bytes in (100_000_000, 1_048_576, 10_000):
            consumer = Consumer(
                {
                    "bootstrap.servers": bs,
                    "group.id": "unused",
                    "isolation.level": "read_committed",
                    "enable.partition.eof": True,
                    "max.partition.fetch.bytes": max_bytes,
                    **QUIET,
                }
            )
            consumer.assign([TopicPartition(topic, 0, 0)])
            n, eof = 0, False
            while not eof:
                for m in consumer.consume(500, 1.0):
                    if m.error() is None:
                        n += 1
                    else:
                        eof = True
            consumer.close()
            print(
                f"fresh reader from offset 0, max.partition.fetch.bytes={max_bytes:>11}: {n:>3} of 200 committed records"
            )


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "wire"
    if mode == "wire":
        mode_wire()
    elif mode == "live":
        mode_live(int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    elif mode == "fresh":
        mode_fresh()
    else:
        sys.exit(__doc__)
