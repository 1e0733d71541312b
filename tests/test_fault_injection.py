"""Fault injection: how a running listener container reacts to each KIP-1050 error class.

Errors are pushed onto librdkafka's mock cluster (:class:`MockCluster`) per
request type while a real App runs against it. The mock does not honour
read_committed, producer fencing or transactional offset commits, so these
tests assert client-side behaviour only: the class kafkatx saw (events,
``app.failure``), its reaction (retries, the abort, the producer recreated,
the container stopped) and that processing carries on afterwards.
Exactly-once under fencing is proven on the local broker in
``test_kafka_error_reactions.py``.

What librdkafka 2.16 does with each injected error (it decides what kafkatx
gets to see) is pinned in ``test_mock_cluster.py`` and in the comments here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

import kafkatx.producer as producer_module
from kafkatx import (
    App,
    ApplicationRecoverableError,
    ContainerError,
    FencedTooOftenError,
    InvalidConfigurationError,
    OutputRefusedError,
    Record,
    StuckCallError,
    TransactionAbortableError,
)
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
from kafkatx.testing import running, unique_name, wait_for
from kafkatx.testing.mock_cluster import ApiKey, MockCluster

pytestmark = [
    pytest.mark.timeout(60),
    # confluent-kafka's close() of a replaced producer whose commit is still in flight.
    pytest.mark.filterwarnings("ignore:Producer abort_transaction failed during close:RuntimeWarning"),
]

E = KafkaError
# Client logs at CRITICAL only: the injected errors are expected.
_QUIET = {"log_level": 2}
_FAST_RECONNECT = {"reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 200}
_FENCED_CODES = {"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH"}

EV = TypeVar("EV", bound=Event)


# --------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _closers() -> Iterator[list[threading.Thread]]:
    threads: list[threading.Thread] = []
    yield threads
    for thread in threads:
        thread.join(10)


@pytest.fixture
def mc(_closers: list[threading.Thread]) -> Iterator[MockCluster]:
    """A fresh mock cluster per test: clients a test leaves behind (a replaced producer can still
    finish its commit in the background) must not eat the next test's injected errors."""
    cluster = MockCluster()
    try:
        yield cluster
    finally:
        # Destroying a mock cluster often takes a second; do it while the next test runs.
        closer = threading.Thread(target=cluster.close, name="mock-cluster-close", daemon=True)
        closer.start()
        _closers.append(closer)


def code_of(error: BaseException | None) -> str | None:
    return getattr(error, "code_name", None)


