"""Example: save a person and publish an event, exactly once on both sides (the Spring Cloud Stream series' example).

The handler inserts a row and returns an event; the row and the event commit
together with the consumed offset. A person without a name fails: nothing of
it is saved or published, and after three attempts it is dead-lettered. Kill
the process at any moment and run it again: no row is written twice, no event
is published twice (see docs/DATABASE.md).

Run it on the embedded broker with SQLite (the default)::

    kafkatx run examples.people:app --local

or with PostgreSQL::

    PEOPLE_DATABASE=postgresql+psycopg://user@db/app kafkatx run examples.people:app
"""

from __future__ import annotations

import json
import os

import sqlalchemy as sa

from kafkatx import App, Record, db

engine = sa.create_engine(os.environ.get("PEOPLE_DATABASE", "sqlite:///people.db"))
people = sa.Table(
    "people",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
)
people.metadata.create_all(engine)

app = App("people", create_topics=True)


@app.listener("people-in", output="people-saved", database=engine, max_attempts=3, dlq=True)
def save_person(record: Record) -> tuple[bytes | None, bytes]:
    person = json.loads(record.value or b"{}")
    db().execute(people.insert().values(id=person["id"], name=person["name"]))  # a KeyError rolls back both sides
    return record.key, json.dumps({"event": "person-saved", "id": person["id"]}).encode()
