"""`kafkatx dlq inspect|replay` and kafkatx.dlq.tools, against the local broker."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from collections import Counter
from typing import Any

import pytest

from kafkatx import App, Record
from kafkatx.cli import main
from kafkatx.dlq.headers import dead_letter_headers
from kafkatx.dlq.tools import (
    REPLAYED_FROM,
    DlqToolError,
    default_replay_group,
    inspect_dlq,
    parse_filter,
    replay_dlq,
)
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

Capture = pytest.CaptureFixture[str]
T0 = 1_700_000_000_000  # 2023-11-14 22:13:20 UTC


def _dead_letter(
    kafka: KafkaTestKit,
    dlt: str,
    original: str,
    count: int,
    *,
    exc: BaseException | None = None,
    first_offset: int = 0,
    partitions: int = 1,
    attempts: int = 3,
    group: str = "orders-svc",
) -> list[dict]:
    """Write dead-letter records for ``original``/offsets ``first_offset``.. the way kafkatx's recoverer does.

    The record at original offset n has key ``k<n>``, value ``v<n>`` and header trace-id ``t<n>``.
    """
    items = []
    for n in range(first_offset, first_offset + count):
        failed = Record(
            topic=original,
            partition=n % partitions,
            offset=n,
            key=b"k%d" % n,
            value=b"v%d" % n,
            headers=[("trace-id", b"t%d" % n)],
            timestamp=T0 + n,
        )
        error = exc or ValueError(f"bad amount in record {n}")
        headers = dead_letter_headers(failed, error, group_id=group, attempts=attempts)
        items.append({"key": failed.key, "value": failed.value, "headers": headers})
    kafka.produce(dlt, items)
    return items


def _spring_headers(topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    """Headers as Spring's DeadLetterPublishingRecoverer writes them (Java ints and longs, no attempts header)."""
    return [
        ("kafka_dlt-original-topic", topic.encode()),
        ("kafka_dlt-original-partition", struct.pack(">i", partition)),
        ("kafka_dlt-original-offset", struct.pack(">q", offset)),
        ("kafka_dlt-original-timestamp", struct.pack(">q", T0)),
        ("kafka_dlt-original-timestamp-type", b"CreateTime"),
        ("kafka_dlt-original-consumer-group", b"java-orders"),
        ("kafka_dlt-exception-fqcn", b"org.springframework.kafka.listener.ListenerExecutionFailedException"),
        ("kafka_dlt-exception-cause-fqcn", b"java.lang.IllegalStateException"),
        (
            "kafka_dlt-exception-message",
            b"Listener failed; nested exception is java.lang.IllegalStateException: no stock",
        ),
        (
            "kafka_dlt-exception-stacktrace",
            b"java.lang.IllegalStateException: no stock\n\tat Orders.handle(Orders.java:42)",
        ),
    ]