class Harness:
    """One App with one listener (``src`` -> ``dst``) on the mock cluster, and what it did.

    ``hold_on``: the first handler call for that value blocks until
    :meth:`release`, so a test can inject errors after its input was produced
    (the Produce error stack is shared with the test's own input producer).
    ``slow``: every handler call for that value takes 0.2 s, so that the
    outputs of the records before it in the batch are answered meanwhile.
    """

    def __init__(
        self,
        mc: MockCluster,
        *,
        hold_on: bytes | None = None,
        slow: bytes | None = None,
        app_options: dict[str, Any] | None = None,
        **listener_options: Any,
    ) -> None:
        self.mc = mc
        self.src = mc.create_topic(unique_name("in"))
        self.dst = mc.create_topic(unique_name("out"))
        self._lock = threading.Lock()
        self.events: list[Event] = []
        self.calls: list[Record] = []
        self.events_before_call: list[int] = []
        self.hold_on = hold_on
        self.slow = slow
        self.entered = threading.Event()
        self.released = threading.Event()
        self._input: Producer | None = None
        options: dict[str, Any] = {"transaction_timeout_ms": 10_000, "shutdown_timeout": 10.0, **(app_options or {})}
        self.app = App(
            unique_name("fi"),
            bootstrap_servers=mc.bootstrap_servers,
            instance_id="test",
            config=dict(_QUIET),
            # The mock holds an empty fetch for fetch.wait.max.ms (default 500 ms).
            consumer_config={**_FAST_RECONNECT, "fetch.wait.max.ms": 10},
            producer_config=dict(_FAST_RECONNECT),
            **options,
        )
        self.app.on(Event)(self._record)
        # count_crashes=False: these tests script the faults of the first data transaction; crash
        # counting would put a claim transaction before it (its own reactions are tested below).
        listener_options.setdefault("count_crashes", False)
        self.app.add_listener(self._handle, self.src, output=self.dst, name="h", **listener_options)

    @property
    def transactional_id(self) -> str:
        return self.app.group_transactional_id(self.app.group_id, 0)

    def _record(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def _handle(self, record: Record) -> bytes:
        with self._lock:
            self.calls.append(record)
            self.events_before_call.append(len(self.events))
            hold = record.value == self.hold_on and not self.entered.is_set()
            if hold:
                self.entered.set()
        if hold:
            assert self.released.wait(15), "the test never released the handler"
        if record.value == self.slow:
            time.sleep(0.2)
        return b"out-" + (record.value or b"")

    # -- driving ------------------------------------------------------------
    def produce(self, *values: bytes) -> None:
        if self._input is None:
            self._input = Producer({"bootstrap.servers": self.mc.bootstrap_servers, "linger.ms": 0, **_QUIET})
        for value in values:
            self._input.produce(self.src, value)
        assert self._input.flush(5) == 0, "input not delivered"

    def hold(self) -> None:
        assert self.entered.wait(15), "the handler was never called"

    def release(self) -> None:
        self.released.set()

    def fail_output_of_a(self, *codes: int) -> None:
        """Commit a warm-up record, then have the broker refuse the output of record ``a``.

        Needs ``hold_on=b"a"`` and a running App. The warm-up transaction makes the producer
        look up its coordinators, and the refusal is answered 300 ms late, so the error
        reliably reaches kafkatx at commit_transaction (with a fresh producer, librdkafka
        sometimes reports a delivery failure racing send_offsets_to_transaction as ``_STATE``).
        """
        assert self.hold_on == b"a"
        self.produce(b"warm-up")
        self.wait_committed(1)
        self.produce(b"a")
        self.hold()
        self.mc.push_broker_request_errors(1, ApiKey.PRODUCE, *[(code, 300) for code in codes])
        self.release()

    # -- observing ----------------------------------------------------------
    def of(self, kind: type[EV]) -> list[EV]:
        with self._lock:
            return [e for e in self.events if isinstance(e, kind)]

    def index_of(self, kind: type[Event]) -> int:
        with self._lock:
            return next(i for i, e in enumerate(self.events) if isinstance(e, kind))

    def values_seen(self) -> list[bytes | None]:
        with self._lock:
            return [r.value for r in self.calls]

    def attempts_seen(self) -> set[int]:
        with self._lock:
            return {r.attempt for r in self.calls}

    def committed_records(self) -> int:
        return sum(e.records for e in self.of(TransactionCommitted))

    def wait_committed(self, records: int, timeout: float = 15.0) -> None:
        wait_for(
            lambda: self.committed_records() >= records or self.app.failure is not None,
            timeout,
            message=f"{records} committed record(s)",
        )
        assert self.app.failure is None, f"the container stopped: {self.app.failure!r}"

    def handled(self, action: str | None = None) -> list[KafkaErrorHandled]:
        return [e for e in self.of(KafkaErrorHandled) if action is None or e.action == action]

    def retries(self) -> list[KafkaErrorHandled]:
        return [e for e in self.of(KafkaErrorHandled) if e.action.startswith("retry #")]

    def assert_keeps_processing(self) -> None:
        """A new record after the fault is handled once, as a first attempt, and committed.

        The commit looked for is the first one after the new record's handler call: a recovery
        transaction still committing when this starts must not be taken for it.
        """
        with self._lock:
            before_calls = len(self.calls)
        self.produce(b"after")

        def commit_after_the_call() -> TransactionCommitted | None:
            with self._lock:
                marks = [
                    m
                    for r, m in zip(self.calls[before_calls:], self.events_before_call[before_calls:])
                    if r.value == b"after"
                ]
                later = self.events[marks[0] :] if marks else []
            return next((e for e in later if isinstance(e, TransactionCommitted)), None)

        wait_for(
            lambda: commit_after_the_call() is not None or self.app.failure is not None, 15, message="after committed"
        )
        assert self.app.failure is None, f"the container stopped: {self.app.failure!r}"
        with self._lock:
            later_calls = self.calls[before_calls:]
        assert [(r.value, r.attempt) for r in later_calls] == [(b"after", 1)]
        committed = commit_after_the_call()
        assert committed is not None and (committed.records, committed.outputs) == (1, 1)


def assert_stopped_for_configuration(h: Harness, code: str, operation: str | set[str], hints: list[str]) -> None:
    assert h.app.wait(15), "the container did not stop"
    failure = h.app.failure
    assert isinstance(failure, InvalidConfigurationError), repr(failure)
    assert failure.code_name == code
    ops = {operation} if isinstance(operation, str) else operation
    assert failure.operation in ops
    message = str(failure)
    assert message.startswith(f"{code} in {failure.operation}: "), message
    for hint in hints:
        assert hint.lower() in message.lower(), f"{hint!r} not in {message!r}"
    assert "invalid configuration" in message
    stopped = h.of(ContainerStopped)
    assert [(e.reason, e.error) for e in stopped] == [("config", failure)]
    assert not h.app.containers[0].alive
    # No retry loop, no abort-and-reprocess, no producer restart, nothing committed.
    assert h.of(ProducerRecreated) == []
    assert h.of(TransactionAborted) == []
    assert h.retries() == []


class ClientProbe:
    """What kafkatx's transactional producers did: ``commits`` holds each commit_transaction
    outcome ("ok" or the error name), ``calls`` the order of init_transactions outcomes and
    list_topics calls. ``before_next_commit`` runs (once) before the next commit_transaction."""

    def __init__(self) -> None:
        self.commits: list[str] = []
        self.calls: list[str] = []
        self.before_next_commit: Callable[[], None] | None = None


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> ClientProbe:
    recorded = ClientProbe()

    def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
        try:
            return "ok", fn()
        except KafkaException as exc:
            return exc.args[0].name(), exc

    class ProbedProducer(Producer):  # type: ignore[misc]
        def commit_transaction(self, *args: Any) -> None:
            hook, recorded.before_next_commit = recorded.before_next_commit, None
            if hook is not None:
                hook()
            name, result = outcome(lambda: super(ProbedProducer, self).commit_transaction(*args))
            recorded.commits.append(name)
            if isinstance(result, BaseException):
                raise result

        def init_transactions(self, *args: Any) -> None:
            name, result = outcome(lambda: super(ProbedProducer, self).init_transactions(*args))
            recorded.calls.append(f"init_transactions:{name}")
            if isinstance(result, BaseException):
                raise result

        def list_topics(self, *args: Any, **kwargs: Any) -> Any:
            recorded.calls.append("list_topics")
            return super().list_topics(*args, **kwargs)

    monkeypatch.setattr(producer_module, "Producer", ProbedProducer)
    return recorded


# --------------------------------------------------------------------------
# RETRIABLE / REFRESH_RETRIABLE
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "codes"),
    [
        (ApiKey.END_TXN, [E.CONCURRENT_TRANSACTIONS] * 3),
        (ApiKey.END_TXN, [E.NOT_COORDINATOR] * 3),
        (ApiKey.ADD_PARTITIONS_TO_TXN, [E.CONCURRENT_TRANSACTIONS] * 3),
        (ApiKey.ADD_OFFSETS_TO_TXN, [E.COORDINATOR_LOAD_IN_PROGRESS] * 3),
        (ApiKey.TXN_OFFSET_COMMIT, [E.NOT_COORDINATOR] * 2),
        (ApiKey.INIT_PRODUCER_ID, [E.COORDINATOR_LOAD_IN_PROGRESS] * 3),
        (ApiKey.PRODUCE, [E.NOT_LEADER_FOR_PARTITION] * 2),
    ],
    ids=lambda v: v.name if isinstance(v, ApiKey) else f"{E(v[0]).name()}x{len(v)}",
)
def test_retriable_errors_are_retried_and_never_reach_the_handler(
    mc: MockCluster, api: ApiKey, codes: list[int]
) -> None:
    # librdkafka retries all of these itself: the transactional call just takes longer.
    gated = api is ApiKey.PRODUCE
    h = Harness(mc, hold_on=b"a" if gated else None)
    mc.start_request_tracking()
    if not gated:
        mc.push_request_errors(api, *codes)
    with running(h.app):
        h.produce(b"a")
        if gated:
            h.hold()
            mc.clear_requests()
            mc.push_request_errors(api, *codes)
            h.release()
        h.wait_committed(1)
        assert len(mc.requests_for(api)) >= len(codes) + 1, "each refused request was sent again"
        assert h.values_seen() == [b"a"], "the handler ran once: no abort, no reprocessing"
        assert h.attempts_seen() == {1}
        assert h.of(TransactionAborted) == []
        assert h.of(ProducerRecreated) == []
        assert h.of(HandlerFailed) == []
        # librdkafka retries these itself; if a call runs out of time meanwhile, kafkatx calls it
        # again, and nothing else.
        assert all(
            e.action.startswith("retry #") and e.error_class in {"RETRIABLE", "REFRESH_RETRIABLE"} for e in h.handled()
        )
        if api is not ApiKey.INIT_PRODUCER_ID:
            # One producer all along (requests before the gate were cleared).
            assert len(mc.requests_for(ApiKey.INIT_PRODUCER_ID)) == (0 if gated else 1)
        h.assert_keeps_processing()


