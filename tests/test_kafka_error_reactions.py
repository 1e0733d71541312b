"""The KIP-1050 reactions against the real local broker, where fencing, read_committed and
transactional offset commits are enforced (the mock cluster in test_fault_injection.py enforces
none of them).

- APPLICATION_RECOVERABLE: a second producer takes over the container's transactional.id in the
  middle of a batch. The container must recreate its producer, rewind to the committed offsets and
  carry on, so that the output topic (read_committed) holds every expected output exactly once and
  the committed offsets reach the end of the input.
- A refused output (a null key on a compacted topic) is not a configuration error: the record
  that produced it fails (dead-lettered), the rest commits. A listener that cannot run records one
  per transaction (count_crashes=False) cannot tell which record it was: the container stops,
  naming the cause, and nothing of that transaction is visible or committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from kafkatx import App, ApplicationRecoverableError, InvalidConfigurationError, Output, OutputRefusedError, Record
from kafkatx.events import (
    ContainerStopped,
    Event,
    HandlerFailed,
    KafkaErrorHandled,
    ProducerRecreated,
    RecordRecovered,
    TransactionAborted,
    TransactionCommitted,
)
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

pytestmark = pytest.mark.timeout(90)

_QUIET = {"log_level": 2}
_FENCED_CODES = {"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH"}


def _quiet_app(kafka: KafkaTestKit, prefix: str) -> App:
    """An App with short timeouts and librdkafka's logs limited to errors (the tests cause plenty)."""
    return App(
        unique_name(prefix),
        bootstrap_servers=kafka.bootstrap_servers,
        instance_id="w1",
        transaction_timeout_ms=10_000,
        shutdown_timeout=15.0,
        config=dict(_QUIET),
    )


@pytest.mark.parametrize("fencing", ["group", "partition"])
def test_fenced_mid_batch_recreates_the_producer_and_keeps_exactly_once(kafka: KafkaTestKit, fencing: str) -> None:
    src = kafka.topic(partitions=1)
    dst = kafka.topic(partitions=1)
    app = _quiet_app(kafka, "fenced")
    txn_id = (
        app.group_transactional_id(app.group_id, 0)
        if fencing == "group"
        else app.partition_transactional_id(app.group_id, src, 0)
    )
    lock = threading.Lock()
    calls: list[Record] = []
    events: list[Event] = []
    intruders: list[Producer] = []

    def handle(record: Record) -> bytes:
        with lock:
            calls.append(record)
        if record.value == b"v7" and not intruders:
            # Another producer takes over the container's transactional.id while its transaction
            # (with the outputs of the records before v7 in this batch) is open: the coordinator
            # bumps the epoch and aborts that transaction.
            intruder = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": txn_id, **_QUIET})
            intruder.init_transactions(10)
            intruders.append(intruder)
        return b"out-" + (record.value or b"")

    app.add_listener(handle, src, output=dst, name="h", fencing=fencing)
    app.on(Event)(lambda e: events.append(e))

    def committed_records() -> int:
        return sum(e.records for e in list(events) if isinstance(e, TransactionCommitted))

    try:
        with running(app, timeout=15):
            kafka.produce(src, [b"v%d" % i for i in range(5)])
            wait_for(lambda: committed_records() >= 5, 20, message="the first 5 records committed")
            assert kafka.committed(app.group_id, src) == {0: 5}
            kafka.produce(src, [b"v%d" % i for i in range(5, 10)])
            wait_for(lambda: committed_records() >= 10 or app.failure is not None, 30, message="all 10 records")
            assert app.failure is None, repr(app.failure)
            # Keeps processing with the new producer.
            kafka.produce(src, [b"v10"])
            wait_for(lambda: committed_records() >= 11, 20, message="the record after the fencing")
    finally:
        for intruder in intruders:
            intruder.flush(0)

    assert len(intruders) == 1
    recreated = [e for e in events if isinstance(e, ProducerRecreated)]
    assert len(recreated) == 1, recreated
    assert recreated[0].transactional_id == txn_id
    assert isinstance(recreated[0].error, ApplicationRecoverableError)
    assert recreated[0].error.code_name in _FENCED_CODES
    handled = [e for e in events if isinstance(e, KafkaErrorHandled)]
    assert [(e.error_class, e.action) for e in handled] == [("APPLICATION_RECOVERABLE", "recreate producer")]
    assert not [e for e in events if isinstance(e, (TransactionAborted, HandlerFailed))]
    assert [e.reason for e in events if isinstance(e, ContainerStopped)] == ["normal"]

    values = [r.value for r in calls]
    assert values.count(b"v7") == 2, "the fenced record was processed again after the rewind"
    assert all(values.count(b"v%d" % i) == 1 for i in range(5)), "committed records were not reprocessed"
    assert {r.attempt for r in calls} == {1}, "fencing is not a handler failure"

    # Exactly once: every output is visible once to read_committed readers...
    expected = sorted(b"out-v%d" % i for i in range(11))
    assert sorted(kafka.values(dst)) == expected
    # ...while the transaction the intruder aborted is in the log, but not visible.
    uncommitted = kafka.values(dst, isolation="read_uncommitted")
    assert set(uncommitted) == set(expected)
    # The committed offsets reach the end of the input: nothing lost, nothing pending.
    assert kafka.committed(app.group_id, src) == kafka.end_offsets(src) == {0: 11}

    # The container's new producer fenced the intruder in turn.
    intruder = intruders[0]
    intruder.begin_transaction()
    intruder.produce(dst, b"zombie")
    with pytest.raises(KafkaException) as info:
        intruder.commit_transaction(10)
    err: KafkaError = info.value.args[0]
    assert err.fatal(), err
    assert err.name() in _FENCED_CODES
    assert b"zombie" not in kafka.values(dst)


