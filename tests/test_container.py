"""The transactional listener container against the local broker: exactly-once, outputs, send()."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from helpers import make_app

from kafkatx import App, InvalidConfigurationError, NotInTransactionError, Output, Record, send
from kafkatx.events import TransactionAborted, TransactionCommitted
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def test_exactly_once_across_partitions_and_committed_offsets(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=3)
    n = 2000
    kafka.produce(src, [(b"k%d" % i, b"v%d" % i) for i in range(n)])
    app = make_app(kafka)
    seen: Counter[int] = Counter()

    @app.listener(src, output=out, max_batch_records=100)
    def upper(record: Record) -> tuple[bytes | None, bytes]:
        seen[record.attempt] += 1
        assert record.value is not None
        return record.key, record.value.upper()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all offsets committed")
    outputs = kafka.read(out)
    assert sorted(r.value for r in outputs) == sorted(b"V%d" % i for i in range(n))
    assert {r.key for r in outputs} == {b"k%d" % i for i in range(n)}
    assert seen == {1: n}, "every record handled exactly once, on its first attempt"


def test_a_failed_attempt_leaves_nothing_even_for_read_uncommitted(kafka: KafkaTestKit) -> None:
    """A failed call's send() is dropped before it reaches the producer and nothing is aborted: a read_uncommitted
    reader (which sees aborted transactions' records) sees exactly what read_committed sees."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"a", b"boom", b"c"])
    app = make_app(kafka)
    failed = threading.Event()

    @app.listener(src, output=out, max_batch_records=10, max_batch_ms=500, backoff=0)
    def handler(record: Record) -> bytes | None:
        send(out, b"side-" + (record.value or b""))  # joins the transaction once the handler returns
        if record.value == b"boom" and not failed.is_set():
            failed.set()
            raise RuntimeError("transient")
        return record.value

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 3}, 30)
    committed = [r.value for r in kafka.read(out)]
    assert sorted(committed) == sorted([b"a", b"boom", b"c", b"side-a", b"side-boom", b"side-c"])
    uncommitted = [r.value for r in kafka.read(out, isolation="read_uncommitted")]
    assert Counter(uncommitted) == Counter(committed), "nothing of the failed attempt reached the broker"


def test_every_return_shape_and_send(kafka: KafkaTestKit) -> None:
    src, out, other = kafka.topic(), kafka.topic(partitions=2), kafka.topic()
    kafka.produce(
        src, [json.dumps({"kind": k}).encode() for k in ["none", "str", "tuple", "output", "gen", "list", "send"]]
    )
    app = make_app(kafka)

    @app.listener(src, output=out, serializer=lambda v: json.dumps(v).encode())
    def handler(record: Record) -> object:
        kind = json.loads(record.value or b"{}")["kind"]
        if kind == "none":
            return None
        if kind == "str":
            return "text"
        if kind == "tuple":
            return ("key", b"tuple-value")
        if kind == "output":
            return Output({"x": 1}, key="k", topic=other, headers={"h": "v"}, partition=0)
        if kind == "gen":
            return (f"gen-{i}" for i in range(3))
        if kind == "list":
            return [b"l1", ("k2", "l2"), None]
        send(other, "sent", key=b"sk", headers=[("s", b"1")])
        return None

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 7}, 30)
    main = sorted(r.value for r in kafka.read(out))
    assert main == sorted([b"text", b"tuple-value", b"gen-0", b"gen-1", b"gen-2", b"l1", b"l2"])
    side = {r.value: r for r in kafka.read(other)}
    assert side[b'{"x": 1}'].key == b"k" and side[b'{"x": 1}'].headers == [("h", b"v")]
    assert side[b"sent"].key == b"sk" and side[b"sent"].headers == [("s", b"1")]
    keyed = {r.value: r.key for r in kafka.read(out)}
    assert keyed[b"tuple-value"] == b"key" and keyed[b"l2"] == b"k2"


def test_send_outside_a_handler_is_a_clear_error() -> None:
    with pytest.raises(NotInTransactionError, match="outside a transaction"):
        send("topic", b"value")