def test_refresh_retriable_init_error_refreshes_metadata_and_retries(mc: MockCluster, probe: ClientProbe) -> None:
    # librdkafka retries InitProducerId itself (2-3 times a second here), then init_transactions
    # gives up with the last error when its timeout expires: ~2 s of NOT_COORDINATOR here.
    mc.push_request_errors(ApiKey.INIT_PRODUCER_ID, *[E.NOT_COORDINATOR] * 6)
    h = Harness(mc)
    with running(h.app):
        h.produce(b"a")
        h.wait_committed(1)
        retries = h.retries()
        assert retries, "kafkatx retried init_transactions"
        assert {(e.error_class, e.extra.get("code")) for e in retries} == {("REFRESH_RETRIABLE", "NOT_COORDINATOR")}
        inits = [c for c in probe.calls if c.startswith("init_transactions")]
        assert inits[0] == "init_transactions:NOT_COORDINATOR" and inits[-1] == "init_transactions:ok"
        first_ok = probe.calls.index("init_transactions:ok")
        assert "list_topics" in probe.calls[:first_ok], "metadata was refreshed before init_transactions was retried"
        assert h.values_seen() == [b"a"]
        assert h.of(ProducerRecreated) == []
        h.assert_keeps_processing()


def test_an_init_that_runs_out_of_retries_fails_with_one_error_and_no_warning(mc: MockCluster) -> None:
    """The init's own error says what happened; closing the half-initialised producer must not add a
    RuntimeWarning about an abort that cannot be (confluent-kafka's, printed to a user's stderr at startup)."""
    import warnings

    from kafkatx.errors import RetriableError
    from kafkatx.producer import TransactionalProducer

    mc.push_request_errors(ApiKey.INIT_PRODUCER_ID, *[E.NOT_COORDINATOR] * 200)  # longer than the retry budget
    txn_id = unique_name("init")
    producer = TransactionalProducer({"bootstrap.servers": mc.bootstrap_servers, **_QUIET}, txn_id, retry_timeout=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RetriableError, match="init_transactions .* still failed with NOT_COORDINATOR") as failed:
            producer.ensure()
    assert [str(w.message) for w in caught] == []
    # Which cluster did not answer, and for which id: at startup that is what the user has to go on.
    assert f"transactional.id {txn_id!r}, bootstrap.servers {mc.bootstrap_servers}" in str(failed.value)
    assert not producer.ready


def test_slow_end_txn_times_out_and_the_commit_is_resumed_not_restarted(mc: MockCluster, probe: ClientProbe) -> None:
    h = Harness(mc)  # transaction_timeout_ms=10000: a 5 s retry budget
    with running(h.app):
        h.produce(b"warm-up")
        h.wait_committed(1)
        probe.commits.clear()
        mc.start_request_tracking()
        # The coordinator answers the next EndTxn only after 2.5 s (half the retry budget).
        mc.push_broker_request_errors(1, ApiKey.END_TXN, (E.NO_ERROR, 2500))
        h.produce(b"a")
        h.wait_committed(2)
        assert probe.commits[0] == "_TIMED_OUT", probe.commits
        assert probe.commits[-1] == "ok"
        assert set(probe.commits[:-1]) == {"_TIMED_OUT"}
        # Calling commit again resumed the commit in flight: one EndTxn reached the broker.
        assert len(mc.requests_for(ApiKey.END_TXN)) == 1
        retries = h.retries()
        assert retries and all(e.error_class == "RETRIABLE" and e.extra == {"code": "_TIMED_OUT"} for e in retries)
        assert len(retries) == len(probe.commits) - 1
        assert h.values_seen() == [b"warm-up", b"a"]
        assert h.of(TransactionAborted) == []
        assert h.of(ProducerRecreated) == []
        h.assert_keeps_processing()


