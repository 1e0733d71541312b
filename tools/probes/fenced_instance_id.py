"""Probe: two live consumers with the same group.instance.id on noida-db.

    python tools/probes/fenced_instance_id.py

Apache Kafka (KIP-345) lets the newest JoinGroup with an instance id replace
the old member: the old one gets FENCED_INSTANCE_ID on its next heartbeat,
sync or offset commit, and librdkafka raises it as a fatal consumer error
(error code _FATAL on the error callback / consume(), the underlying error
FENCED_INSTANCE_ID). This probe starts c1, waits for its assignment, starts
c2 with the same group.instance.id, polls both for 20 s, then has each
commit an offset, and prints every error each one surfaced (name, fatal
flag), the group-protocol errors librdkafka logged (debug=cgrp), and each
one's assignment over time.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kafkatx.local import LocalBroker

WATCH_SECONDS = 20


def main() -> None:
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bs, "log_level": 0})
        topic, group = "dup-id-" + uuid.uuid4().hex[:6], "g-" + uuid.uuid4().hex[:6]
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(10)
        t0 = time.monotonic()
        log: list[str] = []
        seen: dict[str, list[str]] = {"c1": [], "c2": []}

        class Logger:
            def __init__(self, name: str) -> None:
                self.name = name

            def log(self, _level: int, fmt: str, *args: Any) -> None:
                text = fmt % args if args else fmt
                if any(
                    k in text.lower()
                    for k in ("fenced", "fatal", "unknown_member", "illegal_generation", "heartbeat failed")
                ):
                    log.append(f"+{time.monotonic() - t0:5.1f}s {self.name}: {text[:200]}")

        def consumer(name: str) -> Consumer:
            def on_error(err: Any) -> None:
                seen[name].append(
                    f"+{time.monotonic() - t0:.1f}s error_cb {err.name()} fatal={err.fatal()} {err.str()[:120]}"
                )

            c = Consumer(
                {
                    "bootstrap.servers": bs,
                    "group.id": group,
                    "group.instance.id": "same-id",
                    "session.timeout.ms": 6000,
                    "heartbeat.interval.ms": 500,
                    "enable.auto.commit": False,
                    "auto.offset.reset": "earliest",
                    "debug": "cgrp",
                    "logger": Logger(name),
                    "error_cb": on_error,
                }
            )
            c.subscribe([topic])
            return c

        def poll(name: str, c: Consumer) -> None:
            try:
                for m in c.consume(10, 0.1):
                    if m.error() is not None:
                        e = m.error()
                        seen[name].append(
                            f"+{time.monotonic() - t0:.1f}s consume() {e.name()} fatal={e.fatal()} {e.str()[:120]}"
                        )
            except KafkaException as exc:
                seen[name].append(f"+{time.monotonic() - t0:.1f}s consume() raised {exc.args[0].name()}")

        def assignment(c: Consumer) -> list[int] | str:
            try:
                return sorted(p.partition for p in c.assignment())
            except KafkaException as exc:
                return f"raises {exc.args[0].name()}"

        c1 = consumer("c1")
        while not c1.assignment():
            poll("c1", c1)
        print(
            f"+{time.monotonic() - t0:.1f}s c1 assigned {assignment(c1)}; starting c2 with the same group.instance.id"
        )
        c2 = consumer("c2")
        last: tuple[Any, Any] = (None, None)
        end = time.monotonic() + WATCH_SECONDS
        while time.monotonic() < end:
            poll("c1", c1)
            poll("c2", c2)
            now = (assignment(c1), assignment(c2))
            if now != last:
                print(f"+{time.monotonic() - t0:.1f}s assignments: c1={now[0]} c2={now[1]}")
                last = now
        for name, c in (("c1", c1), ("c2", c2)):
            try:
                c.commit(offsets=[TopicPartition(topic, 0, 0)], asynchronous=False)
                print(f"{name}: commit() succeeded")
            except KafkaException as exc:
                err = exc.args[0]
                print(
                    f"{name}: commit() raised {err.name()} fatal={err.fatal()} retriable={err.retriable()}: {err.str()[:150]}"
                )
        for name in ("c1", "c2"):
            print(f"{name} surfaced:", *(seen[name] or ["nothing"]), sep="\n  ")
        print("group-protocol errors logged by librdkafka (debug=cgrp):", *(log[:15] or ["none"]), sep="\n  ")
        for c in (c1, c2):
            try:
                c.close()
            except KafkaException:
                pass


if __name__ == "__main__":
    main()
