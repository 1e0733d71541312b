"""A batch runner written on the public TransactionUnit interface only, as docs/ARCHITECTURE.md shows."""

from __future__ import annotations

from collections import Counter

from kafkatx import App, TransactionUnit
from kafkatx.listener.spec import build_spec
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def test_a_custom_batch_runner_commits_exactly_once(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic()
    kafka.produce(src, [{"value": b"v%d" % i, "key": b"k%d" % i, "partition": i % 2} for i in range(200)])
    app = App(unique_name("unit"), bootstrap_servers=kafka.bootstrap_servers, instance_id="u")
    batches: list[int] = []

    def uppercase_batch(unit: TransactionUnit) -> None:
        records = unit.records()
        assert all(r.attempt == 1 for r in records)
        outputs = [(out, (r.value or b"").upper(), r.key, None, None) for r in records]

        def work() -> None:
            for o in outputs:
                unit.produce(o)
            unit.send_offsets(unit.next_offsets())

        assert unit.transact(work)
        batches.append(len(records))

    app.register(
        build_spec(lambda df: None, [src], {"max_batch_ms": 50}, kind="batch", runner=lambda c: uppercase_batch)
    )
    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    values = Counter(kafka.values(out))
    assert values == Counter(b"V%d" % i for i in range(200)), "every record once"
    assert sum(batches) == 200
