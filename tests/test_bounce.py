"""A bounce test modelled on Apache Kafka's exactly-once system test (tests/kafkatest/tests/core/transactions_test.py).

Copiers (``kafkatx run`` workers) copy an input topic to an output topic in
transactions while they are bounced, cleanly (SIGTERM) and hard (SIGKILL),
again and again, and (in some variants) while the broker itself is restarted,
cleanly or with SIGKILL. At the end the output must equal the input: nothing
missing, nothing twice, and each partition's records in their input order.

The default run keeps one small variant (well under a minute). The full
matrix, at Kafka's size, is behind ``-m bounce``; run it five times in a row
with ``pytest -m bounce --count 5`` or a shell loop before changing the
container, the unit, the crash guard or the producer.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from kafkatx.local import LocalBroker
from kafkatx.testing import KafkaTestKit, unique_name, wait_for

APP = textwrap.dedent(
    """
    import os, time
    from kafkatx import App, Output, Record

    app = App(os.environ["APP_NAME"], consumer_config={
        "session.timeout.ms": 6000, "max.poll.interval.ms": 20000, "heartbeat.interval.ms": 500},
        static_membership=os.environ["STATIC"] == "1")

    @app.listener(os.environ["SRC"], max_batch_records=200, fencing=os.environ["FENCING"])
    def copy(record: Record) -> Output:
        time.sleep(0.0005)  # slow enough that bounces land inside transactions
        return Output(record.value, key=record.key, topic=os.environ["OUT"], partition=record.partition)
    """
)


class Copier:
    def __init__(self, workdir: Path, env: dict[str, str], instance: str) -> None:
        self.instance = instance
        self.log = open(workdir / f"{instance}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kafkatx", "run", "bounce_app:app", "--instance-id", instance, "--no-status",
             "--bootstrap-servers", env["BOOTSTRAP"]],
            cwd=workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def run_bounce_test(
    tmp_path: Path,
    *,
    records: int,
    partitions: int = 3,
    copiers: int = 3,
    bounces: int = 6,
    fencing: str = "auto",
    new_ids: bool = False,
    broker_restart: str | None = None,
    seed: int = 0,
) -> None:
    rng = random.Random(seed)
    broker = LocalBroker(data_dir=tmp_path / "broker").start()
    kafka = KafkaTestKit(broker.bootstrap_servers)
    copiers_list: list[Copier] = []
    try:
        src, out = kafka.topic(partitions=partitions), kafka.topic(partitions=partitions)
        name = unique_name("bounce")
        (tmp_path / "bounce_app.py").write_text(APP)
        # Ids that do not come back are what the README calls scaling down: dynamic membership (a static member
        # that never returns keeps its partitions until its session expires, and never on the embedded broker).
        env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "FENCING": fencing,
               "BOOTSTRAP": broker.bootstrap_servers, "PYTHONUNBUFFERED": "1", "STATIC": "0" if new_ids else "1"}  # fmt: skip
        kafka.produce(src, [{"key": b"%d" % (i % partitions), "value": b"%d:%08d" % (i % partitions, i // partitions),
                             "partition": i % partitions} for i in range(records)])  # fmt: skip
        generation = 0
        ids = [f"c{i}" for i in range(copiers)]
        copiers_list = [Copier(tmp_path, env, i) for i in ids]

        def progress() -> int:
            return sum(kafka.committed(name, src).values())

        step = records // (bounces + 2)
        for bounce in range(bounces):
            wait_for(lambda: progress() >= step * (bounce + 1), 120, message=f"progress before bounce {bounce}")
            victim = rng.randrange(copiers)
            hard = bounce % 2 == 1
            copiers_list[victim].stop(signal.SIGKILL if hard else signal.SIGTERM)
            if new_ids:
                generation += 1
                ids[victim] = f"c{victim}-g{generation}"
            copiers_list[victim] = Copier(tmp_path, env, ids[victim])
            if broker_restart and bounce == bounces // 2:
                if broker_restart == "kill":
                    broker.kill()
                    broker.start()
                else:
                    broker.restart()
        try:
            wait_for(lambda: kafka.caught_up(name, src), 240, message="every input record copied")
        except AssertionError as exc:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(tmp_path.glob("c*.log")))
            raise AssertionError(f"{exc}: committed {kafka.committed(name, src)} vs {kafka.end_offsets(src)}\n{logs}") from None
        check_copy(kafka, src, out, partitions)
    finally:
        for copier in copiers_list:
            copier.stop()
        broker.stop()


def check_copy(kafka: KafkaTestKit, src: str, out: str, partitions: int) -> None:
    """Output equals input: no loss, no duplicate, per-partition order kept."""
    inputs = kafka.read(src)
    outputs = kafka.read(out)
    counts = Counter(r.value for r in outputs)
    duplicates = [v for v, c in counts.items() if c > 1]
    missing = {r.value for r in inputs} - set(counts)
    assert not duplicates, f"{len(duplicates)} duplicated, e.g. {duplicates[:5]}"
    if missing:
        raw = {r.value for r in kafka.read(out, isolation="read_uncommitted")}
        in_log = sorted(missing & raw)
        ranges = sorted(missing)
        raise AssertionError(
            f"{len(missing)} missing ({ranges[0]!r}..{ranges[-1]!r}); {len(in_log)} of them are in the log "
            f"(read_uncommitted) and were skipped by read_committed, or belong to aborted transactions"
        )
    by_partition: dict[int, list[bytes]] = defaultdict(list)
    for r in outputs:
        by_partition[r.partition].append(r.value or b"")
    for partition, values in by_partition.items():
        assert all(v.startswith(b"%d:" % partition) for v in values), "records stayed in their partition"
        assert values == sorted(values), f"partition {partition}: output order differs from input order"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bounced_copiers_copy_exactly_once_small(tmp_path: Path) -> None:
    run_bounce_test(tmp_path, records=3000, bounces=4)


_BROKER_LOSES_OPEN_TRANSACTIONS = pytest.mark.xfail(
    strict=False,
    reason="noida-db 0.2.3 loses a transaction open across its restart yet reports the commit as successful "
    "(canary: test_broker_conformance::test_a_transaction_open_across_a_clean_broker_restart_commits_or_fails); "
    "it fails only when a bounce lands inside a transaction",
)


_BROKER_STALLS_AFTER_A_KILLED_MEMBER = pytest.mark.xfail(
    strict=False,
    reason="noida-db 0.2.3 leaves a group whose dynamic member was killed without partitions for minutes "
    "(canary: test_broker_conformance::test_a_killed_members_partitions_go_to_the_live_members); copiers "
    "back under new ids need dynamic membership, so this variant stalls on it",
)


@pytest.mark.bounce
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fencing", ["group", "partition"])
@pytest.mark.parametrize(
    ("new_ids", "broker_restart"),
    [(False, None), pytest.param(True, None, marks=_BROKER_STALLS_AFTER_A_KILLED_MEMBER),
     pytest.param(False, "clean", marks=_BROKER_LOSES_OPEN_TRANSACTIONS),
     pytest.param(False, "kill", marks=_BROKER_LOSES_OPEN_TRANSACTIONS)],
)
def test_bounced_copiers_copy_exactly_once(tmp_path: Path, fencing: str, new_ids: bool, broker_restart: Any) -> None:
    if fencing == "group" and new_ids:
        # Group fencing rests on KIP-447, which the embedded broker lacks: a copier back under a new id
        # can commit what its successor committed (docs/BROKERS.md). fencing="auto" picks "partition" there.
        pytest.skip("needs a KIP-447 broker; the embedded broker uses fencing='auto' -> 'partition'")
    run_bounce_test(tmp_path, records=30_000, bounces=8, fencing=fencing, new_ids=new_ids,
                    broker_restart=broker_restart, seed=hash((fencing, new_ids, broker_restart)) & 0xFFFF)  # fmt: skip