@pytest.mark.parametrize("fencing", ["group", "partition"])
def test_several_listeners_and_topics_one_transaction_per_record(kafka: KafkaTestKit, fencing: str) -> None:
    a, b, c, out1, out2 = (kafka.topic(partitions=2) for _ in range(5))
    kafka.produce(a, [b"a%d" % i for i in range(20)])
    kafka.produce(b, [b"b%d" % i for i in range(20)])
    kafka.produce(c, [b"c%d" % i for i in range(20)])
    app = make_app(kafka)
    commits: list[TransactionCommitted] = []
    app.on(TransactionCommitted)(commits.append)

    @app.listener(a, b, output=out1, max_batch_records=1, fencing=fencing)
    def first(record: Record) -> bytes:
        return record.topic.encode() + b":" + (record.value or b"")

    @app.listener(c, output=out2, fencing=fencing, group_id=app.group_id + "-c")
    def second(record: Record) -> bytes:
        return (record.value or b"").upper()

    with running(app):
        wait_for(lambda: len(kafka.values(out1)) == 40 and len(kafka.values(out2)) == 20, 60)
        wait_for(lambda: kafka.caught_up(app.group_id + "-c", c), 30)
    assert sorted(kafka.values(out1)) == sorted(
        [f"{a}:a{i}".encode() for i in range(20)] + [f"{b}:b{i}".encode() for i in range(20)]
    )
    assert sorted(kafka.values(out2)) == sorted(b"C%d" % i for i in range(20))
    per_record = [
        e
        for e in commits
        if e.listener == "test_several_listeners_and_topics_one_transaction_per_record.<locals>.first"
    ]
    assert per_record and all(e.records == 1 for e in per_record), (
        "max_batch_records=1 gives one transaction per record"
    )
    assert len(per_record) == 40


def test_graceful_stop_never_commits_half_a_batch(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"%d" % i for i in range(50)])
    app = make_app(kafka)
    entered, release = threading.Event(), threading.Event()
    aborted: list[TransactionAborted] = []
    app.on(TransactionAborted)(aborted.append)

    @app.listener(src, output=out, max_batch_records=50, max_batch_ms=1000)
    def slow(record: Record) -> bytes | None:
        if record.offset == 10:
            entered.set()
            release.wait(10)
        return record.value

    app.start()
    assert entered.wait(20)
    app.stop(wait=False)  # stop requested mid-batch: the batch still completes as a whole
    release.set()
    assert app.wait(30)
    assert app.failure is None
    values = kafka.values(out)
    committed = kafka.committed(app.group_id, src)
    assert len(values) == committed.get(0, 0), "outputs and offsets committed together"
    assert values == [b"%d" % i for i in range(len(values))]
    assert len(values) == 50, "the open batch was finished, not cut in half"
    assert not aborted