def test_broker_down_during_commit_is_retried_and_commits_without_reprocessing(
    mc: MockCluster, probe: ClientProbe
) -> None:
    h = Harness(mc)  # a 5 s retry budget
    with running(h.app):
        h.produce(b"warm-up")  # metadata, coordinator and output topic are known from here on
        h.wait_committed(1)
        probe.commits.clear()
        committing, proceed = threading.Event(), threading.Event()

        def hold_commit() -> None:
            committing.set()
            proceed.wait(10)

        probe.before_next_commit = hold_commit
        h.produce(b"a")
        assert committing.wait(10), "commit_transaction was never called"
        mc.broker_down()
        proceed.set()
        # Down until a commit attempt has timed out against it; well inside the 5 s budget, it comes back.
        wait_for(lambda: "_TIMED_OUT" in probe.commits, 10, message="a commit attempt timed out")
        assert not h.handled("abort and reprocess the batch"), "the budget ran out before the broker came back"
        mc.broker_up()
        h.wait_committed(2, timeout=20)
        assert probe.commits[0] == "_TIMED_OUT", probe.commits
        assert probe.commits[-1] == "ok"
        assert len(probe.commits) >= 2, "commit_transaction was called again"
        assert any(e.extra == {"code": "_TIMED_OUT"} and e.error_class == "RETRIABLE" for e in h.retries())
        assert h.values_seen() == [b"warm-up", b"a"], "the batch was not reprocessed"
        assert h.of(TransactionAborted) == []
        assert h.of(ProducerRecreated) == []
        # No assert_keeps_processing() here: after the outage, librdkafka 2.16 can block the next
        # send_offsets_to_transaction past its timeout (the cached group coordinator's broker handle
        # was decommissioned; librdkafka issues #5456 and #5511).


def test_commit_retries_that_run_out_become_abortable_and_the_batch_is_reprocessed(
    mc: MockCluster, probe: ClientProbe
) -> None:
    # transaction_timeout_ms=4000: a 2 s retry budget; the broker stays down until it has run out.
    h = Harness(mc, app_options={"transaction_timeout_ms": 4000})
    with running(h.app):
        h.produce(b"warm-up")
        h.wait_committed(1)
        committing, proceed = threading.Event(), threading.Event()

        def hold_commit() -> None:
            committing.set()
            proceed.wait(10)

        probe.before_next_commit = hold_commit
        h.produce(b"a")
        assert committing.wait(10)
        mc.broker_down()
        proceed.set()
        # Down until the budget has run out, the abort failed and the producer was dropped.
        wait_for(lambda: h.of(ProducerRecreated), 20, message="the producer was replaced")
        mc.broker_up()
        h.wait_committed(2, timeout=20)

        exhausted = [e for e in h.handled() if e.operation == "commit_transaction"]
        assert len(exhausted) == 1
        assert exhausted[0].error_class == "ABORTABLE"
        assert isinstance(exhausted[0].error, TransactionAbortableError)
        assert code_of(exhausted[0].error) == "_TIMED_OUT"
        assert "must be aborted (KIP-1050)" in str(exhausted[0].error)
        assert exhausted[0].action == "abort and reprocess the batch"
        # librdkafka refuses abort_transaction while the timed-out commit is still in flight
        # (_CONFLICT "Conflicting commit_transaction API call is already in progress"), so the
        # abort fails, which is application-recoverable: the producer is replaced.
        recreated = h.of(ProducerRecreated)
        assert [code_of(e.error) for e in recreated] == ["_CONFLICT"]
        assert isinstance(recreated[0].error, ApplicationRecoverableError)
        assert recreated[0].error.operation == "abort_transaction"
        # Either way the batch is processed again, as a first attempt, and committed once.
        assert h.values_seen() == [b"warm-up", b"a", b"a"]
        assert h.attempts_seen() == {1}
        assert h.of(HandlerFailed) == []
        assert h.committed_records() == 2
        h.assert_keeps_processing()


# --------------------------------------------------------------------------
# ABORTABLE
# --------------------------------------------------------------------------


def test_end_txn_transaction_abortable_aborts_and_reprocesses_without_using_attempts(mc: MockCluster) -> None:
    # max_attempts=1: had the abort counted as a handler failure, the record would be recovered, not retried.
    h = Harness(mc, max_attempts=1)
    mc.start_request_tracking()
    mc.push_request_errors(ApiKey.END_TXN, E.TRANSACTION_ABORTABLE)
    with running(h.app):
        h.produce(b"a")
        h.wait_committed(1)
        handled = h.handled()
        assert [(e.operation, e.error_class, code_of(e.error), e.action) for e in handled] == [
            ("commit_transaction", "ABORTABLE", "TRANSACTION_ABORTABLE", "abort and reprocess the batch")
        ]
        assert isinstance(handled[0].error, TransactionAbortableError)
        aborted = h.of(TransactionAborted)
        assert [e.records for e in aborted] == [1]
        assert "abortable error" in aborted[0].reason
        assert h.values_seen() == [b"a", b"a"], "the batch was reprocessed from memory"
        assert h.attempts_seen() == {1}, "an abort does not use up the record's attempts"
        assert h.of(HandlerFailed) == [] and h.of(RecordRecovered) == []
        assert h.of(ProducerRecreated) == []
        assert len(mc.requests_for(ApiKey.INIT_PRODUCER_ID)) == 1, "the producer was kept"
        assert len(mc.requests_for(ApiKey.END_TXN)) == 3  # commit (refused), abort, commit
        assert [(e.records, e.outputs) for e in h.of(TransactionCommitted)] == [(1, 1)]
        h.assert_keeps_processing()


