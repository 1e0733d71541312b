"""``retry="topics"`` with ``ordering="key"`` (the default, issue 40): a record whose key has a record in retry
follows it through the retry topics without spending an attempt, so each key's outputs come out in input order,
exactly once, across levels, a dead-lettered head and a restart (the keys in retry rebuilt from the topics)."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from helpers import make_app
from tenacity import wait_exponential

from kafkatx import App, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import PartitionsAssigned, PartitionsRevoked, RecordFollowed, RecordsInRetry
from kafkatx.metrics import instrument
from kafkatx.retry_topics.headers import ATTEMPTS
from kafkatx.testing import KafkaTestKit, running, wait_for

TOPICS: dict[str, Any] = {"retry": "topics"}  # ordering="key", the default


class Transient(Exception):
    """A failure worth retrying."""


def _by_key(records: list[Any]) -> dict[bytes, list[bytes]]:
    """Values per key, in the order their partition holds them."""
    out: dict[bytes, list[bytes]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        out[r.key or b""].append(r.value or b"")
    return dict(out)


def _followed(kafka: KafkaTestKit, topics: list[str]) -> list[bytes]:
    """The values written to retry topics as followers (no failure of their own named)."""
    return [
        r.value or b""
        for topic in topics
        for r in kafka.read(topic)
        if parse_dead_letter_headers(r.headers).exception_fqcn is None
    ]


@pytest.mark.parametrize("fencing", ["group", "partition"])
def test_each_keys_outputs_come_out_in_input_order_across_retry_levels_each_exactly_once(
    kafka: KafkaTestKit, fencing: str
) -> None:
    """Four keys on two partitions; some records fail at attempts 1-2 (exponential back-off: 0.2 s then 0.4 s, in
    two retry topics), with later records of their key behind them. With ``fencing="partition"`` each partition's
    transaction has a producer of its own, and one may begin while another commits."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    keys = [b"a", b"b", b"c", b"d"]
    inputs = [{"key": k, "value": b"%s-%d" % (k, i), "partition": n % 2} for i in range(6) for n, k in enumerate(keys)]
    flaky = {b"a-0", b"a-3", b"b-1", b"c-4", b"x-0"}  # d never fails: it runs as without key order
    kafka.produce(src, [{"value": b"x-0", "partition": 0}, *inputs, {"value": b"x-1", "partition": 0}])
    app = make_app(kafka)
    attempts: dict[bytes, list[int]] = defaultdict(list)
    handled: list[bytes] = []
    lock = threading.Lock()

    @app.listener(
        src,
        output=out,
        max_attempts=4,
        backoff=wait_exponential(multiplier=0.2, max=10),
        dlq=True,
        fencing=fencing,
        **TOPICS,
    )
    def handle(record: Record) -> tuple[bytes | None, bytes]:
        value = record.value or b""
        with lock:
            attempts[value].append(record.attempt)
        if value in flaky and record.attempt < 3:
            raise Transient(f"{value!r} attempt {record.attempt}")
        with lock:
            handled.append(value)
        return record.key, b"out-" + value

    with running(app):
        wait_for(lambda: len(handled) == len(inputs) + 2, 60, message="every record handled")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="every input offset committed")
    expected = {k: [b"out-%s-%d" % (k, i) for i in range(6)] for k in keys}
    outputs = kafka.read(out)
    assert sorted(r.value or b"" for r in outputs if r.key is None) == [b"out-x-0", b"out-x-1"]
    assert [v for v in handled if v.startswith(b"x")] == [b"x-1", b"x-0"], "no key, no key order: x-1 passed x-0"
    keyed = [r for r in outputs if r.key is not None]
    assert Counter(r.value for r in keyed) == Counter(v for vs in expected.values() for v in vs), "exactly once"
    assert _by_key(keyed) == expected, "each key's outputs in input order"
    for k in keys:
        assert [v for v in handled if v.startswith(k)] == [b"%s-%d" % (k, i) for i in range(6)], k
    assert {v: a for v, a in attempts.items() if v in flaky} == dict.fromkeys(flaky, [1, 2, 3])
    assert all(attempts[v] == [1] for v in attempts if v not in flaky), "a follower spends no attempt"
    followed = _followed(kafka, [src + "-retry-200", src + "-retry-400"])
    assert {b"a-1", b"b-2", b"c-5"} <= set(followed), "the records behind a failed one followed it"
    assert not any(v.startswith((b"d", b"x")) for v in followed), "no key, or nothing in retry: it never follows"
    assert kafka.read(src + "-dlt") == []