def _cli(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KAFKATX_BOOTSTRAP_SERVERS"}
    return subprocess.run(
        [sys.executable, "-m", "kafkatx", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


# -- inspect ---------------------------------------------------------------------


def test_inspect_table_shows_where_records_came_from_and_why_they_failed(kafka: KafkaTestKit, capsys: Capture) -> None:
    dlt, orders = kafka.topic(), unique_name("orders")
    _dead_letter(kafka, dlt, orders, 2, first_offset=41, attempts=3)

    assert main(["dlq", "inspect", dlt, "--bootstrap-servers", kafka.bootstrap_servers]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["DLT", "ORIGINAL", "EXCEPTION", "ATTEMPTS"]
    assert lines[1].startswith("0@0 ")
    assert f"{orders}/0@41" in lines[1] and f"{orders}/0@42" in lines[2]
    assert "ValueError" in lines[1] and "bad amount in record 41" in lines[1]
    assert " 3 " in lines[1] and "orders-svc" in lines[1]
    assert "2023-11-14 22:13:20.041Z" in lines[1]  # original timestamp, human-readable
    # columns are aligned: every row has its MESSAGE cell where the header has it
    col = lines[0].index("MESSAGE")
    assert lines[1][col:].startswith("bad amount in record 41") and lines[2][col:].startswith("bad amount in record 42")
    assert f"2 dead-lettered record(s) in {dlt}" in out


def test_inspect_truncates_long_messages_and_keeps_one_line_per_record(kafka: KafkaTestKit, capsys: Capture) -> None:
    dlt = kafka.topic()
    _dead_letter(kafka, dlt, "orders", 1, exc=RuntimeError("first line\nsecond line " + "x" * 200))
    assert main(["dlq", "inspect", dlt, "--bootstrap-servers", kafka.bootstrap_servers]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "first line second line" in row and row.endswith("...") and "x" * 100 not in row


def test_inspect_json_from_the_command_line(kafka: KafkaTestKit) -> None:
    dlt = kafka.topic(partitions=2)
    _dead_letter(kafka, dlt, "orders", 1, exc=KeyError("sku"), first_offset=7, attempts=2)

    proc = _cli(["dlq", "inspect", dlt, "--bootstrap-servers", kafka.bootstrap_servers, "--json"])
    assert proc.returncode == 0, proc.stderr
    [rec] = json.loads(proc.stdout)
    assert rec["original_topic"] == "orders" and rec["original_partition"] == 0 and rec["original_offset"] == 7
    assert rec["exception"] == "builtins.KeyError" and "sku" in rec["exception_message"]
    assert rec["attempts"] == 2 and rec["consumer_group"] == "orders-svc"
    assert rec["original_timestamp"] == T0 + 7  # ms in JSON
    assert isinstance(rec["dlt_timestamp"], int) and rec["dlt_timestamp"] > T0
    assert rec["dlt_topic"] == dlt and rec["dlt_offset"] == 0 and rec["key"] == "k7" and rec["value"] == "v7"
    assert "exception_stacktrace" not in rec


def test_inspect_json_of_an_empty_topic_is_an_empty_array(kafka: KafkaTestKit, capsys: Capture) -> None:
    dlt = kafka.topic()
    assert main(["dlq", "inspect", dlt, "--bootstrap-servers", kafka.bootstrap_servers, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_unknown_topic_is_a_clear_error_with_non_zero_exit(bootstrap_servers: str) -> None:
    missing = unique_name("no-such-dlt")
    proc = _cli(["dlq", "inspect", missing, "--bootstrap-servers", bootstrap_servers])
    assert proc.returncode == 1
    assert f"topic '{missing}' does not exist" in proc.stderr
    assert proc.stdout == ""


def test_missing_bootstrap_servers_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: Capture) -> None:
    monkeypatch.delenv("KAFKATX_BOOTSTRAP_SERVERS", raising=False)
    assert main(["dlq", "replay", "orders-dlt"]) == 64
    assert "no bootstrap servers" in capsys.readouterr().err


def test_bootstrap_servers_come_from_the_environment(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch, capsys: Capture
) -> None:
    dlt = kafka.topic()
    _dead_letter(kafka, dlt, "orders", 1)
    monkeypatch.setenv("KAFKATX_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    assert main(["dlq", "inspect", dlt, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1


def test_bad_filter_is_rejected_with_the_reason(capsys: Capture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["dlq", "inspect", "orders-dlt", "--filter", "colour=red"])
    assert info.value.code == 2
    assert "unknown field 'colour'" in capsys.readouterr().err
    reasons = {
        "exception": "expected FIELD=VALUE",
        "message~=(": "invalid regular expression",
        "partition=one": "integer N or a range",
        "offset=..": "integer N or a range",
        "attempts~=3": "is a number",
        "key=": "empty",
    }
    for bad, reason in reasons.items():
        with pytest.raises(ValueError, match=reason):
            parse_filter(bad)


def test_inspect_filters(kafka: KafkaTestKit) -> None:
    dlt = kafka.topic()
    _dead_letter(kafka, dlt, "orders", 4, partitions=2)  # ValueError, orders/{0,1,0,1}@{0..3}
    _dead_letter(kafka, dlt, "payments", 2, exc=TimeoutError("gateway timed out"), attempts=5)
    entries = inspect_dlq(kafka.bootstrap_servers, dlt)

    def offsets(*filters: Any) -> list[int]:
        checks = [parse_filter(f) if isinstance(f, str) else f for f in filters]
        return [e.offset for e in entries if all(check(e) for check in checks)]

    assert offsets() == [0, 1, 2, 3, 4, 5]
    assert offsets("exception=ValueError") == [0, 1, 2, 3]
    assert offsets("exception!=ValueError") == [4, 5]
    assert offsets("topic=payments") == [4, 5]
    assert offsets("topic=pay") == []  # topic is exact
    assert offsets("topic=orders", "partition=1") == [1, 3]  # filters combine with AND
    assert offsets("offset=1..2", "topic=orders") == [1, 2]
    assert offsets("attempts=4..") == [4, 5]
    assert offsets("message~=record [13]$") == [1, 3]
    assert offsets("message=timed out") == [4, 5]
    assert offsets("key=k1") == [1, 5]
    assert offsets("group=other") == []
    assert offsets(lambda e: e.offset % 2 == 0) == [0, 2, 4]  # Python callers may pass a function
    # inspect_dlq applies them while reading (and stops at limit)
    found = inspect_dlq(kafka.bootstrap_servers, dlt, filters=["exception=ValueError", "partition=1"], limit=1)
    assert [e.offset for e in found] == [1]
    with pytest.raises(DlqToolError, match="unknown field 'colour'"):
        inspect_dlq(kafka.bootstrap_servers, dlt, filters=["colour=red"])


def test_inspect_decodes_records_written_by_spring(kafka: KafkaTestKit, capsys: Capture) -> None:
    dlt = kafka.topic()
    kafka.produce(dlt, [{"key": b"o-1", "value": b"{}", "headers": _spring_headers("orders", 2, 123_456_789_012)}])

    [entry] = inspect_dlq(kafka.bootstrap_servers, dlt)
    assert entry.info.original_topic == "orders"
    assert entry.info.original_partition == 2 and entry.info.original_offset == 123_456_789_012
    assert entry.info.original_timestamp == T0 and entry.info.consumer_group == "java-orders"
    assert entry.info.exception_cause_fqcn == "java.lang.IllegalStateException" and entry.info.attempts is None

    bs = kafka.bootstrap_servers
    assert main(["dlq", "inspect", dlt, "--bootstrap-servers", bs, "--filter", "exception=IllegalState"]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "orders/2@123456789012" in row and "IllegalStateException (via ListenerExecutionF..." in row
    assert "java-orders" in row


# -- replay ----------------------------------------------------------------------


def test_replay_republishes_each_record_exactly_once(kafka: KafkaTestKit) -> None:
    orders, dlt = kafka.topic(partitions=3), kafka.topic(partitions=2)
    _dead_letter(kafka, dlt, orders, 7, partitions=3)
    bs = kafka.bootstrap_servers
    key_at = {e.coordinates: e.key for e in inspect_dlq(bs, dlt)}

    result = replay_dlq(bs, dlt, batch_size=3)
    assert (result.replayed, result.skipped, result.per_topic) == (7, 0, {orders: 7})

    replayed = kafka.read(orders)
    assert sorted((r.key, r.value) for r in replayed) == [(b"k%d" % i, b"v%d" % i) for i in range(7)]
    for r in replayed:
        i = int(r.key[1:])
        assert r.partition == i % 3  # back on its original partition
        names = [k for k, _ in r.headers]
        assert r.header("trace-id") == b"t%d" % i  # the record's own headers survive
        assert not [k for k in names if k.startswith(("kafka_dlt-", "kafkatx_dlt-"))]
        assert names.count(REPLAYED_FROM) == 1 and key_at[(r.header(REPLAYED_FROM) or b"").decode()] == r.key
    group = default_replay_group(dlt)
    assert kafka.committed(group, dlt) == kafka.end_offsets(dlt) == result.committed

    again = replay_dlq(bs, dlt)
    assert (again.replayed, again.skipped, again.transactions) == (0, 0, 0)
    assert len(kafka.read(orders)) == 7


def test_replay_resumes_after_a_failure_mid_batch(kafka: KafkaTestKit) -> None:
    orders, dlt = kafka.topic(), kafka.topic()
    _dead_letter(kafka, dlt, orders, 8)
    seen: list[int] = []

    def crash_on_fifth(entry: object, target: str | None) -> None:
        seen.append(1)
        if len(seen) == 5:  # in the second batch of three
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        replay_dlq(kafka.bootstrap_servers, dlt, batch_size=3, on_record=crash_on_fifth)
    assert [r.value for r in kafka.read(orders)] == [b"v0", b"v1", b"v2"]  # the first batch only
    assert kafka.committed(default_replay_group(dlt), dlt) == {0: 3}

    result = replay_dlq(kafka.bootstrap_servers, dlt, batch_size=3)
    assert result.replayed == 5
    assert [r.value for r in kafka.read(orders)] == [b"v%d" % i for i in range(8)]  # no duplicate, none lost


def test_a_killed_replay_is_fenced_and_its_open_transaction_aborted(kafka: KafkaTestKit) -> None:
    orders, dlt = kafka.topic(), kafka.topic()
    _dead_letter(kafka, dlt, orders, 6)
    script = textwrap.dedent(
        f"""
        import os, time
        from kafkatx.dlq.tools import replay_dlq
        from kafkatx.testing import KafkaTestKit
        n = 0
        def hook(entry, target):
            global n
            n += 1
            if n == 4:  # the 2nd batch is open: once its first record is in the log, die
                kafka, deadline = KafkaTestKit({kafka.bootstrap_servers!r}), time.monotonic() + 30
                while len(kafka.read({orders!r}, isolation="read_uncommitted")) < 3 and time.monotonic() < deadline:
                    time.sleep(0.05)
                os._exit(9)
        replay_dlq({kafka.bootstrap_servers!r}, {dlt!r}, batch_size=2, on_record=hook)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert len(kafka.read(orders, isolation="read_uncommitted")) >= 3  # the dead run left an open transaction
    assert len(kafka.read(orders)) == 2

    result = replay_dlq(kafka.bootstrap_servers, dlt, batch_size=2)  # fences the dead producer, resumes at 2
    assert result.replayed == 4
    values = [r.value for r in kafka.read(orders)]
    assert sorted(values) == [b"v%d" % i for i in range(6)]


def test_a_second_replay_of_the_same_group_fences_the_first(kafka: KafkaTestKit) -> None:
    orders, dlt = kafka.topic(), kafka.topic()
    _dead_letter(kafka, dlt, orders, 6)
    inner: list[int] = []

    def start_another_replay(entry: object, target: str | None) -> None:
        if not inner:  # while the first run has batch 1 open, a second run starts and finishes
            inner.append(replay_dlq(kafka.bootstrap_servers, dlt, batch_size=2).replayed)

    with pytest.raises(DlqToolError, match="another replay with the same group started and took over"):
        replay_dlq(kafka.bootstrap_servers, dlt, batch_size=2, on_record=start_another_replay)
    assert inner == [6]
    assert sorted(kafka.values(orders)) == [b"v%d" % i for i in range(6)]  # the fenced run added nothing


def test_replay_limit_stops_early_and_the_next_run_continues(kafka: KafkaTestKit) -> None:
    orders, dlt = kafka.topic(), kafka.topic()
    _dead_letter(kafka, dlt, orders, 5)
    assert replay_dlq(kafka.bootstrap_servers, dlt, limit=2).replayed == 2
    assert len(kafka.read(orders)) == 2
    assert replay_dlq(kafka.bootstrap_servers, dlt).replayed == 3
    assert sorted(kafka.values(orders)) == [b"v%d" % i for i in range(5)]


def test_replay_to_another_topic_with_a_filter(kafka: KafkaTestKit, capsys: Capture) -> None:
    orders, retry, dlt = kafka.topic(), kafka.topic(partitions=2), kafka.topic()
    _dead_letter(kafka, dlt, orders, 3)  # ValueError: offsets 0..2
    _dead_letter(kafka, dlt, orders, 2, exc=TimeoutError("slow"), first_offset=3)  # offsets 3..4
    group = unique_name("replay")

    code = main(
        [
            "dlq",
            "replay",
            dlt,
            "--bootstrap-servers",
            kafka.bootstrap_servers,
            "--to",
            retry,
            "--filter",
            "exception=TimeoutError",
            "--group",
            group,
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert f"replayed 2 record(s) from {dlt} (group {group})" in out and f"-> {retry}: 2" in out
    assert "skipped 3 record(s)" in out
    assert sorted(kafka.values(retry)) == [b"v3", b"v4"]
    assert kafka.read(orders) == []
    # skipped records are behind the group too: a second run with the same group has nothing left to do
    assert kafka.committed(group, dlt) == kafka.end_offsets(dlt)
    assert replay_dlq(kafka.bootstrap_servers, dlt, to=retry, group=group).replayed == 0
    # another group starts from the beginning and can pick up the skipped ones
    other = replay_dlq(kafka.bootstrap_servers, dlt, filters=["exception=ValueError"], group=unique_name("replay"))
    assert (other.replayed, other.skipped) == (3, 2)
    assert sorted(kafka.values(orders)) == [b"v0", b"v1", b"v2"]


def test_dry_run_lists_but_produces_and_commits_nothing(kafka: KafkaTestKit, capsys: Capture) -> None:
    orders, dlt = kafka.topic(), kafka.topic()
    _dead_letter(kafka, dlt, orders, 3)
    assert main(["dlq", "replay", dlt, "--bootstrap-servers", kafka.bootstrap_servers, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"would replay {dlt}/") == 3 and f"{dlt}/0@2 ({orders}/0@2) -> {orders}" in out
    assert "would replay 3 record(s)" in out and "nothing was produced" in out
    assert kafka.read(orders, isolation="read_uncommitted") == []
    assert kafka.committed(default_replay_group(dlt), dlt) == {}
    assert replay_dlq(kafka.bootstrap_servers, dlt).replayed == 3  # a real run still has everything to do


def test_record_without_original_topic_is_an_error_naming_it(kafka: KafkaTestKit) -> None:
    orders, dlt = kafka.topic(), kafka.topic()
    _dead_letter(kafka, dlt, orders, 2)
    kafka.produce(dlt, [{"key": b"x", "value": b"orphan"}])  # offset 2: no dead-letter headers at all
    group = unique_name("replay")

    with pytest.raises(DlqToolError, match=rf"{dlt}/0@2 has no kafka_dlt-original-topic header"):
        replay_dlq(kafka.bootstrap_servers, dlt, group=group, batch_size=10)
    assert kafka.read(orders, isolation="read_committed") == []  # its batch was aborted as a whole
    assert kafka.committed(group, dlt) == {}

    # either send it somewhere explicitly, or filter it out (it is then skipped, not lost silently)
    result = replay_dlq(kafka.bootstrap_servers, dlt, group=group, filters=["topic~=."])
    assert (result.replayed, result.skipped) == (2, 1)


def test_replay_to_a_missing_topic_fails_before_producing(kafka: KafkaTestKit, capsys: Capture) -> None:
    dlt = kafka.topic()
    _dead_letter(kafka, dlt, unique_name("gone"), 1)
    assert main(["dlq", "replay", dlt, "--bootstrap-servers", kafka.bootstrap_servers]) == 1
    assert "original topic of" in capsys.readouterr().err
    assert (
        main(["dlq", "replay", dlt, "--bootstrap-servers", kafka.bootstrap_servers, "--to", unique_name("nope")]) == 1
    )
    assert "replay target topic" in capsys.readouterr().err
    assert kafka.committed(default_replay_group(dlt), dlt) == {}


def test_records_dead_lettered_by_an_app_can_be_inspected_and_replayed(kafka: KafkaTestKit, capsys: Capture) -> None:
    orders, out = kafka.topic(), kafka.topic()
    dlt = kafka.topic(name=f"{orders}-dlt")
    name = unique_name("app")

    def make_app(failing: bool) -> App:
        app = App(name, bootstrap_servers=kafka.bootstrap_servers, instance_id="x")

        @app.listener(orders, output=out, max_attempts=1, dlq=True, backoff=0)
        def handle(record: Record) -> bytes:
            if failing:
                raise ValueError(f"cannot handle {record.value!r}")
            return record.value or b""

        return app

    kafka.produce(orders, [(b"a", b"1"), (b"b", b"2")])
    with running(make_app(failing=True)):
        wait_for(lambda: len(kafka.read(dlt)) == 2, timeout=30, message="2 dead-lettered records")
    entries = inspect_dlq(kafka.bootstrap_servers, dlt)
    assert [(e.info.original_topic, e.info.original_offset, e.info.attempts) for e in entries] == [
        (orders, 0, 1),
        (orders, 1, 1),
    ]
    assert entries[0].info.consumer_group == name and "cannot handle" in (entries[0].info.exception_message or "")

    assert main(["dlq", "replay", dlt, "--bootstrap-servers", kafka.bootstrap_servers]) == 0
    assert f"replayed 2 record(s) from {dlt}" in capsys.readouterr().out
    # the DLT was written in transactions: the group's offsets must still reach the end (past the markers)
    assert kafka.committed(default_replay_group(dlt), dlt) == kafka.end_offsets(dlt)
    assert [e.replayed for e in entries] == [False, False]
    assert [e.replayed for e in inspect_dlq(kafka.bootstrap_servers, dlt)] == [True, True], (
        "inspect marks replayed records"
    )
    assert main(["dlq", "inspect", dlt, "--bootstrap-servers", kafka.bootstrap_servers]) == 0
    table = capsys.readouterr().out
    assert "REPLAYED" in table and table.count(" yes ") == 2, table
    with running(make_app(failing=False)):
        wait_for(lambda: sorted(kafka.values(out)) == [b"1", b"2"], timeout=30, message="replayed records processed")
    assert Counter(r.header(REPLAYED_FROM) is not None for r in kafka.read(orders)) == Counter({False: 2, True: 2})


def test_dlq_inspect_says_what_replayed_means(
    kafka: KafkaTestKit, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafkatx.cli import main

    monkeypatch.setenv("KAFKATX_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    dlt, target = kafka.topic(), kafka.topic()
    kafka.produce(dlt, [(b"k1", b"v1"), (b"k2", b"v2"), (b"k3", b"v3")])
    assert main(["dlq", "replay", dlt, "--to", target, "--filter", "key=k2", "--no-progress"]) == 0
    assert "skipped 2 record(s)" in capsys.readouterr().out
    assert main(["dlq", "inspect", dlt]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"0@\d", line)]
    assert [row[-2:] for row in rows] == [["yes", "-"]] * 3, out  # REPLAYED, then the (absent) message
    assert (
        f"REPLAYED yes: 3 record(s) behind the offsets of replay group kafkatx-dlq-replay.{dlt}" in out
        and "skipped by its --filter" in out
    ), out