@pytest.mark.parametrize(
    ("code", "recreations"),
    [
        # librdkafka bumps the epoch when aborting after UNKNOWN_PRODUCER_ID (KIP-360): a clean retry.
        (E.UNKNOWN_PRODUCER_ID, []),
        # After any other failed produce, the abort keeps the epoch and the next transaction fails with
        # OUT_OF_ORDER_SEQUENCE_NUMBER ("skipped sequence numbers"), which kafkatx treats as
        # application-recoverable: one producer recreation follows the abort.
        (E.TRANSACTION_ABORTABLE, ["OUT_OF_ORDER_SEQUENCE_NUMBER"]),
        pytest.param(E.INVALID_TXN_STATE, ["OUT_OF_ORDER_SEQUENCE_NUMBER"]),
    ],
    ids=lambda v: E(v).name() if isinstance(v, int) else None,
)
def test_produce_abortable_error_aborts_and_reprocesses(mc: MockCluster, code: int, recreations: list[str]) -> None:
    # max_attempts=1: had the abort counted as a handler failure, the record would be recovered, not retried.
    h = Harness(mc, hold_on=b"a", max_attempts=1)
    with running(h.app):
        h.fail_output_of_a(code)
        h.wait_committed(2)
        first = h.handled()[0]
        assert (first.operation, first.error_class, code_of(first.error), first.action) == (
            "commit_transaction",
            "ABORTABLE",
            E(code).name(),
            "abort and reprocess the batch",
        )
        assert isinstance(first.error, TransactionAbortableError)
        assert [e.records for e in h.of(TransactionAborted)] == [1]
        recreated = h.of(ProducerRecreated)
        assert [code_of(e.error) for e in recreated] == recreations
        if recreated:
            assert h.index_of(TransactionAborted) < h.index_of(ProducerRecreated), "aborted first"
        assert h.values_seen() == [b"warm-up"] + [b"a"] * (2 + len(recreations))
        assert h.attempts_seen() == {1}, "an abort does not use up the record's attempts"
        assert h.of(HandlerFailed) == [] and h.of(RecordRecovered) == []
        assert [(e.records, e.outputs) for e in h.of(TransactionCommitted)] == [(1, 1), (1, 1)]
        h.assert_keeps_processing()


def test_produce_abortable_error_in_a_multi_record_batch_aborts_and_reprocesses(mc: MockCluster) -> None:
    # One batch [a, b]: a's output is refused while b's handler runs, so b's output meets a
    # transaction that librdkafka already holds in its abortable state.
    h = Harness(mc, slow=b"b", max_attempts=1)
    h.produce(b"a", b"b")
    mc.push_request_errors(ApiKey.PRODUCE, E.TRANSACTION_ABORTABLE)
    with running(h.app):
        h.wait_committed(2)
        first = h.handled()[0]
        assert (first.error_class, code_of(first.error), first.action) == (
            "ABORTABLE",
            "TRANSACTION_ABORTABLE",
            "abort and reprocess the batch",
        )
        assert [e.records for e in h.of(TransactionAborted)][:1] == [2]
        assert h.index_of(TransactionAborted) < min(
            [i for i, e in enumerate(h.events) if isinstance(e, ProducerRecreated)], default=len(h.events)
        ), "aborted before any producer recreation"
        assert h.values_seen()[:4] == [b"a", b"b", b"a", b"b"], "the whole batch was reprocessed"
        assert h.attempts_seen() == {1}
        assert h.of(HandlerFailed) == [] and h.of(RecordRecovered) == []
        assert h.committed_records() == 2
        h.assert_keeps_processing()


def test_abortable_errors_beyond_max_abortable_retries_recreate_the_producer(mc: MockCluster) -> None:
    h = Harness(mc, max_abortable_retries=2, max_attempts=1)
    mc.start_request_tracking()
    # Each commit is refused and each abort (also an EndTxn) goes through.
    mc.push_request_errors(ApiKey.END_TXN, *[E.TRANSACTION_ABORTABLE, E.NO_ERROR] * 3)
    with running(h.app):
        h.produce(b"a")
        h.wait_committed(1)
        assert len(h.of(TransactionAborted)) == 3, "aborted max_abortable_retries + 1 times"
        assert [e.action for e in h.handled()] == ["abort and reprocess the batch"] * 3 + ["recreate producer"]
        recreated = h.of(ProducerRecreated)
        assert len(recreated) == 1
        assert recreated[0].transactional_id == h.transactional_id
        assert code_of(recreated[0].error) == "TRANSACTION_ABORTABLE"
        assert len(mc.requests_for(ApiKey.INIT_PRODUCER_ID)) == 2, "a new producer took over the transactional.id"
        assert h.values_seen() == [b"a"] * 4
        assert h.attempts_seen() == {1}
        assert h.of(HandlerFailed) == [] and h.of(RecordRecovered) == []
        h.assert_keeps_processing()


def test_abort_never_raises_an_abortable_error(mc: MockCluster) -> None:
    # The commit's EndTxn and then the abort's EndTxn are refused with TRANSACTION_ABORTABLE.
    h = Harness(mc)
    mc.start_request_tracking()
    mc.push_request_errors(ApiKey.END_TXN, E.TRANSACTION_ABORTABLE, E.TRANSACTION_ABORTABLE)
    with running(h.app):
        h.produce(b"a")
        h.wait_committed(1)
        handled = [e for e in h.handled() if not e.action.startswith("retry #")]  # librdkafka's own retries are noise
        assert [(e.operation, e.error_class) for e in handled] == [
            ("commit_transaction", "ABORTABLE"),
            ("abort_transaction", "APPLICATION_RECOVERABLE"),
        ]
        recreated = h.of(ProducerRecreated)
        assert len(recreated) == 1
        error = recreated[0].error
        assert isinstance(error, ApplicationRecoverableError)
        assert (error.operation, error.code_name) == ("abort_transaction", "TRANSACTION_ABORTABLE")
        assert h.of(TransactionAborted) == [], "the abort did not complete"
        assert len(mc.requests_for(ApiKey.INIT_PRODUCER_ID)) == 2
        assert h.values_seen() == [b"a", b"a"]
        assert h.attempts_seen() == {1}
        h.assert_keeps_processing()


