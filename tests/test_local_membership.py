"""Static members on the embedded broker: changing the worker count or the instance id never strands a partition.

The embedded broker never removes a static member (group.instance.id) that stopped: after a clean stop of
``--instance-id pod-1``, ``--workers 2`` (instance ids pod-1-0, pod-1-1) got no partition for 90 s, and going
back to one process got 1 of 4 (issue 29, item 2). Each App below stands for one process of those runs.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
from confluent_kafka import Consumer

from kafkatx import App, Record
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

PARTITIONS = 4


def _process(kafka: KafkaTestKit, group: str, topic: str, instance_id: str, seen: set[tuple[int, int]]) -> App:
    """One ``kafkatx run --instance-id <instance_id>`` process (static membership on, the default)."""
    app = App(group, bootstrap_servers=kafka.bootstrap_servers, instance_id=instance_id)
    lock = threading.Lock()

    @app.listener(topic, name="copy")
    def handle(record: Record) -> None:
        with lock:
            seen.add((record.partition, record.offset))

    return app


@contextmanager
def _processes(
    kafka: KafkaTestKit, group: str, topic: str, ids: list[str], seen: set[tuple[int, int]]
) -> Iterator[None]:
    with ExitStack() as stack:
        for instance_id in ids:
            stack.enter_context(running(_process(kafka, group, topic, instance_id, seen)))
        yield


def test_changing_the_worker_count_and_the_instance_id_leaves_no_partition_unconsumed(kafka: KafkaTestKit) -> None:
    group, topic = unique_name("members"), kafka.topic(partitions=PARTITIONS)
    seen: set[tuple[int, int]] = set()
    produced = 0

    def run_and_consume(ids: list[str]) -> None:
        """Start the processes, produce 8 records per partition; every one is handled within 10 s."""
        nonlocal produced
        with _processes(kafka, group, topic, ids, seen):
            kafka.produce(topic, [{"value": b"x", "partition": i % PARTITIONS} for i in range(8 * PARTITIONS)])
            produced += 8 * PARTITIONS
            wait_for(
                lambda: len(seen) == produced,
                timeout=10,
                message=f"every record handled by {ids} within 10 s",
            )

    run_and_consume(["pod-1"])  # kafkatx run --instance-id pod-1, then a clean stop
    run_and_consume(["pod-1-0", "pod-1-1"])  # kafkatx run --workers 2 --instance-id pod-1
    run_and_consume(["pod-1"])  # back to one process
    run_and_consume(["pod-2"])  # another instance id
    assert {p for p, _ in seen} == set(range(PARTITIONS))


def test_a_static_member_left_behind_by_a_killed_process_is_named_within_seconds_with_the_fix(
    kafka: KafkaTestKit, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed process cannot leave the group. Its static member (a plain consumer closed without leaving
    stands for it: librdkafka never sends LeaveGroup for one) holds every partition; a run under another id
    is told so within 10 s, naming the member, and the command in the message hands the partitions over."""
    group, topic = unique_name("stale"), kafka.topic(partitions=PARTITIONS)
    kafka.produce(topic, [{"value": b"x", "partition": i % PARTITIONS} for i in range(4 * PARTITIONS)])
    dead = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": group,
            "group.instance.id": "pod-1-copy-0",
            "auto.offset.reset": "earliest",
        }
    )
    dead.subscribe([topic])
    wait_for(lambda: dead.poll(0.1) is not None or bool(dead.assignment()), 10, message="the old member assigned")
    dead.close()

    seen: set[tuple[int, int]] = set()
    caplog.set_level(logging.WARNING, logger="kafkatx.app")
    with running(_process(kafka, group, topic, "pod-2", seen)):
        started = time.monotonic()
        warning = wait_for(
            lambda: next((r.getMessage() for r in caplog.records if "static member" in r.getMessage()), None),
            timeout=12,
            message="a warning naming the stale member",
        )
        assert time.monotonic() - started <= 10.5, warning
        assert "'pod-1-copy-0'" in warning and "pod-2" not in warning.split("that are not")[0], warning
        command = warning.split('python -c "', 1)[1].split('"', 1)[0]
        subprocess.run([sys.executable, "-c", command], check=True, timeout=30)
        wait_for(lambda: len(seen) == 4 * PARTITIONS, timeout=10, message="every record handled after the fix")