def test_a_head_dead_lettered_after_its_last_attempt_releases_its_followers_in_order(kafka: KafkaTestKit) -> None:
    """Also the events and metrics: each follow (once per hop of the head), the records in retry."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [{"key": b"k", "value": v} for v in (b"always", b"next-1", b"next-2")])
    kafka.produce(src, [{"key": b"j", "value": b"other"}])
    app = make_app(kafka)
    metrics = instrument(app)
    calls: list[tuple[bytes, int]] = []
    followed: list[RecordFollowed] = []
    in_retry: list[int] = []
    app.on(RecordFollowed)(followed.append)
    app.on(RecordsInRetry)(lambda event: in_retry.append(event.records))

    @app.listener(src, output=out, max_attempts=3, backoff=0.3, dlq=True, **TOPICS)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls.append((value, record.attempt))
        if value == b"always":
            raise Transient("never works")
        return b"out-" + value

    with running(app):
        wait_for(lambda: len(kafka.read(out)) == 3, 30, message="three outputs")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="every input offset committed")
    assert calls.index((b"other", 1)) < calls.index((b"always", 2)), "another key does not wait"
    k_calls = [c for c in calls if c[0] != b"other"]
    assert k_calls == [(b"always", 1), (b"always", 2), (b"always", 3), (b"next-1", 1), (b"next-2", 1)], k_calls
    assert sorted(r.value or b"" for r in kafka.read(out)) == [b"out-next-1", b"out-next-2", b"out-other"]
    assert [r.value for r in kafka.read(out) if r.value != b"out-other"] == [b"out-next-1", b"out-next-2"]
    [dead] = kafka.read(src + "-dlt")
    info = parse_dead_letter_headers(dead.headers)
    assert (dead.value, info.original_topic, info.original_offset, info.attempts) == (b"always", src, 0, 3)
    values = [e.record.value if e.record else None for e in followed]
    assert values == [b"next-1", b"next-2"] * 2, "they followed its first hop, then moved behind its second"
    assert {e.topic for e in followed} == {src + "-retry"}
    assert max(in_retry) == 3 and in_retry[-1] == 0, in_retry
    labels = {"app": app.name, "listener": followed[0].listener}
    assert metrics.registry.get_sample_value("kafkatx_records_followed_total", labels) == 4
    assert metrics.registry.get_sample_value("kafkatx_records_in_retry", labels) == 0


def test_a_typed_key_is_gated_by_its_bytes_so_its_later_records_follow_in_order(kafka: KafkaTestKit) -> None:
    """``key_type=``: the handler sees decoded keys, while the keys in retry and the gate go by the key's bytes (the
    gate runs before decoding); a record of a key in retry follows it, a record of another key does not."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [{"key": b"k", "value": v} for v in (b"first", b"second")] + [{"key": b"j", "value": b"x"}])
    app = make_app(kafka)
    calls: list[tuple[str, bytes, int]] = []
    followed: list[RecordFollowed] = []
    app.on(RecordFollowed)(followed.append)

    @app.listener(src, output=out, max_attempts=2, backoff=0.3, dlq=True, key_type=str, **TOPICS)
    def handle(record: Record) -> bytes:
        calls.append((record.key, record.raw_value or b"", record.attempt))
        if record.raw_value == b"first" and record.attempt == 1:
            raise Transient("once")
        return b"out-" + (record.raw_value or b"")

    with running(app):
        wait_for(lambda: len(kafka.read(out)) == 3, 30, message="three outputs")
    assert [c for c in calls if c[0] == "k"] == [("k", b"first", 1), ("k", b"first", 2), ("k", b"second", 1)], calls
    assert [e.record.raw_value for e in followed if e.record] == [b"second"], "followed, by its key's bytes"
    assert [r.value for r in kafka.read(out) if r.value != b"out-x"] == [b"out-first", b"out-second"]