# --------------------------------------------------------------------------
# APPLICATION_RECOVERABLE
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "code", "seen"),
    [
        (ApiKey.END_TXN, E.PRODUCER_FENCED, _FENCED_CODES),
        (ApiKey.END_TXN, E.INVALID_TXN_STATE, {"INVALID_TXN_STATE"}),
        (ApiKey.ADD_PARTITIONS_TO_TXN, E.INVALID_PRODUCER_EPOCH, _FENCED_CODES),
        (ApiKey.ADD_OFFSETS_TO_TXN, E.INVALID_PRODUCER_EPOCH, _FENCED_CODES),
        (ApiKey.TXN_OFFSET_COMMIT, E.ILLEGAL_GENERATION, {"ILLEGAL_GENERATION"}),
        (ApiKey.PRODUCE, E.INVALID_PRODUCER_EPOCH, _FENCED_CODES),
        (ApiKey.PRODUCE, E.OUT_OF_ORDER_SEQUENCE_NUMBER, {"OUT_OF_ORDER_SEQUENCE_NUMBER"}),
    ],
    ids=lambda v: v.name if isinstance(v, ApiKey) else (E(v).name() if isinstance(v, int) else None),
)
def test_application_recoverable_error_recreates_the_producer_and_reprocesses(
    mc: MockCluster, api: ApiKey, code: int, seen: set[str]
) -> None:
    produce_path = api is ApiKey.PRODUCE
    h = Harness(mc, hold_on=b"a" if produce_path else None, max_attempts=1)
    mc.start_request_tracking()
    if not produce_path:
        mc.push_request_errors(api, code)
    with running(h.app):
        if produce_path:
            h.fail_output_of_a(code)
            h.wait_committed(2)
            assert h.values_seen() == [b"warm-up", b"a", b"a"]
        else:
            h.produce(b"a")
            h.wait_committed(1)
            assert h.values_seen() == [b"a", b"a"]
        recreated = h.of(ProducerRecreated)
        assert len(recreated) == 1
        assert recreated[0].transactional_id == h.transactional_id, "the same transactional.id is reused"
        assert isinstance(recreated[0].error, ApplicationRecoverableError)
        assert code_of(recreated[0].error) in seen
        handled = h.handled()
        assert [(e.error_class, e.action) for e in handled] == [("APPLICATION_RECOVERABLE", "recreate producer")]
        assert len(mc.requests_for(ApiKey.INIT_PRODUCER_ID)) == 2, "a new producer called init_transactions"
        assert h.of(TransactionAborted) == [], "no abort: the old producer was discarded"
        # Rewound to the committed offset: the record is handled again, still as a first attempt.
        assert h.attempts_seen() == {1}
        assert h.of(HandlerFailed) == [] and h.of(RecordRecovered) == []
        assert h.committed_records() == (2 if produce_path else 1)
        h.assert_keeps_processing()


def test_fenced_too_often_stops_the_container(mc: MockCluster) -> None:
    h = Harness(mc, app_options={"max_producer_recreations": 1})
    mc.push_request_errors(ApiKey.END_TXN, E.PRODUCER_FENCED, E.PRODUCER_FENCED)
    h.app.start()
    try:
        h.produce(b"a")
        assert h.app.wait(15), "the container did not stop"
    finally:
        h.app.stop(timeout=10)
    failure = h.app.failure
    assert isinstance(failure, FencedTooOftenError)
    assert h.transactional_id in str(failure) and "instance_id" in str(failure)
    assert len(h.of(ProducerRecreated)) == 2
    assert [e.reason for e in h.of(ContainerStopped)] == ["fenced"]
    assert h.of(TransactionCommitted) == []


# --------------------------------------------------------------------------
# INVALID_CONFIGURATION
# --------------------------------------------------------------------------


_GROUP_ACL = ["check the group ACLs", "READ on the consumer group"]
_TXN_ID_ACL = ["check the transactional-id ACLs", "WRITE and DESCRIBE on the TransactionalId"]
_TOPIC_ACL = ["check the topic ACLs", "WRITE on every output topic"]
_TXN_OPS = {"send_offsets_to_transaction", "commit_transaction"}


