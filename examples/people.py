"""Example: save a person and publish an event, exactly once on both sides (the Spring Cloud Stream series' example).

The handler saves a ``Person`` through the SQLAlchemy ORM (Spring's repository)
and returns an event; the row and the event commit together with the consumed
offset. A person without a name fails: nothing of it is saved or published,
and after three attempts it is dead-lettered; a person whose id is taken
violates the primary key and is dead-lettered at once (not retryable). Kill
the process at any moment and run it again: no row is written twice, no event
is published twice (see docs/DATABASE.md).

It needs SQLAlchemy (in a clone: ``pip install -e '.[local,database]'``). Run it
on the embedded broker::

    kafkatx run examples.people:app --local --local-port 9092

and give it people from another terminal (``kafkatx produce`` and ``kafkatx dlq``
find the broker on port 9092 by themselves)::

    printf '1\t{"id": 1, "name": "Ada"}\n2\t{"id": 2}\n' | kafkatx produce people-in --kv
    kafkatx dlq inspect people-in-dlt    # person 2, after three attempts

The database stores, beside the rows, how far each input partition has been
processed, so it belongs with the Kafka cluster it was written with. By
default it is a temporary SQLite file that lives as long as the process, like
the embedded broker's temporary data. To kill the process and run it again,
keep both, and delete both together::

    PEOPLE_DATABASE=sqlite:///people.db kafkatx run examples.people:app --local --local-data-dir .kafkatx/people

With PostgreSQL and a real cluster::

    PEOPLE_DATABASE=postgresql+psycopg://user@db/app kafkatx run examples.people:app
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kafkatx import App, Record, db


class Base(DeclarativeBase):
    pass


class Person(Base):
    __tablename__ = "people"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(sa.String(200))


def temporary_database() -> str:
    """A SQLite file removed when the process exits (a database kept across runs of a temporary broker
    would say that the new broker's records were processed already)."""
    directory = tempfile.mkdtemp(prefix="kafkatx-people-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return f"sqlite:///{directory}/people.db"


engine = sa.create_engine(os.environ.get("PEOPLE_DATABASE") or temporary_database())
Base.metadata.create_all(engine)

app = App("people", create_topics=True)


@app.listener("people-in", output="people-saved", database=engine, max_attempts=3, dlq=True)
def save_person(record: Record) -> tuple[bytes | None, bytes]:
    person = json.loads(record.value or b"{}")
    with Session(db()) as session:  # the unit's connection: kafkatx commits it, just before the Kafka transaction
        session.add(Person(id=person["id"], name=person["name"]))  # a KeyError rolls back both sides
        session.commit()  # flushes (the INSERT runs here); the commit itself is kafkatx's
    return record.key, json.dumps({"event": "person-saved", "id": person["id"]}).encode()
