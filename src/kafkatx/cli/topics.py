"""``kafkatx topics`` and ``kafkatx produce``: put records into a topic while trying an App.

They find the cluster like ``kafkatx dlq`` does: ``--bootstrap-servers``,
else ``$KAFKATX_BOOTSTRAP_SERVERS``, else ``kafkatx broker`` on its default
port. ``produce`` reads one record per line from stdin (or ``--value``
arguments): the value alone, or with ``--kv`` ``key<TAB>value``.

Their clients log through :mod:`kafkatx.client.log` like an App's, so an
unreachable broker is one line naming its address, not librdkafka's raw
``%3|...`` lines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any

from kafkatx._suggest import closest_topic

__all__ = ["add_parsers"]

EX_USAGE = 64
#: Seconds to wait for the cluster's metadata: the answer to "is anything there?".
_METADATA_TIMEOUT = 10.0
#: Seconds ``produce`` waits for its records to be acknowledged.
_DELIVERY_TIMEOUT = 30.0


class _ToolError(Exception):
    """A one-line reason the command stops (exit 1)."""


def _servers(args: argparse.Namespace) -> str:
    from kafkatx.dlq.tools import resolve_bootstrap_servers

    return resolve_bootstrap_servers(args.bootstrap_servers)


def _client_config(servers: str) -> dict[str, Any]:
    from kafkatx.client.log import client_log

    return {"bootstrap.servers": servers, "logger": client_log()}


def _reason(exc: BaseException) -> str:
    """confluent-kafka's reason without the KafkaError{...} wrapping (its name when the text is empty)."""
    from confluent_kafka import KafkaError

    error = exc.args[0] if exc.args else None
    if isinstance(error, KafkaError):
        return str(error.str() or error.name())
    return str(exc) or type(exc).__name__


def _metadata(client: Any, servers: str) -> Any:
    """The cluster's topics, or a one-line error naming the address when no broker answers."""
    from confluent_kafka import KafkaException

    try:
        return client.list_topics(timeout=_METADATA_TIMEOUT)
    except KafkaException as exc:
        raise _ToolError(
            f"cannot reach Kafka at {servers} (no answer within {_METADATA_TIMEOUT:g} s: {_reason(exc)}): is the "
            "broker running, and is that its address? Pass --bootstrap-servers HOST:PORT or set "
            "$KAFKATX_BOOTSTRAP_SERVERS"
        ) from None


def _user_topics(meta: Any) -> dict[str, int]:
    return {name: len(t.partitions) for name, t in meta.topics.items() if not name.startswith("__") and t.error is None}


def _topics(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from kafkatx.client.topics import create_topic
    from kafkatx.dlq.tools import DlqToolError

    if args.action == "create" and not args.names:
        print(
            "kafkatx topics create: name the topics to create, e.g. kafkatx topics create orders --partitions 4",
            file=sys.stderr,
        )
        return 2
    if args.action == "list" and args.names:
        print("kafkatx topics list takes no topic names (it lists every topic)", file=sys.stderr)
        return 2
    try:
        servers = _servers(args)
    except DlqToolError as exc:
        print(f"kafkatx topics: {exc}", file=sys.stderr)
        return EX_USAGE
    admin = AdminClient(_client_config(servers))
    try:
        existing = _user_topics(_metadata(admin, servers))
    except _ToolError as exc:
        print(f"kafkatx topics: {exc}", file=sys.stderr)
        return 1
    if args.action == "list":
        for name in sorted(existing):
            print(f"{name}\t{existing[name]}")
        if not existing:
            print(f"no topics on {servers}", file=sys.stderr)
        return 0
    for name in args.names:
        if name in existing:
            print(
                f"kafkatx topics: cannot create {name!r}: it already exists ({existing[name]} partition(s))",
                file=sys.stderr,
            )
            return 1
        try:
            create_topic(admin, name, args.partitions)  # returns once listed: a produce right after finds it
        except KafkaException as exc:
            print(f"kafkatx topics: cannot create {name!r}: {_reason(exc)}", file=sys.stderr)
            return 1
        print(f"created {name} ({args.partitions} partition(s))")
    return 0


#: Record headers as confluent-kafka takes them.
_Headers = list[tuple[str, str | bytes | None]]


def _produce(args: argparse.Namespace) -> int:
    from confluent_kafka.admin import AdminClient

    from kafkatx.dlq.tools import DlqToolError

    try:
        servers = _servers(args)
    except DlqToolError as exc:
        print(f"kafkatx produce: {exc}", file=sys.stderr)
        return EX_USAGE
    headers = _headers(args.header)
    if headers is None:
        return 2
    try:  # a missing topic would be created by a broker that auto-creates them: a typo must not be
        existing = _user_topics(_metadata(AdminClient(_client_config(servers)), servers))
    except _ToolError as exc:
        print(f"kafkatx produce: {exc}", file=sys.stderr)
        return 1
    if args.topic not in existing:
        print(
            f"kafkatx produce: topic {args.topic!r} does not exist on {servers}{closest_topic(args.topic, existing)}: "
            f"create it with `kafkatx topics create {args.topic}` (an App creates its own with --create-topics or "
            "--local)",
            file=sys.stderr,
        )
        return 1
    if not args.value and sys.stdin.isatty():
        print(
            f"kafkatx produce: one record per line{' (key<TAB>value)' if args.kv else ''}; Ctrl-D to finish",
            file=sys.stderr,
        )
    lines = args.value if args.value else (line.rstrip("\n") for line in sys.stdin)
    return _send(args, servers, lines, headers)


def _headers(items: list[str]) -> _Headers | None:
    """``--header name=value`` options as record headers; None after saying which one is malformed."""
    headers: _Headers = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"kafkatx produce: a header is name=value, got {item!r}", file=sys.stderr)
            return None
        headers.append((name, value.encode()))
    return headers


