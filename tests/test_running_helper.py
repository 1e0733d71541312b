"""``kafkatx.testing.running(app, kafka)`` runs an App declared without an address against the test's broker."""

from __future__ import annotations

import pytest

from kafkatx import App, Record
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def test_running_points_a_module_level_app_at_the_kafka_fixture(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KAFKATX_BOOTSTRAP_SERVERS", raising=False)
    src, out = kafka.topic(), kafka.topic()
    app = App(unique_name("module-level"), instance_id="test")  # as `kafkatx run` would load it: no address

    @app.listener(src, output=out)
    def upper(record: Record) -> bytes:
        return (record.value or b"").upper()

    kafka.produce(src, [b"a", b"b"])
    with running(app, kafka):
        wait_for(lambda: kafka.values(out) == [b"A", b"B"], 30)
    assert app.bootstrap_servers == kafka.bootstrap_servers
