"""Probe: whose is the transaction a broker restart leaves hanging (issue 42, item 13), on noida-db.

    python tools/probes/noida_restart_hanging_txn.py [clean|kill] [--client-log FILE]

One transactional producer (plain confluent-kafka) opens a transaction and writes a record; the broker restarts
(SIGTERM, or SIGKILL once its snapshot holds the record); the producer, which nothing tells of the restart, writes
another record and commits. Then a second producer initialises the same transactional.id (what
`kafkatx transactions abort` and a restarted worker do) and commits a record of its own, and the broker restarts
once more. After each step it prints the partition's last stable offset (read_committed ListOffsets) and high
watermark, and at the end each batch of the log from the broker's snapshot (DIR/kafka.json): producer id, epoch,
and whether it is a COMMIT or ABORT marker. librdkafka's debug log (eos,protocol,broker) of the first producer
goes to --client-log (stderr by default): it shows whether the client saw anything wrong.

Measured 2026-11-28 (noida-db 0.2.3, confluent-kafka 2.16.1), clean and kill alike: the broker ends the
transaction with an ABORT marker when it starts, yet accepts the producer's next record under the same producer id
and epoch, answers its EndTxn with NO_ERROR and writes no marker: the record stays open, and the second producer
gets a new producer id, so its initialisation aborts nothing. Only the next restart ends it (docs/BROKERS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kafkatx.local import LocalBroker

TXN_ID = "hanging-probe"


def stable_and_high(bootstrap: str, topic: str) -> tuple[int, int]:
    found = []
    for isolation in ("read_committed", "read_uncommitted"):
        c = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": "probe", "isolation.level": isolation, "log_level": 0}
        )
        found.append(c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)[1])
        c.close()
    return found[0], found[1]


def batches(snapshot: Path, topic: str) -> list[str]:
    """The partition's batches as the broker's snapshot holds them (Kafka's record batch v2 header)."""
    state = json.loads(snapshot.read_text())
    lines = []
    for name, t in state["topics"]:
        if name != topic:
            continue
        for _, partition in t["partitions"]:
            lines.append(f"  aborted transactions listed: {partition['aborted_txns']}")
            for offset, raw in partition["record_batches"]:
                b = bytes(raw)
                attrs, producer_id, epoch = struct.unpack(">h", b[21:23])[0], *struct.unpack(">qh", b[43:53])
                count = struct.unpack(">i", b[57:61])[0]
                if attrs & 0x20:  # a control batch; its one record: length, attributes, two deltas, key length (one
                    # byte each here), then the key (version, type): type 0 is ABORT, 1 COMMIT
                    kind = "COMMIT marker" if b[68:70] == b"\x00\x01" else "ABORT marker"
                else:
                    kind = f"{count} record(s)"
                lines.append(f"  offset {offset}: {kind}, producer id {producer_id}, epoch {epoch}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("how", nargs="?", choices=["clean", "kill"], default="clean")
    parser.add_argument("--client-log", help="where the first producer's librdkafka debug log goes (stderr)")
    args = parser.parse_args()
    if args.client_log:  # librdkafka writes its log to stderr: send this process's stderr to the file
        fd = os.open(args.client_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
    data_dir = Path(tempfile.mkdtemp(prefix="hanging-probe-"))
    broker = LocalBroker(data_dir=data_dir).start()
    try:
        bs, topic = broker.bootstrap_servers, "hanging-probe"
        admin = AdminClient({"bootstrap.servers": bs, "log_level": 0})
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(10)

        def show(step: str) -> None:
            lso, hw = stable_and_high(bs, topic)
            print(f"{step:<58} LSO {lso:>2}  HW {hw:>2}{'  <- open' if lso < hw else ''}", flush=True)

        def restart() -> None:
            if args.how == "clean":
                broker.restart()
                return
            snapshot, deadline = data_dir / "kafka.json", time.monotonic() + 10
            while time.monotonic() < deadline and b"before" not in snapshot.read_bytes():
                time.sleep(0.2)  # the record in a snapshot (every 1-2 s): only the transaction state is at stake
            broker.kill()
            broker.start()

        owner = Producer({"bootstrap.servers": bs, "transactional.id": TXN_ID, "debug": "eos,protocol,broker"})
        owner.init_transactions(10)
        owner.begin_transaction()
        owner.produce(topic, b"before")
        owner.flush(10)
        show("open transaction, one record written")
        restart()
        show(f"broker restarted ({args.how})")
        owner.produce(topic, b"after")
        print(f"  the record after the restart: flush left {owner.flush(30)} unacknowledged")
        show("the same transaction writes a record after the restart")
        owner.commit_transaction(30)
        show("commit_transaction returned success")
        successor = Producer({"bootstrap.servers": bs, "transactional.id": TXN_ID, "log_level": 0})
        successor.init_transactions(10)
        show("a second producer initialised the same transactional.id")
        successor.begin_transaction()
        successor.produce(topic, b"successor")
        successor.commit_transaction(10)
        show("... and committed a record")
        broker.restart()
        show("broker restarted again (clean)")
        owner.close()
        successor.close()
        broker.stop()
        print("the partition in the broker's snapshot:")
        print("\n".join(batches(data_dir / "kafka.json", topic)), flush=True)
    finally:
        broker.stop()


if __name__ == "__main__":
    sys.exit(main())