def test_a_restart_rebuilds_the_keys_in_retry_from_the_topics_order_kept_nothing_lost_or_doubled(
    kafka: KafkaTestKit,
) -> None:
    """The first App stops with k's head in retry (due 4 s after its failure) and two followers behind it; a
    record of k written while it was down must follow too in the second App, which knows only the topics."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [{"key": b"k", "value": v} for v in (b"head", b"f-1", b"f-2")])
    seen: dict[bytes, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def handler(record: Record) -> tuple[bytes | None, bytes]:
        with lock:
            seen[record.value or b""].append(record.attempt)
        if record.value == b"head" and record.attempt < 2:
            raise Transient("not yet")
        return record.key, b"out-" + (record.value or b"")

    options: dict[str, Any] = {"output": out, "max_attempts": 3, "backoff": 4.0, "dlq": True, **TOPICS}
    first = make_app(kafka, name="key-restart")
    first.listener(src, **options)(handler)
    with running(first):
        wait_for(lambda: kafka.caught_up(first.group_id, src), 30, message="every input offset committed")
    hops = kafka.read(src + "-retry")
    assert [h.value for h in hops] == [b"head", b"f-1", b"f-2"], "stopped with the head and two followers in retry"
    assert [int.from_bytes(h.header(ATTEMPTS) or b"", "big") for h in hops] == [2, 1, 1]
    assert dict(seen) == {b"head": [1]}
    kafka.produce(src, [{"key": b"k", "value": b"late"}, {"key": b"j", "value": b"free"}])
    second = App(first.name, bootstrap_servers=kafka.bootstrap_servers, group_id=first.group_id, instance_id="other")
    second.listener(src, **options)(handler)
    started = time.monotonic()
    with running(second):
        wait_for(lambda: len(kafka.read(out)) == 5, 60, message="five outputs")
        wait_for(lambda: kafka.caught_up(second.group_id, src), 30, message="every input offset committed")
    outputs = kafka.read(out)
    assert Counter(r.value for r in outputs) == Counter(
        [b"out-head", b"out-f-1", b"out-f-2", b"out-late", b"out-free"]
    ), "each exactly once"
    assert _by_key(outputs)[b"k"] == [b"out-head", b"out-f-1", b"out-f-2", b"out-late"], "the late record followed"
    assert dict(seen) == {b"head": [1, 2], b"f-1": [1], b"f-2": [1], b"late": [1], b"free": [1]}, "no attempt again"
    assert time.monotonic() - started < 30
    assert b"late" in _followed(kafka, [src + "-retry"]), "it followed through the retry topic"


def test_a_rebalance_moves_the_keys_in_retry_with_their_partition(kafka: KafkaTestKit) -> None:
    """A second App joins while each partition has a key's head in retry (it fails 3 times, 8 s apart) and a
    follower: the new owner of a partition rebuilds its keys from the retry topics, so a record of the key
    written after the move follows too, and every key's outputs come out once, in input order."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    keys = {0: b"k0", 1: b"k1"}
    kafka.produce(src, [{"key": k, "value": k + v, "partition": p} for p, k in keys.items() for v in (b"-head", b"-f")])
    group = make_app(kafka).group_id
    seen: dict[bytes, list[int]] = defaultdict(list)
    followed: list[bytes] = []
    owned: list[set[tuple[str, int]]] = [set(), set()]
    lock = threading.Lock()

    def handler(record: Record) -> tuple[bytes | None, bytes]:
        value = record.value or b""
        with lock:
            seen[value].append(record.attempt)
        if value.endswith(b"-head") and record.attempt < 4:
            raise Transient("not yet")
        return record.key, b"out-" + value

    apps = [App(group, bootstrap_servers=kafka.bootstrap_servers, group_id=group, instance_id=f"m{i}") for i in (0, 1)]
    for i, app in enumerate(apps):
        app.listener(src, output=out, max_attempts=4, backoff=8.0, dlq=True, **TOPICS)(handler)
        app.on(RecordFollowed)(lambda event: followed.append(event.record.value if event.record else b""))
        app.on(PartitionsAssigned)(lambda event, i=i: owned[i].update(event.partitions))
        app.on(PartitionsRevoked)(lambda event, i=i: owned[i].difference_update(event.partitions))
    with running(apps[0]):
        wait_for(lambda: len(kafka.read(src + "-retry")) == 4, 30, message="both heads and followers in retry")
        with running(apps[1]):
            wait_for(lambda: owned[1] & {(src, 0), (src, 1)}, 60, message="the newcomer owns a partition")
            wait_for(lambda: not owned[0] & owned[1], 60, message="nobody owns a partition twice")
            kafka.produce(src, [{"key": k, "value": k + b"-late", "partition": p} for p, k in keys.items()])
            wait_for(lambda: len(kafka.read(out)) == 6, 90, message="six outputs")
    assert {b"k0-late", b"k1-late"} <= set(followed), "the late records followed, on either member"
    by_key = _by_key(kafka.read(out))
    assert by_key == {k: [b"out-" + k + v for v in (b"-head", b"-f", b"-late")] for k in keys.values()}
    assert {v: a for v, a in seen.items() if v.endswith(b"-head")} == {
        b"k0-head": [1, 2, 3, 4],
        b"k1-head": [1, 2, 3, 4],
    }
    assert all(a == [1] for v, a in seen.items() if not v.endswith(b"-head")), "no follower spent an attempt"
