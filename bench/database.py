"""Throughput of the database path: kafkatx ``database=`` vs a hand-written loop doing the same work.

    python bench/database.py                   # 20,000 records, SQLite and PostgreSQL, 2 rounds
    python bench/database.py --records 5000 --rounds 1 --backends sqlite

Each record: one INSERT of a row and one output record (key kept, value
transformed), <= 1,000 records per transaction, 4 input partitions. The
hand-written twin is Spring's best-effort one-phase commit written by hand
with confluent-kafka and SQLAlchemy (database commit, then Kafka commit; no
outbox, so not exactly once across a crash); kafkatx also stores the position
and the outputs (its outbox) with the rows. Runs alternate in one process on
one broker; every run is checked (rows and outputs exactly once). Besides
the rates, the CPU time this process spent per record (all its threads:
the handler, SQLAlchemy, librdkafka), which a busy machine disturbs less.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka import Consumer, Producer, TopicPartition

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kafkatx import App, Record, db  # noqa: E402
from kafkatx.events import TransactionCommitted  # noqa: E402
from kafkatx.local import LocalBroker  # noqa: E402
from kafkatx.testing import KafkaTestKit, running  # noqa: E402
from kafkatx.testing.postgres import LocalPostgres  # noqa: E402

PARTITIONS = 4
BATCH = 1000


def _table(engine: sa.Engine) -> str:
    name = f"rows_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} (k VARCHAR(64), v VARCHAR(200))"))
    return name


def _count(engine: sa.Engine, table: str) -> tuple[int, int]:
    with engine.connect() as conn:
        total, distinct = conn.execute(sa.text(f"SELECT COUNT(*), COUNT(DISTINCT k) FROM {table}")).one()
    return int(total), int(distinct)


Result = tuple[float, float, float]  # processing rate, wall-clock rate (records/s), this process's CPU µs per record


def hand_written(bootstrap: str, engine: sa.Engine, src: str, out: str, n: int) -> Result:
    table = _table(engine)
    insert = sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, :v)")
    group = f"raw-{uuid.uuid4().hex[:8]}"
    started, cpu = time.perf_counter(), time.process_time()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
        }
    )
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": group, "linger.ms": 5})
    producer.init_transactions()
    consumer.subscribe([src])
    conn = engine.connect()
    done = 0
    first = 0.0
    while done < n:
        msgs = consumer.consume(BATCH, 1.0)
        msgs = [m for m in msgs if m.error() is None]
        if not msgs:
            continue
        first = first or time.perf_counter()
        producer.begin_transaction()
        conn.begin()
        offsets: dict[tuple[str, int], int] = {}
        for m in msgs:
            value = m.value()
            conn.execute(insert, {"k": value[:16].decode(), "v": value.decode()})  # type: ignore[index,union-attr]
            producer.produce(out, value.upper(), m.key())  # type: ignore[union-attr]
            offsets[(m.topic(), m.partition())] = m.offset() + 1  # type: ignore[index]
        conn.commit()
        producer.send_offsets_to_transaction(
            [TopicPartition(t, p, o) for (t, p), o in offsets.items()], consumer.consumer_group_metadata()
        )
        producer.commit_transaction()
        done += len(msgs)
    ended, cpu = time.perf_counter(), time.process_time() - cpu
    consumer.close()
    conn.close()
    assert _count(engine, table) == (n, n), _count(engine, table)
    _check_outputs(bootstrap, out, n)
    return n / (ended - first), n / (ended - started), cpu * 1e6 / n


def _check_outputs(bootstrap: str, out: str, n: int) -> None:
    """The output topic holds n committed records, all distinct (read_committed): exactly once."""
    values = KafkaTestKit(bootstrap).values(out)
    assert len(values) == n and len(set(values)) == n, (len(values), len(set(values)))


def with_kafkatx(bootstrap: str, engine: sa.Engine, src: str, out: str, n: int, kit: KafkaTestKit) -> Result:
    table = _table(engine)
    insert = sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, :v)")
    app = App(f"kx-{uuid.uuid4().hex[:8]}", bootstrap_servers=bootstrap, instance_id="bench")

    @app.listener(src, output=out, database=engine, max_batch_records=BATCH, fencing="group")
    def save(record: Record) -> tuple[bytes | None, bytes]:
        value: bytes = record.value  # type: ignore[assignment]
        db().execute(insert, {"k": value[:16].decode(), "v": value.decode()})
        return record.key, value.upper()

    commits: list[tuple[float, int]] = []
    app.on(TransactionCommitted)(lambda e: commits.append((time.perf_counter() - e.seconds, e.records)))
    done = threading.Event()
    app.on(TransactionCommitted)(lambda e: sum(r for _, r in commits) >= n and done.set())
    started, cpu = time.perf_counter(), time.process_time()
    with running(app):
        done.wait(600)
        ended, cpu = time.perf_counter(), time.process_time() - cpu
    assert _count(engine, table) == (n, n), _count(engine, table)
    _check_outputs(bootstrap, out, n)
    return n / (ended - commits[0][0]), n / (ended - started), cpu * 1e6 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kafkatx-dbbench-"))
    broker = LocalBroker(data_dir=tmp / "kafka")
    broker.start()
    postgres = LocalPostgres(tmp / "pg").start() if "postgresql" in args.backends else None
    try:
        kit = KafkaTestKit(broker.bootstrap_servers)
        src = kit.topic(partitions=PARTITIONS)
        kit.produce(src, [(f"k{i % 97}".encode(), f"{i:09d}:record:{'x' * 80}".encode()) for i in range(args.records)])
        engines = {
            "sqlite": lambda: sa.create_engine(f"sqlite:///{tmp / 'bench.db'}"),
            "postgresql": lambda: sa.create_engine(postgres.url if postgres else ""),
        }
        print(
            f"{args.records} records of ~100 B, {PARTITIONS} partitions, <= {BATCH} per transaction, "
            "a row and an output record each"
        )
        for backend in args.backends.split(","):
            engine = engines[backend]()
            raw: list[Result] = []
            ktx: list[Result] = []
            for _ in range(args.rounds):
                out = kit.topic(partitions=PARTITIONS)
                raw.append(hand_written(broker.bootstrap_servers, engine, src, out, args.records))
                out = kit.topic(partitions=PARTITIONS)
                ktx.append(with_kafkatx(broker.bootstrap_servers, engine, src, out, args.records, kit))
            for i, what, unit in ((0, "processing", "rec/s"), (1, "wall clock", "rec/s"), (2, "CPU", "us/rec")):
                r, k = statistics.median(x[i] for x in raw), statistics.median(x[i] for x in ktx)
                print(
                    f"{backend:>10} {what:>10}: hand-written {r:7.0f} {unit} (runs {', '.join(f'{x[i]:.0f}' for x in raw)}); "
                    f"kafkatx {k:7.0f} {unit} (runs {', '.join(f'{x[i]:.0f}' for x in ktx)}); ratio {k / r:.2f}"
                )
            engine.dispose()
    finally:
        if postgres is not None:
            postgres.stop()
        broker.stop()


if __name__ == "__main__":
    main()