def test_kafkatx_run_exits_78_when_an_input_topic_is_missing(kafka: KafkaTestKit, tmp_path: Path) -> None:
    missing = unique_name("missing")
    dst = kafka.topic()
    (tmp_path / "reaction_cli_app.py").write_text(
        textwrap.dedent(
            f"""
            from kafkatx import App

            app = App({unique_name("cli")!r}, instance_id="cli", config={{"log_level": 2}})

            @app.listener({missing!r}, output={dst!r})
            def handle(record):
                return record.value
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kafkatx",
            "run",
            "reaction_cli_app:app",
            "--bootstrap-servers",
            kafka.bootstrap_servers,
            "--no-status",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "kafkatx run: configuration error:" in proc.stderr
    assert f"topic {missing!r} does not exist" in proc.stderr
    assert "create_topics=True" in proc.stderr, "the message says how to fix it"
    # The broker auto-created nothing.
    assert _topic_missing(kafka, missing)


def _topic_missing(kafka: KafkaTestKit, topic: str) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, **_QUIET})
    return topic not in admin.list_topics(timeout=10).topics


def _compacted_output_app(
    kafka: KafkaTestKit, slow_key: bytes | None = None, **options: Any
) -> tuple[App, str, str, list[Event], list[Record]]:
    src = kafka.topic(partitions=1)
    dst = kafka.topic(partitions=1, config={"cleanup.policy": "compact"})
    app = _quiet_app(kafka, "badout")
    events: list[Event] = []
    calls: list[Record] = []

    def handle(record: Record) -> Output:
        calls.append(record)
        if slow_key is not None and record.key == slow_key:
            time.sleep(0.2)  # the output before it in the batch is refused meanwhile
        return Output(b"out-" + (record.value or b""), key=record.key)  # no key: refused on a compacted topic

    app.add_listener(handle, src, output=dst, name="h", **options)
    app.on(Event)(lambda e: events.append(e))
    return app, src, dst, events, calls


def _assert_stopped_on_invalid_record(app: App, events: list[Event]) -> None:
    assert app.wait(20), "the container did not stop"
    failure = app.failure
    assert isinstance(failure, InvalidConfigurationError), repr(failure)
    assert failure.code_name == "INVALID_RECORD"
    assert "compacted topic" in str(failure) and "non-null key" in str(failure)
    assert "count_crashes" in str(failure), "why the record could not be found"
    assert [e.reason for e in events if isinstance(e, ContainerStopped)] == ["config"]
    assert not [e for e in events if isinstance(e, ProducerRecreated)], "no restart loop"


def test_a_refused_output_fails_its_record_and_the_container_goes_on(kafka: KafkaTestKit) -> None:
    app, src, dst, events, calls = _compacted_output_app(kafka)
    app.start()
    try:
        kafka.produce(src, [(b"k1", b"v1")])
        wait_for(lambda: any(isinstance(e, TransactionCommitted) for e in list(events)), 20, message="k1 committed")
        kafka.produce(src, [(None, b"v2"), (b"k3", b"v3")])
        wait_for(lambda: app.failure is not None or kafka.caught_up(app.group_id, src), 20, message="caught up")
        assert app.failure is None, app.failure
    finally:
        app.stop(timeout=15)
    recovered = [e for e in events if isinstance(e, RecordRecovered)]
    assert [(e.record.value, type(e.exception).__name__) for e in recovered] == [(b"v2", "OutputRefusedError")]
    assert isinstance(recovered[0].exception, OutputRefusedError)
    assert recovered[0].exception.code_name == "INVALID_RECORD"
    assert kafka.values(dst) == [b"out-v1", b"out-v3"], "the refused transaction is not visible; v3 once"
    assert not [e for e in events if isinstance(e, ProducerRecreated)], "no restart loop"


def test_refused_output_in_a_multi_record_batch_stops_a_listener_that_cannot_isolate_records(
    kafka: KafkaTestKit,
) -> None:
    app, src, dst, events, calls = _compacted_output_app(kafka, slow_key=b"k3", count_crashes=False)
    app.start()
    try:
        kafka.produce(src, [(b"k1", b"v1"), (None, b"v2"), (b"k3", b"v3")])
        _assert_stopped_on_invalid_record(app, events)
    finally:
        app.stop(timeout=15)
    assert kafka.values(dst) == []
    assert kafka.committed(app.group_id, src).get(0, 0) == 0, "nothing past the refused batch"
