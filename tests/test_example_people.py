"""examples/people.py works as its docstring says: rows and events once each, the nameless person dead-lettered."""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from kafkatx.testing import KafkaTestKit, running, wait_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_people_example_saves_and_publishes_each_person_once(
    kafka: KafkaTestKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PEOPLE_DATABASE", f"sqlite:///{tmp_path / 'people.db'}")
    monkeypatch.setenv("KAFKATX_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    monkeypatch.syspath_prepend(str(EXAMPLES.parent))
    sys.modules.pop("examples.people", None)
    people = importlib.import_module("examples.people")
    kafka.topic(name="people-in")
    kafka.produce("people-in", [json.dumps({"id": i, "name": f"p{i}"}).encode() for i in range(20)]
                  + [json.dumps({"id": 99}).encode()])  # fmt: skip
    with running(people.app):
        wait_for(lambda: kafka.caught_up(people.app.group_id, "people-in"), 60, message="all committed")
    with people.engine.connect() as conn:
        ids = Counter(r[0] for r in conn.execute(sa.text("SELECT id FROM people")))
    assert ids == Counter(range(20))
    events = [json.loads(v) for v in kafka.values("people-saved")]  # type: ignore[arg-type]
    assert sorted(e["id"] for e in events) == list(range(20))
    assert [json.loads(r.value)["id"] for r in kafka.read("people-in-dlt")] == [99]  # type: ignore[arg-type]
    people.engine.dispose()
