"""examples/people.py works as its docstring says: rows and events once each, the nameless person dead-lettered."""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.testing import KafkaTestKit, running, wait_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_the_people_example_saves_and_publishes_each_person_once(
    kafka: KafkaTestKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, database: str
) -> None:
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'people.db'}"
    else:  # a database of its own on the session's server: the example's table is called "people"
        import psycopg

        server = request.getfixturevalue("postgres")
        name = f"people_{tmp_path.name[-12:].lower()}".replace("-", "_")
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = server.url.replace("/postgres?", f"/{name}?", 1)
    monkeypatch.setenv("PEOPLE_DATABASE", url)
    monkeypatch.setenv("KAFKATX_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    monkeypatch.syspath_prepend(str(EXAMPLES.parent))
    sys.modules.pop("examples.people", None)
    people = importlib.import_module("examples.people")
    for topic in ("people-in", "people-saved", "people-in-dlt"):  # (deleted after the test, for the next run)
        kafka.topic(name=topic)
    kafka.produce(
        "people-in",
        [json.dumps({"id": i, "name": f"p{i}"}).encode() for i in range(20)]
        + [json.dumps({"id": 99}).encode(), json.dumps({"id": 5, "name": "again"}).encode()],
    )
    try:
        with running(people.app):
            wait_for(lambda: kafka.caught_up(people.app.group_id, "people-in"), 60, message="all committed")
    finally:  # the example's group and topics have fixed names: leave none of it to the next run
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 0})
        for future in admin.delete_consumer_groups([people.app.group_id], request_timeout=10).values():
            future.result(timeout=15)
        del admin, future
    with people.engine.connect() as conn:
        ids = Counter(r[0] for r in conn.execute(sa.text("SELECT id FROM people")))
    assert ids == Counter(range(20))
    events = [json.loads(v) for v in kafka.values("people-saved")]  # type: ignore[arg-type]
    assert sorted(e["id"] for e in events) == list(range(20))
    dead = {json.loads(r.value)["id"]: parse_dead_letter_headers(r.headers) for r in kafka.read("people-in-dlt")}  # type: ignore[arg-type]
    assert sorted(dead) == [5, 99]
    assert dead[99].exception_fqcn == "builtins.KeyError" and dead[99].attempts == 3  # retried, then dead-lettered
    assert dead[5].exception_fqcn == "sqlalchemy.exc.IntegrityError" and dead[5].attempts == 1  # at once
    people.engine.dispose()
