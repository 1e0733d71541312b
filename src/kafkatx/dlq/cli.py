"""``kafkatx dlq inspect|replay TOPIC``: look at a dead-letter topic and re-publish its records.

Thin wrappers over :mod:`kafkatx.dlq.tools`; docs/DLQ.md describes the options and policies.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from kafkatx.dlq.tools import (
    ENV_BOOTSTRAP,
    FILTER_FIELDS,
    DeadLetterEntry,
    DlqFilter,
    DlqToolError,
    ReplayResult,
    default_replay_group,
    inspect_dlq,
    parse_filter,
    replay_dlq,
    resolve_bootstrap_servers,
)

__all__ = ["add_parser"]

EX_USAGE = 64
_MESSAGE_WIDTH = 60
_EXCEPTION_WIDTH = 48
_COLUMNS = ("DLT", "ORIGINAL", "EXCEPTION", "ATTEMPTS", "GROUP", "ORIGINAL TIME", "DLT TIME", "REPLAYED", "MESSAGE")


# -- argument types (argparse shows an ArgumentTypeError's message as is) ------
def _filter_arg(text: str) -> DlqFilter:
    try:
        return parse_filter(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"bad client setting {text!r}: expected KEY=VALUE, e.g. security.protocol=SSL")
    return key.strip(), value


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


# -- output ----------------------------------------------------------------------
def _time(ms: int | None) -> str:
    if ms is None or ms < 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _short_class(fqcn: str | None) -> str:
    return "-" if not fqcn else fqcn.rsplit(".", 1)[-1]


def _exception(entry: DeadLetterEntry) -> str:
    # The root cause first: Spring wraps every listener error in ListenerExecutionFailedException.
    fqcn, cause = entry.info.exception_fqcn, entry.info.exception_cause_fqcn
    if cause and fqcn and cause != fqcn:
        return _truncate(f"{_short_class(cause)} (via {_short_class(fqcn)})", _EXCEPTION_WIDTH)
    return _truncate(_short_class(fqcn or cause), _EXCEPTION_WIDTH)


def _truncate(text: str | None, width: int) -> str:
    if not text:
        return "-"
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _row(e: DeadLetterEntry) -> tuple[str, ...]:
    i = e.info
    return (
        f"{e.partition}@{e.offset}",
        e.original_coordinates or "-",
        _exception(e),
        "-" if i.attempts is None else str(i.attempts),
        i.consumer_group or "-",
        _time(i.original_timestamp),
        _time(e.timestamp),
        "yes" if e.replayed else "-",
        _truncate(i.exception_message, _MESSAGE_WIDTH),
    )


def _table(entries: Sequence[DeadLetterEntry]) -> str:
    rows = [_COLUMNS, *(_row(e) for e in entries)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(_COLUMNS) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(r, widths)), r[-1]]).rstrip() for r in rows]
    return "\n".join(lines)


def _json(entries: Sequence[DeadLetterEntry], stacktrace: bool) -> str:
    # One JSON array (valid even when empty), one record per line so it also reads and greps well.
    if not entries:
        return "[]"
    body = ",\n".join(json.dumps(e.to_dict(stacktrace=stacktrace)) for e in entries)
    return f"[\n{body}\n]"


def _fail(command: str, message: str, code: int = 1) -> int:
    print(f"kafkatx dlq {command}: {message}", file=sys.stderr)
    return code


def _servers(args: argparse.Namespace) -> str | None:
    try:
        return resolve_bootstrap_servers(args.bootstrap_servers or dict(args.config).get("bootstrap.servers"))
    except DlqToolError as exc:
        _fail(args.dlq_command, str(exc), EX_USAGE)
        return None


def _client_config(args: argparse.Namespace) -> dict[str, str]:
    return {k: v for k, v in args.config if k != "bootstrap.servers"}


# -- commands --------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:
    servers = _servers(args)
    if servers is None:
        return EX_USAGE
    try:
        entries = inspect_dlq(
            servers, args.topic, filters=args.filters, config=_client_config(args), idle_timeout=args.timeout
        )
    except DlqToolError as exc:
        return _fail("inspect", str(exc))
    shown = entries if args.limit is None else entries[: args.limit]
    if args.json:
        print(_json(shown, args.stacktrace))
        return 0
    what = "matching record(s)" if args.filters else "record(s)"
    if not entries:
        print(f"no dead-lettered {what.replace('(s)', 's')} in {args.topic}")
        return 0
    print(_table(shown))
    more = f", first {len(shown)} shown" if len(shown) < len(entries) else ""
    print(f"\n{len(entries)} dead-lettered {what} in {args.topic}{more}; times are UTC")
    passed = sum(1 for e in entries if e.replayed)
    if passed:  # the replay group's offsets say how far it went, not which records a --filter skipped
        print(
            f"REPLAYED yes: {passed} record(s) behind the offsets of replay group {default_replay_group(args.topic)}, "
            "so `kafkatx dlq replay` will not take them again (replayed, or skipped by its --filter)"
        )
    return 0


def _replay(args: argparse.Namespace) -> int:
    servers = _servers(args)
    if servers is None:
        return EX_USAGE
    group = args.group or default_replay_group(args.topic)

    def show(entry: DeadLetterEntry, target: str | None) -> None:
        if target is not None:
            print(f"would replay {entry.coordinates} ({entry.original_coordinates or 'no original topic'}) -> {target}")

    progress = not args.no_progress and sys.stderr.isatty()
    try:
        result = replay_dlq(
            servers,
            args.topic,
            to=args.to,
            filters=args.filters,
            group=group,
            dry_run=args.dry_run,
            batch_size=args.batch_size,
            limit=args.limit,
            config=_client_config(args),
            progress=progress,
            on_record=show if args.dry_run else None,
            idle_timeout=args.timeout,
            force=args.force,
        )
    except DlqToolError as exc:
        return _fail("replay", str(exc))
    except KeyboardInterrupt:
        return _fail(
            "replay", "interrupted; committed batches stay replayed, run the same command again to resume", 130
        )
    print(_summary(result))
    return 0


def _summary(r: ReplayResult) -> str:
    verb = "would replay" if r.dry_run else "replayed"
    lines = [f"{verb} {r.replayed} record(s) from {r.topic} (group {r.group})"]
    lines += [f"  -> {topic}: {n}" for topic, n in r.per_topic.items()]
    if r.skipped:
        lines.append(
            f"{'would skip' if r.dry_run else 'skipped'} {r.skipped} record(s) that did not match the filters; "
            f"the group moves past them, so replay them later with another --group"
        )
    if r.dry_run and r.skipped and not r.replayed:
        lines.append("no record matches the filters: the replay refuses to skip them all without --force")
    if r.dry_run:
        lines.append("dry run: nothing was produced and no offsets were committed")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    d = sub.add_parser("dlq", help="inspect and replay dead-letter topics")
    dsub = d.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    fields = "; ".join(f"{name}: {what}" for name, what in FILTER_FIELDS.items())

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("topic", metavar="TOPIC", help="the dead-letter topic")
        p.add_argument(
            "--bootstrap-servers",
            help=f"Kafka bootstrap servers (default: ${ENV_BOOTSTRAP}, else `kafkatx broker` on 127.0.0.1:9092)",
        )
        p.add_argument(
            "--filter",
            dest="filters",
            action="append",
            type=_filter_arg,
            default=[],
            metavar="FIELD=VALUE",
            help=f"only records matching all filters (repeatable): FIELD=VALUE, FIELD!=VALUE, FIELD~=REGEX. {fields}",
        )
        p.add_argument(
            "-X",
            "--config",
            action="append",
            type=_config_arg,
            default=[],
            metavar="KEY=VALUE",
            help="librdkafka client setting, e.g. -X security.protocol=SASL_SSL (repeatable)",
        )
        p.add_argument(
            "--timeout", type=float, default=30.0, help="seconds without progress before giving up (default 30)"
        )

    i = dsub.add_parser("inspect", help="list dead-lettered records: where they came from and why they failed")
    common(i)
    i.add_argument("--json", action="store_true", help="print a JSON array, one record object per line")
    i.add_argument("--stacktrace", action="store_true", help="with --json: include the exception stacktrace")
    i.add_argument("--limit", type=_positive, default=None, help="show the first N records (by partition, offset)")
    i.set_defaults(func=_inspect)

    r = dsub.add_parser("replay", help="re-publish dead-lettered records to their original topic, exactly once")
    common(r)
    r.add_argument("--to", metavar="TOPIC", help="publish to this topic instead of each record's original topic")
    r.add_argument(
        "--group", help="replay group whose offsets on the DLT say where to resume (default kafkatx-dlq-replay.TOPIC)"
    )
    r.add_argument("--dry-run", action="store_true", help="list what would be replayed; produce and commit nothing")
    r.add_argument(
        "--force",
        action="store_true",
        help="with --filter: move the group past the records even when none matches (refused without it)",
    )
    r.add_argument("--batch-size", type=_positive, default=500, help="records per transaction (default 500)")
    r.add_argument(
        "--limit", type=_positive, default=None, help="stop after replaying N records (the rest wait for the next run)"
    )
    r.add_argument(
        "--no-progress", action="store_true", help="no progress bar (it is also off when stderr is not a terminal)"
    )
    r.set_defaults(func=_replay)