@pytest.mark.parametrize(
    ("api", "code", "operation", "hints"),
    [
        (ApiKey.TXN_OFFSET_COMMIT, E.GROUP_AUTHORIZATION_FAILED, "send_offsets_to_transaction", _GROUP_ACL),
        (ApiKey.ADD_OFFSETS_TO_TXN, E.GROUP_AUTHORIZATION_FAILED, "send_offsets_to_transaction", _GROUP_ACL),
        pytest.param(
            ApiKey.INIT_PRODUCER_ID,
            E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
            "init_transactions",
            _TXN_ID_ACL,
            marks=(),
        ),
        pytest.param(
            ApiKey.INIT_PRODUCER_ID,
            E.CLUSTER_AUTHORIZATION_FAILED,
            "init_transactions",
            ["IDEMPOTENT_WRITE"],
            marks=(),
        ),
        (
            ApiKey.ADD_OFFSETS_TO_TXN,
            E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
            "send_offsets_to_transaction",
            _TXN_ID_ACL,
        ),
        (ApiKey.ADD_PARTITIONS_TO_TXN, E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, _TXN_OPS, _TXN_ID_ACL),
        (ApiKey.ADD_PARTITIONS_TO_TXN, E.TOPIC_AUTHORIZATION_FAILED, _TXN_OPS, _TOPIC_ACL),
        (ApiKey.PRODUCE, E.TOPIC_AUTHORIZATION_FAILED, "commit_transaction", _TOPIC_ACL),
    ],
    ids=lambda v: v.name if isinstance(v, ApiKey) else (E(v).name() if isinstance(v, int) else None),
)
def test_invalid_configuration_stops_the_container_with_a_clear_message(
    mc: MockCluster, api: ApiKey, code: int, operation: str | set[str], hints: list[str]
) -> None:
    produce_path = api is ApiKey.PRODUCE
    h = Harness(mc, hold_on=b"a" if produce_path else None)
    if not produce_path:
        mc.push_request_errors(api, code)
    h.app.start()
    try:
        if produce_path:
            h.fail_output_of_a(code)
        elif api is not ApiKey.INIT_PRODUCER_ID:
            h.produce(b"a")
        assert_stopped_for_configuration(h, E(code).name(), operation, hints)
    finally:
        h.app.stop(timeout=10)
    if produce_path:
        assert h.values_seen() == [b"warm-up", b"a"], "no reprocessing"
        assert h.committed_records() == 1
    else:
        assert h.values_seen() == ([] if api is ApiKey.INIT_PRODUCER_ID else [b"a"]), "no reprocessing"
        assert h.of(TransactionCommitted) == []


def test_a_transaction_refused_while_its_offsets_are_being_sent_stops_under_its_own_error(mc: MockCluster) -> None:
    # The coordinator refuses AddPartitionsToTxn while send_offsets_to_transaction looks up the
    # group's coordinator: librdkafka purges the output (_PURGE_QUEUE) and answers with a bare
    # _STATE. The purge is a consequence; the transaction's own error (an ACL) must decide.
    h = Harness(mc, hold_on=b"a")
    h.app.start()
    try:
        h.produce(b"a")
        h.hold()
        mc.push_broker_request_errors(1, ApiKey.FIND_COORDINATOR, (E.NO_ERROR, 600))
        mc.push_broker_request_errors(1, ApiKey.ADD_PARTITIONS_TO_TXN, (E.TOPIC_AUTHORIZATION_FAILED, 200))
        h.release()
        assert_stopped_for_configuration(h, "TOPIC_AUTHORIZATION_FAILED", _TXN_OPS, _TOPIC_ACL)
    finally:
        h.app.stop(timeout=10)


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (E.MSG_SIZE_TOO_LARGE, "max.message.bytes"),
        (E.INVALID_RECORD, "compacted topic"),
        (E.RECORD_LIST_TOO_LARGE, "segment.bytes"),
        (E.INVALID_TIMESTAMP, None),
    ],
    ids=lambda v: E(v).name() if isinstance(v, int) else None,
)
def test_an_output_the_broker_refuses_fails_its_input_record_and_the_container_goes_on(
    mc: MockCluster, code: int, hint: str | None
) -> None:
    # Issue 28 part 2: a refusal of the record itself is the input record's failure (not retryable by
    # default: recovered at once), not a configuration error that stops the App.
    h = Harness(mc, hold_on=b"a")
    h.app.start()
    try:
        h.fail_output_of_a(code)
        wait_for(lambda: h.of(RecordRecovered) or h.app.failure is not None, 15, message="a recovered")
        assert h.app.failure is None, repr(h.app.failure)
        (recovered,) = h.of(RecordRecovered)
        assert recovered.record.value == b"a"
        failure = recovered.exception
        assert isinstance(failure, OutputRefusedError), repr(failure)
        assert failure.code_name == E(code).name() and failure.topic == h.dst
        assert hint is None or hint in str(failure), str(failure)
        assert h.values_seen() == [b"warm-up", b"a"], "not retryable by default: handled once"
        h.assert_keeps_processing()
    finally:
        h.app.stop(timeout=10)
    assert h.app.failure is None
    assert h.of(ProducerRecreated) == [], "not a fencing: the producer is replaced quietly after the abort"


def test_a_refused_output_in_a_unit_of_several_records_stops_a_listener_that_cannot_isolate_them(
    mc: MockCluster,
) -> None:
    # count_crashes=False (the harness's default) has no careful mode to run records one per
    # transaction: which record produced the refused output cannot be told, so the container stops.
    h = Harness(mc, slow=b"b")
    h.produce(b"a", b"b")
    mc.push_request_errors(ApiKey.PRODUCE, *[E.MSG_SIZE_TOO_LARGE] * 4)
    h.app.start()
    try:
        assert h.app.wait(15), "the container did not stop"
    finally:
        h.app.stop(timeout=10)
    failure = h.app.failure
    assert isinstance(failure, InvalidConfigurationError), repr(failure)
    assert failure.code_name == "MSG_SIZE_TOO_LARGE"
    assert "count_crashes" in str(failure) and "2 records" in str(failure), str(failure)
    assert h.of(TransactionCommitted) == []
    assert h.of(RecordRecovered) == []


def test_topic_authorization_failure_in_a_multi_record_batch_stops_the_container(mc: MockCluster) -> None:
    # The output of a is refused; b's output then meets librdkafka's abortable state (_STATE).
    # The refusal is permanent, so every replay fails the same way.
    h = Harness(mc, slow=b"b")
    h.produce(b"a", b"b")
    mc.push_request_errors(ApiKey.PRODUCE, *[E.TOPIC_AUTHORIZATION_FAILED] * 12)
    h.app.start()
    try:
        assert_stopped_for_configuration(h, "TOPIC_AUTHORIZATION_FAILED", {"produce", *_TXN_OPS}, _TOPIC_ACL)
    finally:
        h.app.stop(timeout=10)
    assert h.of(TransactionCommitted) == []