def _send(args: argparse.Namespace, servers: str, lines: Iterable[str], headers: _Headers) -> int:
    """Produce one record per line (``key<TAB>value`` with ``--kv``) and wait for every acknowledgement."""
    from confluent_kafka import Producer

    producer = Producer(
        {**_client_config(servers), "enable.idempotence": True, "message.timeout.ms": int(_DELIVERY_TIMEOUT * 1000)}
    )
    failures: list[str] = []
    delivered = 0

    def report(err: Any, msg: Any) -> None:
        nonlocal delivered
        if err is not None:
            failures.append(f"{msg.topic()}: {err.str()}")
        else:
            delivered += 1

    count = 0
    for line in lines:
        key: str | None = args.key
        value = line
        if args.kv:
            key, sep, value = line.partition("\t")
            if not sep:
                key, value = None, line
        while True:
            try:
                producer.produce(
                    args.topic,
                    value.encode(),
                    key.encode() if key is not None else None,
                    headers=headers or None,
                    on_delivery=report,
                )
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.1)
        producer.poll(0)
        count += 1
    undelivered = producer.flush(_DELIVERY_TIMEOUT + 5)
    if failures or undelivered or delivered < count:
        first = failures[0] if failures else f"no acknowledgement from {servers} within {_DELIVERY_TIMEOUT:g} s"
        print(
            f"kafkatx produce: {count - delivered} of {count} record(s) not delivered to {args.topic}: {first}",
            file=sys.stderr,
        )
        return 1
    print(f"produced {count} record(s) to {args.topic}", file=sys.stderr)
    return 0


def add_parsers(sub: Any) -> None:
    servers_help = "default: $KAFKATX_BOOTSTRAP_SERVERS, else `kafkatx broker` on 127.0.0.1:9092"
    t = sub.add_parser(
        "topics",
        help="list or create topics",
        description="List the topics of a cluster (name and partitions), or create topics.",
    )
    t.add_argument("action", choices=("list", "create"))
    t.add_argument("names", nargs="*", help="topics to create")
    t.add_argument("--partitions", type=int, default=1, help="partitions of created topics (default 1)")
    t.add_argument("--bootstrap-servers", help=servers_help)
    t.set_defaults(func=_topics)

    p = sub.add_parser(
        "produce",
        help="write records to a topic, one per line of stdin",
        description="Write records to an existing topic: one per line of stdin (or --value), "
        "with no key unless --key or --kv gives one.",
    )
    p.add_argument("topic")
    p.add_argument("--value", action="append", default=[], help="a value to write (repeatable) instead of stdin")
    p.add_argument("--key", help="the key of every record")
    p.add_argument("--kv", action="store_true", help="lines are key<TAB>value")
    p.add_argument("-H", "--header", action="append", default=[], metavar="NAME=VALUE", help="a header (repeatable)")
    p.add_argument("--bootstrap-servers", help=servers_help)
    p.set_defaults(func=_produce)
