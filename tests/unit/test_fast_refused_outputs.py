"""An output the broker refuses fails the input record that produced it (issue 28 part 2), without a broker.

The fake producer refuses, at commit, every transaction that produced the
value ``TOO-BIG``, as the broker does with a record larger than the topic's
``max.message.bytes``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message
from fakes import FakeHost, FakeProducer, listener, messages

from kafkatx import InvalidConfigurationError, KafkaClientError, OutputRefusedError, Record
from kafkatx.client.producer import TransactionalProducer
from kafkatx.errors.classification import RECORD_REFUSAL_CODES, ErrorClass, classify
from kafkatx.events import RecordRecovered
from kafkatx.rollback.classifier import ExceptionClassifier

BIG = b"TOO-BIG"


def refusal(code: int = KafkaError.MSG_SIZE_TOO_LARGE) -> OutputRefusedError:
    return OutputRefusedError(error=KafkaError(code), operation="commit_transaction", topic="out", partition=0)


class RefusingProducer(FakeProducer):
    """Refuses, at commit, a transaction that produced ``TOO-BIG``."""

    def commit(self, guard: Any = None, meanwhile: Any = None) -> None:
        if any(value == BIG for _, value in self._current.produced):
            self.calls.append("commit")
            raise refusal()
        super().commit(guard)


def _host(**options: Any) -> FakeHost:
    def handle(record: Record) -> bytes:
        return BIG if record.value == b"b" else (record.value or b"").upper()

    return FakeHost(listener(handle, **options), RefusingProducer())


def test_a_refused_output_of_a_unit_of_one_record_sends_that_record_to_the_recoverer() -> None:
    host = _host()
    host.runner()(host.unit(messages(b"b")))
    (recovered,) = host.events_of(RecordRecovered)
    assert recovered.record.value == b"b" and isinstance(recovered.exception, OutputRefusedError)
    assert recovered.record.attempt == 1, "not retryable by default: recovered at its first failure"
    assert [t.outcome for t in host.producer.transactions] == ["aborted", "committed"]
    assert host.producer.committed_values == []
    assert host.producer.committed_offsets == {("in", 0): 1}, "its offset commits with the recovery"


def test_a_refused_output_of_a_unit_of_several_records_is_found_one_record_per_transaction() -> None:
    host = _host()
    batch = messages(b"a", b"b", b"c")
    host.runner()(host.unit(batch))
    assert host.producer.committed_values == [], "the refused transaction is aborted"
    assert host.events_of(RecordRecovered) == [], "not blamed on any record yet"
    assert host.crash_guard.careful == {("in", 0): 3}, "the unit's records are run one per transaction"
    assert (("in", 0), 0) in host.seeks, "and fetched again"

    runner = host.runner()
    assert host.crash_guard.run_careful(batch, runner) == [], "each record's transaction commits"

    assert host.producer.committed_values == [b"A", b"C"], "the batch-mates commit, once each"
    assert host.producer.committed_offsets == {("in", 0): 3}
    (recovered,) = host.events_of(RecordRecovered)
    assert recovered.record.value == b"b" and isinstance(recovered.exception, OutputRefusedError)
    assert host.crash_guard.careful == {}, "the search ends once the unit's range is committed"


def test_a_listener_that_cannot_run_records_one_at_a_time_stops_with_a_clear_message() -> None:
    host = _host(count_crashes=False)
    with pytest.raises(InvalidConfigurationError, match="count_crashes") as stopped:
        host.runner()(host.unit(messages(b"a", b"b")))
    assert stopped.value.code_name == "MSG_SIZE_TOO_LARGE"
    assert host.producer.committed_values == [] and host.events_of(RecordRecovered) == []


def test_the_exception_names_topic_and_broker_error_is_not_retryable_and_pickles() -> None:
    exc = refusal()
    assert "out[0]" in str(exc) and "MSG_SIZE_TOO_LARGE" in str(exc) and "max.message.bytes" in str(exc)
    assert isinstance(exc, KafkaClientError) and classify(exc) is ErrorClass.HANDLER_FAILURE
    assert ExceptionClassifier().is_retryable(exc) is False
    again = pickle.loads(pickle.dumps(exc))
    assert (type(again), str(again), again.topic, again.partition, again.code_name) == (
        OutputRefusedError,
        str(exc),
        "out",
        0,
        "MSG_SIZE_TOO_LARGE",
    )


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, True),
        (KafkaError.INVALID_RECORD, True),
        (KafkaError.RECORD_LIST_TOO_LARGE, True),
        (KafkaError.INVALID_TIMESTAMP, True),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, False),  # a permission: the App stops
        (KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT, False),  # the topic's format, the same for every record
    ],
    ids=lambda v: KafkaError(v).name() if isinstance(v, int) and not isinstance(v, bool) else str(v),
)
def test_a_delivery_report_decides_between_the_records_failure_and_a_stop(code: int, refused: bool) -> None:
    producer = TransactionalProducer({"bootstrap.servers": "127.0.0.1:1"}, "probe", retry_timeout=1.0)
    report = producer._config["on_delivery"]  # the delivery callback librdkafka would call
    report(KafkaError(code), Message(topic="out", partition=2, offset=-1, key=None, value=b"x"))
    failure = producer.transaction_failure()
    assert (code in RECORD_REFUSAL_CODES) is refused
    if refused:
        assert isinstance(failure, OutputRefusedError) and (failure.topic, failure.partition) == ("out", 2)
    else:
        assert isinstance(failure, InvalidConfigurationError) and "out[2]" in str(failure)