@pytest.mark.parametrize(
    ("api", "code", "expected"),
    [
        pytest.param(
            ApiKey.INIT_PRODUCER_ID,
            E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
            ["TRANSACTIONAL_ID_AUTHORIZATION_FAILED in init_transactions", "WRITE and DESCRIBE on the TransactionalId"],
            marks=(),
        ),
        (
            ApiKey.TXN_OFFSET_COMMIT,
            E.GROUP_AUTHORIZATION_FAILED,
            ["GROUP_AUTHORIZATION_FAILED in send_offsets_to_transaction", "READ on the consumer group"],
        ),
    ],
    ids=lambda v: v.name if isinstance(v, ApiKey) else (E(v).name() if isinstance(v, int) else None),
)
def test_kafkatx_run_exits_78_on_an_invalid_configuration_error_at_runtime(
    mc: MockCluster, tmp_path: Path, api: ApiKey, code: int, expected: list[str]
) -> None:
    src, dst = mc.create_topic(unique_name("in")), mc.create_topic(unique_name("out"))
    module = tmp_path / "fi_cli_app.py"
    module.write_text(
        textwrap.dedent(
            f"""
            from kafkatx import App

            app = App({unique_name("fi-cli")!r}, instance_id="cli", transaction_timeout_ms=10000, config={{"log_level": 2}})

            @app.listener({src!r}, output={dst!r})
            def handle(record):
                return record.value
            """
        )
    )
    producer = Producer({"bootstrap.servers": mc.bootstrap_servers, **_QUIET})
    producer.produce(src, b"a")
    assert producer.flush(5) == 0
    # Every topic exists, so the startup checks pass; the error comes from the broker at runtime.
    mc.push_request_errors(api, code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kafkatx",
            "run",
            "fi_cli_app:app",
            "--bootstrap-servers",
            mc.bootstrap_servers,
            "--no-status",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert f"kafkatx run: configuration error: {expected[0]}" in proc.stderr
    assert expected[1] in proc.stderr
    assert time.monotonic() - started < 30, "no restart loop"


# --------------------------------------------------------------------------
# A client call that ignores its timeout (issue 17, item 3)
# --------------------------------------------------------------------------


def test_a_call_that_ignores_its_timeout_is_abandoned_and_the_producer_replaced(mc: MockCluster) -> None:
    """librdkafka's send_offsets_to_transaction(..., timeout) blocks until the broker answers (measured:
    20 s for a 0.75 s timeout). kafkatx gives up at a deadline, replaces the producer, and carries on."""
    # transaction_timeout_ms=20000: calls get 2.5 s each, and a call still blocked after 10 s is abandoned
    # (librdkafka itself would wait for the broker up to the transaction timeout).
    h = Harness(mc, app_options={"transaction_timeout_ms": 20_000})
    with running(h.app):
        h.produce(b"warm-up")
        h.wait_committed(1)
        mc.push_broker_request_errors(1, ApiKey.TXN_OFFSET_COMMIT, (0, 30_000))  # answered after 30 s
        started = time.monotonic()
        h.produce(b"a")
        wait_for(lambda: h.of(ProducerRecreated), 25, message="the stuck producer replaced")
        assert time.monotonic() - started < 18, "abandoned at its deadline, not when librdkafka gives up"
        error = h.of(ProducerRecreated)[0].error
        assert isinstance(error, StuckCallError) and error.operation == "send_offsets_to_transaction"
        h.wait_committed(2, timeout=30)
        h.assert_keeps_processing()


def test_stopping_names_the_call_a_container_is_stuck_in(mc: MockCluster) -> None:
    """A container that cannot stop within shutdown_timeout makes App.run raise, naming the call."""
    h = Harness(mc, app_options={"transaction_timeout_ms": 60_000, "shutdown_timeout": 2.0})
    errors: list[BaseException] = []

    def run() -> None:
        try:
            h.app.run(install_signal_handlers=False)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: h.app.containers and h.app.containers[0].started.is_set(), 15, message="started")
    h.produce(b"warm-up")
    h.wait_committed(1)
    mc.push_broker_request_errors(1, ApiKey.TXN_OFFSET_COMMIT, (0, 60_000))
    h.produce(b"a")
    wait_for(lambda: h.app.containers[0].blocked_in(), 15, message="the container blocked in a client call")
    t0 = time.monotonic()
    h.app.stop(wait=False)
    thread.join(15)
    assert not thread.is_alive(), "App.run returned"
    assert time.monotonic() - t0 < 10
    assert errors and isinstance(errors[0], ContainerError), errors
    assert "send_offsets_to_transaction" in str(errors[0]) and "shutdown_timeout=2s" in str(errors[0])


def test_a_fault_in_the_crash_counting_claim_gets_the_same_reaction(mc: MockCluster) -> None:
    """With crash counting (the default) the first batch of a partition is claimed in a small transaction
    first; an abortable error there is aborted and redone, and the record is handled once."""
    h = Harness(mc, count_crashes=True)
    mc.push_request_errors(ApiKey.END_TXN, E.TRANSACTION_ABORTABLE)
    with running(h.app):
        h.produce(b"a")
        h.wait_committed(1)
        assert [(e.operation, e.action) for e in h.handled() if not e.action.startswith("retry #")] == [
            ("commit_transaction", "abort and reprocess the claim")
        ]
        assert h.values_seen() == [b"a"], "the record was handed over once, after its claim committed"
        h.assert_keeps_processing()
