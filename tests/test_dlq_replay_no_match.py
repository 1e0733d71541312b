"""``kafkatx dlq replay --filter`` that matches nothing refuses to move the replay group past every record (issue 42,
item 10): a misspelt filter value would otherwise skip the whole dead-letter topic for that group."""

from __future__ import annotations

import pytest

from kafkatx import Record
from kafkatx.cli import main
from kafkatx.dlq.headers import dead_letter_headers
from kafkatx.dlq.tools import default_replay_group, replay_dlq
from kafkatx.testing import KafkaTestKit

Capture = pytest.CaptureFixture[str]


def _dead_letter(topic: str, offset: int, value: bytes, exc: BaseException) -> dict[str, object]:
    """The dead letter kafkatx's recoverer writes for ``topic``/0@``offset``."""
    failed = Record(topic=topic, partition=0, offset=offset, key=None, value=value)
    return {"value": value, "headers": dead_letter_headers(failed, exc, group_id="orders-svc", attempts=3)}


def _dead_letters(kafka: KafkaTestKit, count: int, exc: BaseException) -> tuple[str, str]:
    """A DLT holding ``count`` dead letters of a new topic's records 0.., failed with ``exc``; (original, DLT)."""
    original, dlt = kafka.topic(), kafka.topic()
    kafka.produce(dlt, [_dead_letter(original, n, b"v%d" % n, exc) for n in range(count)])
    return original, dlt


def test_a_filter_that_matches_nothing_is_refused_and_moves_nothing(kafka: KafkaTestKit, capsys: Capture) -> None:
    original, dlt = _dead_letters(kafka, 3, ValueError("bad"))
    args = ["dlq", "replay", dlt, "--bootstrap-servers", kafka.bootstrap_servers, "--no-progress"]
    assert main([*args, "--filter", "exception=ValueErorr"]) == 1
    err = capsys.readouterr().err
    assert f"no record of {dlt!r} matches the filters (3 record(s) read, none replayed)" in err, err
    assert "pass --force" in err
    assert kafka.committed(default_replay_group(dlt), dlt) == {}, "the replay group did not move"
    assert main(args) == 0, "a replay without the filter still finds every record"
    assert kafka.values(original) == [b"v0", b"v1", b"v2"]


def test_force_skips_every_record(kafka: KafkaTestKit, capsys: Capture) -> None:
    original, dlt = _dead_letters(kafka, 3, ValueError("bad"))
    args = ["dlq", "replay", dlt, "--bootstrap-servers", kafka.bootstrap_servers, "--no-progress"]
    assert main([*args, "--filter", "exception=TimeoutError", "--force"]) == 0
    assert "skipped 3 record(s)" in capsys.readouterr().out
    assert kafka.committed(default_replay_group(dlt), dlt) == kafka.end_offsets(dlt)
    assert kafka.read(original) == []


def test_a_dry_run_says_the_replay_would_be_refused(kafka: KafkaTestKit, capsys: Capture) -> None:
    _, dlt = _dead_letters(kafka, 2, ValueError("bad"))
    args = ["dlq", "replay", dlt, "--bootstrap-servers", kafka.bootstrap_servers, "--no-progress", "--dry-run"]
    assert main([*args, "--filter", "exception=TimeoutError"]) == 0
    assert "refuses to skip them all without --force" in capsys.readouterr().out


def test_skipped_batches_before_the_first_match_commit_with_it(kafka: KafkaTestKit) -> None:
    original, dlt = _dead_letters(kafka, 3, ValueError("bad"))
    kafka.produce(dlt, [_dead_letter(original, 9, b"late", TimeoutError("slow"))])
    result = replay_dlq(kafka.bootstrap_servers, dlt, filters=["exception=TimeoutError"], batch_size=1)
    assert (result.replayed, result.skipped) == (1, 3)
    assert kafka.values(original) == [b"late"]
    assert kafka.committed(default_replay_group(dlt), dlt) == kafka.end_offsets(dlt)
