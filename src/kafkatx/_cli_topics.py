"""``kafkatx topics`` and ``kafkatx produce``: put records into a topic while trying an App.

They find the cluster like ``kafkatx dlq`` does: ``--bootstrap-servers``,
else ``$KAFKATX_BOOTSTRAP_SERVERS``, else ``kafkatx broker`` on its default
port. ``produce`` reads one record per line from stdin (or ``--value``
arguments): the value alone, or with ``--kv`` ``key<TAB>value``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parsers"]


def _servers(args: argparse.Namespace) -> str:
    from kafkatx.dlq.tools import resolve_bootstrap_servers

    return resolve_bootstrap_servers(args.bootstrap_servers)


def _topics(args: argparse.Namespace) -> int:
    from confluent_kafka.admin import AdminClient

    from kafkatx.dlq.tools import DlqToolError
    from kafkatx.testing.helpers import create_topic

    try:
        servers = _servers(args)
    except DlqToolError as exc:
        print(f"kafkatx topics: {exc}", file=sys.stderr)
        return 64
    if args.action == "create":
        for name in args.names:
            try:
                create_topic(servers, name, args.partitions)
            except Exception as exc:  # TOPIC_ALREADY_EXISTS and friends: say it in one line
                reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
                print(f"kafkatx topics: cannot create {name!r}: {reason}", file=sys.stderr)
                return 1
            print(f"created {name} ({args.partitions} partition(s))")
        return 0
    meta = AdminClient({"bootstrap.servers": servers, "log_level": 3}).list_topics(timeout=10)
    for name in sorted(t for t in meta.topics if not t.startswith("__")):
        print(f"{name}\t{len(meta.topics[name].partitions)}")
    return 0


def _produce(args: argparse.Namespace) -> int:
    from confluent_kafka import Producer

    from kafkatx.dlq.tools import DlqToolError

    try:
        servers = _servers(args)
    except DlqToolError as exc:
        print(f"kafkatx produce: {exc}", file=sys.stderr)
        return 64
    headers = []
    for item in args.header:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"kafkatx produce: a header is name=value, got {item!r}", file=sys.stderr)
            return 2
        headers.append((name, value.encode()))
    lines = args.value if args.value else (line.rstrip("\n") for line in sys.stdin)
    producer = Producer({"bootstrap.servers": servers, "enable.idempotence": True, "log_level": 3})
    failures: list[str] = []

    def report(err: Any, msg: Any) -> None:
        if err is not None:
            failures.append(f"{msg.topic()}: {err.str()}")

    count = 0
    for line in lines:
        key: str | None = args.key
        value = line
        if args.kv:
            key, sep, value = line.partition("\t")
            if not sep:
                key, value = None, line
        producer.produce(args.topic, value.encode(), key.encode() if key is not None else None,
                         headers=headers or None, on_delivery=report)  # fmt: skip
        producer.poll(0)
        count += 1
    producer.flush(30)
    if failures:
        print(f"kafkatx produce: {len(failures)} record(s) not delivered: {failures[0]}", file=sys.stderr)
        return 1
    print(f"produced {count} record(s) to {args.topic}", file=sys.stderr)
    return 0


def add_parsers(sub: Any) -> None:
    t = sub.add_parser("topics", help="list or create topics")
    t.add_argument("action", choices=("list", "create"))
    t.add_argument("names", nargs="*", help="topics to create")
    t.add_argument("--partitions", type=int, default=1, help="partitions of created topics (default 1)")
    t.add_argument("--bootstrap-servers", help="default: $KAFKATX_BOOTSTRAP_SERVERS, else 127.0.0.1:9092")
    t.set_defaults(func=_topics)

    p = sub.add_parser("produce", help="write records to a topic, one per line of stdin")
    p.add_argument("topic")
    p.add_argument("--value", action="append", default=[], help="a value to write (repeatable) instead of stdin")
    p.add_argument("--key", help="the key of every record")
    p.add_argument("--kv", action="store_true", help="lines are key<TAB>value")
    p.add_argument("-H", "--header", action="append", default=[], metavar="NAME=VALUE", help="a header (repeatable)")
    p.add_argument("--bootstrap-servers", help="default: $KAFKATX_BOOTSTRAP_SERVERS, else 127.0.0.1:9092")
    p.set_defaults(func=_produce)
