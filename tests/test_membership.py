"""Group membership: static ids from the instance id, a second process with the same id, fencing on the
embedded broker, and a container that waits for partitions saying so (issue 13)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from kafkatx import App, InvalidConfigurationError, Record
from kafkatx.listener.loop import health as health_module
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def handle(record: Record) -> None:
    return None


def test_static_membership_comes_from_a_stable_instance_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFKATX_INSTANCE_ID", raising=False)
    app = App("sm", bootstrap_servers="127.0.0.1:9", instance_id="pod-1")
    spec = app.add_listener(handle, "in", concurrency=2)
    assert app.consumer_config(spec, "sm", 1)["group.instance.id"] == "pod-1-handle-1"
    opted_out = App("sm", bootstrap_servers="127.0.0.1:9", instance_id="pod-1", static_membership=False)
    assert "group.instance.id" not in opted_out.consumer_config(opted_out.add_listener(handle, "in"), "sm", 0)
    random_id = App("sm", bootstrap_servers="127.0.0.1:9")
    assert "group.instance.id" not in random_id.consumer_config(random_id.add_listener(handle, "in"), "sm", 0), (
        "a made-up id changes with every start: static membership would leave ghosts behind"
    )
    coop = App("sm", bootstrap_servers="127.0.0.1:9", instance_id="p", rebalance="cooperative")
    assert (
        coop.consumer_config(coop.add_listener(handle, "in"), "sm", 0)["partition.assignment.strategy"]
        == "cooperative-sticky"
    )
    with pytest.raises(InvalidConfigurationError, match="rebalance must be"):
        App("sm", rebalance="incremental")  # type: ignore[arg-type]


def test_a_second_live_process_with_the_same_instance_id_stops_with_a_clear_error(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    name = unique_name("twin")
    conf = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
    first, second = (
        App(name, bootstrap_servers=kafka.bootstrap_servers, instance_id="same", consumer_config=conf) for _ in range(2)
    )
    for app in (first, second):
        app.add_listener(handle, src)
    first.start()
    try:
        wait_for(lambda: first.containers[0].assignment, 20, message="the first one assigned")
        second.start()
        wait_for(lambda: first.failure is not None or second.failure is not None, 30, message="one of them fenced")
    finally:
        first.stop(timeout=10)
        second.stop(timeout=10)
    failure = first.failure or second.failure
    assert isinstance(failure, InvalidConfigurationError), repr(failure)
    assert "another live process uses group.instance.id 'same-handle-0'" in str(failure)


def test_fencing_auto_is_per_partition_on_the_embedded_broker(kafka: KafkaTestKit) -> None:
    app = App(unique_name("auto"), bootstrap_servers=kafka.bootstrap_servers, instance_id="a")
    spec = app.add_listener(handle, kafka.topic())
    assert spec.fencing == "auto"
    with running(app):
        assert spec.fencing == "partition", "the embedded broker has no KIP-447: per-partition transactional.ids"


def test_a_container_without_partitions_says_so(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(health_module, "unassigned_grace", lambda config: 1.0)
    src = kafka.topic(partitions=1)
    app = App(unique_name("idle"), bootstrap_servers=kafka.bootstrap_servers, instance_id="i")
    app.add_listener(handle, src, concurrency=2)  # two consumers, one partition: one of them waits
    with caplog.at_level(logging.WARNING, logger="kafkatx.container"), running(app):
        wait_for(
            lambda: any("has had no partition" in r.getMessage() for r in caplog.records),
            20,
            message="the waiting container's warning",
        )
    message = next(r.getMessage() for r in caplog.records if "has had no partition" in r.getMessage())
    assert src in message and "more consumers than partitions" in message


def test_a_killed_worker_restarted_under_its_id_gets_its_partitions_back_within_seconds(
    kafka: KafkaTestKit, tmp_path: Any
) -> None:
    """Static membership: no rebalance, the restarted worker is the same member (measured ~3 s)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    (tmp_path / "sm_app.py").write_text(
        textwrap.dedent("""
        import os
        from kafkatx import App
        app = App(os.environ["APP_NAME"], consumer_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
        @app.listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=50)
        def handle(record):
            return record.value
    """)
    )
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    name = unique_name("sm")
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "PYTHONUNBUFFERED": "1"}

    def worker(instance: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kafkatx",
                "run",
                "sm_app:app",
                "--instance-id",
                instance,
                "--bootstrap-servers",
                kafka.bootstrap_servers,
                "--no-status",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    w0, w1 = worker("w0"), worker("w1")
    try:
        kafka.produce(src, [{"value": b"a%d" % i, "partition": i % 4} for i in range(400)])
        wait_for(lambda: kafka.caught_up(name, src), 60, message="both workers caught up")
        w0.send_signal(signal.SIGKILL)
        w0.wait(10)
        w0 = worker("w0")
        restarted = time.monotonic()
        kafka.produce(src, [{"value": b"b%d" % i, "partition": i % 4} for i in range(400)])
        wait_for(lambda: kafka.caught_up(name, src), 30, message="every partition committing again")
        assert time.monotonic() - restarted < 15, "back within the session timeout, not after a rebalance storm"
    finally:
        for w in (w0, w1):
            w.send_signal(signal.SIGTERM)
            w.wait(30)
    values = kafka.values(out)
    assert sorted(values) == sorted([b"a%d" % i for i in range(400)] + [b"b%d" % i for i in range(400)]), "exactly once"


def test_cooperative_rebalancing_keeps_the_partitions_that_do_not_move_flowing(
    request: pytest.FixtureRequest, kafka: KafkaTestKit
) -> None:
    """rebalance="cooperative": when a second process joins, the first gives up only the partitions that
    move (no stop-the-world revoke), the newcomer gets them within seconds, and the copy stays exactly once.
    The embedded broker answers a cooperative join often only after max.poll.interval.ms, with overlapping
    assignments meanwhile, and moves more than it must (docs/BROKERS.md; strict canary:
    test_broker_conformance::test_a_cooperative_join_settles_within_seconds): there the handover may take
    until max.poll.interval.ms and the first process may give up more than moved; single ownership at the
    end and the exactly-once copy must hold as on Apache Kafka."""
    from collections import Counter

    from kafkatx.events import PartitionsAssigned, PartitionsRevoked

    on_apache_kafka = bool(request.config.getoption("--kafka-bootstrap"))
    max_poll_interval_s = 10
    # Apache Kafka settles within seconds; noida-db may wait for max.poll.interval.ms before it answers.
    handover_s = 20 if on_apache_kafka else max_poll_interval_s + 20
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    group = unique_name("coop")
    kafka.produce(src, [b"%d" % i for i in range(2000)])
    apps = [
        App(
            group,
            bootstrap_servers=kafka.bootstrap_servers,
            instance_id=f"coop-{i}",
            rebalance="cooperative",
            consumer_config={
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 500,
                "max.poll.interval.ms": max_poll_interval_s * 1000,
            },
        )
        for i in range(2)
    ]
    owned: list[set[tuple[str, int]]] = [set(), set()]
    revoked: list[set[tuple[str, int]]] = [set(), set()]
    both_owned: set[int] = set()  # partitions assigned to one process while the other still owned them
    lock = threading.Lock()

    def assigned(i: int, event: PartitionsAssigned) -> None:
        with lock:
            both_owned.update(p for tp in event.partitions if tp in owned[1 - i] for p in [tp[1]])
            owned[i].update(event.partitions)

    def revoked_from(i: int, event: PartitionsRevoked) -> None:
        with lock:
            revoked[i].update(event.partitions)  # before owned: a check that sees a partition leave owned finds it
            owned[i].difference_update(event.partitions)

    for i, app in enumerate(apps):
        app.on(PartitionsAssigned)(lambda e, i=i: assigned(i, e))
        app.on(PartitionsRevoked)(lambda e, i=i: revoked_from(i, e))

        @app.listener(src, output=out, max_batch_records=100)
        def copy(record: Record) -> bytes | None:
            time.sleep(0.001)
            return record.value

    with running(apps[0]):
        wait_for(lambda: len(owned[0]) == 4, 30, message="the first process owns every partition")
        with running(apps[1]):
            wait_for(
                lambda: owned[1] and not (owned[0] & owned[1]) and len(owned[0] | owned[1]) == 4,
                handover_s,
                message="the newcomer got its share, and nobody owns a partition twice",
            )
            if on_apache_kafka:
                assert revoked[0] == owned[1], "the first process gave up exactly the partitions that moved"
            else:
                # noida-db's cooperative rebalance is not sticky (same canary): the first process may give
                # up partitions that come back to it; it must have given up every one that moved.
                assert revoked[0] >= owned[1], "the first process gave up every partition that moved"
            wait_for(lambda: kafka.caught_up(group, src), 60, message="everything copied")
    copied = Counter(kafka.values(out))
    twice = {value for value, n in copied.items() if n > 1}
    if twice and not on_apache_kafka:
        # Proof, not an excuse: only records of partitions that noida-db handed to both processes at once
        # (its gap, docs/BROKERS.md; canary test_a_cooperative_join_settles_within_seconds) may be copied twice.
        partition_of = {r.value: r.partition for r in kafka.read(src)}
        twice_in = {partition_of[value] for value in twice}
        assert twice_in <= both_owned, f"copied twice in partitions {sorted(twice_in)}, owned twice {both_owned}"
        assert set(copied) == {b"%d" % i for i in range(2000)}, "nothing lost, nothing extra"
        pytest.xfail(
            f"noida-db assigned partitions {sorted(both_owned)} to both processes at once; "
            f"{len(twice)} records of partitions {sorted(twice_in)} were copied twice"
        )
    assert copied == Counter(b"%d" % i for i in range(2000)), "exactly once"