def test_wait_returns_once_every_container_thread_has_ended(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A container reports that it stopped as its thread's last step; wait() used to return right then,
    # while the thread still ran (seen as a flaky `alive` check on CPython 3.13). The thread's tail is
    # made slow here so that the race is certain.
    src = kafka.topic()
    app = make_app(kafka)
    exited = App.container_exited

    def slow_exit(self: App, container: object) -> None:
        exited(self, container)  # type: ignore[arg-type]
        time.sleep(0.5)

    monkeypatch.setattr(App, "container_exited", slow_exit)

    @app.listener(src, concurrency=2)
    def handle(record: Record) -> None:
        return None

    app.start()
    assert wait_for(lambda: all(c.started.is_set() for c in app.containers), 30, message="containers started")
    app.stop(wait=False)
    assert app.wait(10)
    assert [c.alive for c in app.containers] == [False, False]
    assert app.wait(0), "once the threads have ended, wait() answers at once"


def test_producer_initiated_transaction_commits_or_aborts(kafka: KafkaTestKit) -> None:
    out = kafka.topic()
    app = make_app(kafka)
    with app.transaction() as tx:
        tx.send(out, b"one")
        send(out, b"two")  # joins the same transaction
    with pytest.raises(ValueError, match="boom"):
        with app.transaction() as tx:
            tx.send(out, b"never")
            raise ValueError("boom")
    assert kafka.values(out) == [b"one", b"two"]


def _transaction_helpers(app: App) -> Callable[[], set[str]]:
    """The names of the helper threads of ``app.transaction()``'s producers (one per live producer)."""
    ours = "kafkatx-call-" + app.client_config.producer_transactional_id(0).removesuffix("0")
    return lambda: {t.name for t in threading.enumerate() if t.name.startswith(ours)}


def test_app_stop_closes_the_producers_of_producer_initiated_transactions(kafka: KafkaTestKit) -> None:
    """Each thread's ``app.transaction()`` producer keeps a librdkafka handle and a helper thread: the App's stop
    closes them (one in a transaction when it ends), and a later transaction opens its thread's producer again."""
    out = kafka.topic()
    app = make_app(kafka)
    helpers = _transaction_helpers(app)
    done, entered, release = threading.Event(), threading.Event(), threading.Event()
    committed: list[bytes] = []

    def one_then_wait(value: bytes) -> None:
        with app.transaction() as tx:
            tx.send(out, value)
        committed.append(value)
        done.wait(30)  # the thread lives on, and so does its producer

    def open_while_stopping() -> None:
        with app.transaction() as tx:
            tx.send(out, b"during stop")
            entered.set()
            release.wait(10)

    threads = [threading.Thread(target=one_then_wait, args=(b"t%d" % i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(committed) == 3 and len(helpers()) == 3, message="a producer per thread, idle")
    busy = threading.Thread(target=open_while_stopping)
    busy.start()
    assert entered.wait(10)
    app.stop()
    wait_for(lambda: len(helpers()) == 1, message="the idle producers closed at stop")
    release.set()
    busy.join()
    wait_for(lambda: not helpers(), message="the producer in a transaction closed when it ended")
    with app.transaction() as tx:  # this thread's producer opens again
        tx.send(out, b"after")
    assert sorted(kafka.values(out)) == [b"after", b"during stop", b"t0", b"t1", b"t2"]
    done.set()
    for thread in threads:
        thread.join()
    app.stop()
    wait_for(lambda: not helpers(), message="closed again")


def test_transactions_starting_while_the_app_stops_are_not_broken(kafka: KafkaTestKit) -> None:
    """``App.stop`` closes only idle producers: a thread entering ``app.transaction()`` meanwhile (its producer
    made, not begun yet) commits, and nothing it reported committed is missing."""
    out = kafka.topic()
    app = make_app(kafka)
    committed: list[bytes] = []
    failures: list[BaseException] = []
    go = threading.Event()

    def many(thread: int) -> None:
        go.wait(10)
        for i in range(15):
            try:
                with app.transaction() as tx:
                    tx.send(out, b"%d-%d" % (thread, i))
                committed.append(b"%d-%d" % (thread, i))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                failures.append(exc)

    threads = [threading.Thread(target=many, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    go.set()
    helpers = _transaction_helpers(app)
    wait_for(lambda: helpers(), interval=0.001, message="producers starting")  # inside their first transaction
    app.stop()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert sorted(kafka.values(out)) == sorted(committed) and len(committed) == 60
    wait_for(lambda: not helpers(), message="every thread's producer closed as its thread ended")


def test_a_threads_producer_is_closed_when_the_thread_ends(kafka: KafkaTestKit) -> None:
    """A service that runs ``app.transaction()`` on short-lived threads (a thread per request) keeps no producer,
    handle or helper thread of a thread that ended."""
    out = kafka.topic()
    app = make_app(kafka)
    helpers = _transaction_helpers(app)

    def one(value: bytes) -> None:
        with app.transaction() as tx:
            tx.send(out, value)

    for i in range(4):
        thread = threading.Thread(target=one, args=(b"t%d" % i,))
        thread.start()
        thread.join()
    wait_for(lambda: not helpers(), message="each ended thread's producer closed")
    assert sorted(kafka.values(out)) == [b"t0", b"t1", b"t2", b"t3"]


def test_bootstrap_servers_from_environment(kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"x"])
    monkeypatch.setenv("KAFKATX_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    app = App(unique_name("env"), instance_id="t")
    app.listener(src, output=out)(lambda r: r.value)
    with running(app):
        wait_for(lambda: kafka.values(out) == [b"x"], 30)


def test_missing_bootstrap_servers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFKATX_BOOTSTRAP_SERVERS", raising=False)
    app = App("nobootstrap")
    app.listener("in")(lambda r: None)
    with pytest.raises(InvalidConfigurationError, match="KAFKATX_BOOTSTRAP_SERVERS"):
        app.start()


def test_slow_handlers_split_a_poll_over_transactions_within_the_time_budget(kafka: KafkaTestKit) -> None:
    """A big poll with a slow handler must not keep one transaction open past the budget:
    the transaction commits what it has handled and the rest comes in the next one."""
    src, out = kafka.topic(partitions=2), kafka.topic()
    n = 40
    kafka.produce(src, [b"r%d" % i for i in range(n)])
    app = make_app(kafka)
    commits: list[tuple[int, float]] = []
    calls: Counter[bytes] = Counter()

    @app.listener(src, output=out, max_batch_records=1000, max_batch_ms=300, max_transaction_ms=100)
    def slow(record: Record) -> bytes:
        assert record.value is not None
        calls[record.value] += 1
        time.sleep(0.02)
        return record.value.upper()

    @app.on(TransactionCommitted)
    def committed(ev: TransactionCommitted) -> None:
        commits.append((ev.records, ev.seconds))

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all offsets committed")
    assert sorted(kafka.values(out)) == sorted(b"R%d" % i for i in range(n)), "each output exactly once"
    assert set(calls.values()) == {1}, "a record left for the next transaction is not handled twice"
    handled = [records for records, _ in commits if records]
    assert sum(handled) == n
    assert len(handled) >= 5, f"40 records x 20 ms with a 100 ms budget need several transactions, got {handled}"
    assert max(handled) <= 8, f"no transaction may run far past its budget (5 records of 20 ms): {handled}"


def test_max_transaction_ms_is_validated() -> None:
    app = App("budget", bootstrap_servers="127.0.0.1:1", transaction_timeout_ms=10_000)
    with pytest.raises(InvalidConfigurationError, match="max_transaction_ms must be an integer >= 1"):
        app.add_listener(lambda r: None, "in", max_transaction_ms=0)
    with pytest.raises(
        InvalidConfigurationError, match=r"max_transaction_ms \(10000\) must be below the App's transaction_timeout_ms"
    ):
        app.add_listener(lambda r: None, "in", max_transaction_ms=10_000)


def test_default_transaction_budget_is_a_third_of_the_tighter_timeout() -> None:
    from kafkatx.listener.loop.time_limits import transaction_budget
    from kafkatx.listener.spec import ListenerSpec, build_spec

    app = App("budget", bootstrap_servers="127.0.0.1:1", transaction_timeout_ms=30_000)

    def budget(spec: ListenerSpec) -> float:
        return transaction_budget(spec, app.transaction_timeout_ms, app.consumer_config(spec, "g", 0))

    assert budget(build_spec(lambda r: None, ["in"], {})) == 10.0
    tight = build_spec(lambda r: None, ["in"], {"consumer_config": {"max.poll.interval.ms": 6000}})
    assert budget(tight) == 2.0
    assert budget(build_spec(lambda r: None, ["in"], {"max_transaction_ms": 250})) == 0.25


_FREEZE_PROBE = """
import gc, json, sys, threading, weakref
from kafkatx import App
from kafkatx.events import TransactionCommitted
from kafkatx.testing import running

bootstrap, group, src, out, freeze = sys.argv[1:6]
app = App(group, bootstrap_servers=bootstrap, instance_id="probe", gc_freeze=freeze == "True")
app.listener(src, output=out)(lambda r: r.value)
committed = threading.Event()
app.on(TransactionCommitted)(lambda event: committed.set())

class Cycle:
    def __init__(self):
        self.me = self

cycle = Cycle()
alive = weakref.ref(cycle)
with running(app):
    assert committed.wait(30), "nothing committed"
    frozen_while_running = gc.get_freeze_count()
    del cycle
    gc.collect()
    kept_while_running = alive() is not None
frozen_after = gc.get_freeze_count()
gc.collect()
print(json.dumps({"while": frozen_while_running, "kept": kept_while_running, "after": frozen_after,
                  "collected": alive() is None}))
"""


@pytest.mark.parametrize("gc_freeze", [True, False])
def test_a_running_app_keeps_the_collector_off_its_start_up_objects_and_keeps_nothing_after_stop(
    kafka: KafkaTestKit, gc_freeze: bool
) -> None:
    """A full collection walks every tracked object, and each consumed Message sets one off now and then: while
    the App runs, what the process started with is frozen (gc.freeze); the App gives it back when it stops.
    In a process of its own, as a service runs (this one's other tests may leave Apps running)."""
    import json
    import subprocess
    import sys

    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"a", b"b"])
    args = [kafka.bootstrap_servers, unique_name("freeze"), src, out, str(gc_freeze)]
    probe = subprocess.run(
        [sys.executable, "-c", _FREEZE_PROBE, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert (seen["while"] > 0) is gc_freeze and seen["kept"] is gc_freeze, "frozen objects are skipped by collections"
    assert seen["after"] == 0, "stopped: nothing left frozen"
    assert seen["collected"], "a cycle dropped while the App ran is collected once it stopped"
    assert sorted(r.value for r in kafka.read(out)) == [b"a", b"b"]


_FAILED_APP_PROBE = """
import gc, json, sys
from kafkatx import App

bootstrap, group, src = sys.argv[1:4]
app = App(group, bootstrap_servers=bootstrap, instance_id="probe")

async def later(record):
    return None

app.listener(src)(lambda record: later(record))  # a coroutine from a plain handler: the container stops
app.start()
assert app.wait(60), "the container did not stop"
print(json.dumps({"failure": type(app.failure).__name__, "frozen": gc.get_freeze_count()}))
"""


def test_an_app_whose_containers_failed_gives_the_freeze_back_without_being_stopped(kafka: KafkaTestKit) -> None:
    """A service whose listener failed may never call stop(); its App still gives back what it froze."""
    import json
    import subprocess
    import sys

    src = kafka.topic()
    kafka.produce(src, [b"a"])
    args = [kafka.bootstrap_servers, unique_name("failed-freeze"), src]
    probe = subprocess.run(
        [sys.executable, "-c", _FAILED_APP_PROBE, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen == {"failure": "NotAwaitedError", "frozen": 0}


def test_gc_freeze_takes_a_bool(kafka: KafkaTestKit) -> None:
    with pytest.raises(InvalidConfigurationError, match="gc_freeze= takes True or False, got 'yes'"):
        make_app(kafka, gc_freeze="yes")
