"""One consumer-group member in its own process, for the group probes.

    python tools/probes/_member.py '<json>'

json: bootstrap, group, topic, name, and optional instance_id
(group.instance.id), config (extra librdkafka properties), close_after
(seconds; then consumer.close() and exit 0). It prints one JSON line per
event on stdout, flushed: {"t": wall-clock time, "name", "event":
"assign"|"revoke"|"lost"|"owned"|"error"|"closed", "partitions": [...]
(the callback's argument), "owned" (the assignment when the callback ran),
"code", "fatal"}. "owned" is printed
whenever the member's full assignment changes, so the controller can read
who owns what at any moment. A controller kills it with SIGKILL or SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition


def main() -> None:
    args = json.loads(sys.argv[1])
    name = args["name"]

    def emit(event: str, **fields: Any) -> None:
        print(json.dumps({"t": time.time(), "name": name, "event": event, **fields}), flush=True)

    config: dict[str, Any] = {
        "bootstrap.servers": args["bootstrap"],
        "group.id": args["group"],
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        "max.poll.interval.ms": 30000,
        "log_level": 0,
        "error_cb": lambda err: emit("error", code=err.name(), fatal=err.fatal(), text=err.str()),
        **args.get("config", {}),
    }
    if args.get("instance_id"):
        config["group.instance.id"] = args["instance_id"]
    consumer = Consumer(config)

    def parts(ps: list[TopicPartition]) -> list[int]:
        return sorted(p.partition for p in ps)

    def on_assign(c: Consumer, ps: list[TopicPartition]) -> None:
        emit("assign", partitions=parts(ps), owned=parts(c.assignment()))

    def on_revoke(c: Consumer, ps: list[TopicPartition]) -> None:
        emit("revoke", partitions=parts(ps), owned=parts(c.assignment()))

    def on_lost(c: Consumer, ps: list[TopicPartition]) -> None:
        emit("lost", partitions=parts(ps), owned=parts(c.assignment()))

    consumer.subscribe([args["topic"]], on_assign=on_assign, on_revoke=on_revoke, on_lost=on_lost)
    stopping = False

    def on_term(_sig: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    close_at = time.monotonic() + args["close_after"] if args.get("close_after") else None
    owned: list[int] | None = None
    while not stopping and (close_at is None or time.monotonic() < close_at):
        for msg in consumer.consume(100, 0.1):
            err = msg.error()
            if err is not None and err.code() != KafkaError._PARTITION_EOF:
                emit("error", code=err.name(), fatal=err.fatal(), text=err.str())
                if err.fatal():
                    stopping = True
        try:
            now = parts(consumer.assignment())
        except Exception as exc:  # a fatal consumer raises here
            emit("error", code=type(exc).__name__, fatal=True, text=str(exc))
            break
        if now != owned:
            owned = now
            emit("owned", partitions=now)
    consumer.close()
    emit("closed")


if __name__ == "__main__":
    main()
