"""Shared test settings. The broker fixtures come from kafkatx's own pytest plugin."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

logging.getLogger("kafkatx").setLevel(logging.DEBUG)
# py4j logs from __del__ at interpreter exit, after pytest has closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)


def _in_the_spark_group(nodeid: str) -> bool:
    """Whether a test runs in the one worker that runs Spark: its file or its name says spark."""
    return "spark" in nodeid.split("[", 1)[0].lower()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Two workers (``-n 2`` in pyproject's addopts) share the tests one at a time, except the Spark tests, which
    run one after the other on one worker: one local Spark (a JVM and its Python workers) at a time, next to the
    other worker's broker tests. (xdist's own ``--dist loadgroup`` does this by renaming the tests, which pytest 9.2
    no longer lets it do, so the grouping is by name here and checked against the ``spark`` marker below.)"""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for on the command line
    from xdist.scheduler import LoadScopeScheduling

    class SparkTogether(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return "spark" if _in_the_spark_group(nodeid) else nodeid

    return SparkTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    misnamed = [i.nodeid for i in items if i.get_closest_marker("spark") and not _in_the_spark_group(i.nodeid)]
    if misnamed:
        raise pytest.UsageError(f"marked spark, but neither file nor name says spark (see conftest.py): {misnamed}")


@pytest.fixture
def pg_engine(postgres: Any) -> Iterator[Any]:
    """A SQLAlchemy engine on the session's PostgreSQL server (see kafkatx.testing's ``postgres``)."""
    import sqlalchemy as sa

    engine = sa.create_engine(postgres.url, pool_size=4)
    yield engine
    engine.dispose()


@pytest.fixture(autouse=True)
def _configured_logging_taken_off() -> Iterator[None]:
    """A command run in-process (``main(["run", ...])``, ``kafkatx dlq ...``) configures logging to the stderr
    pytest captured for that test: left on the root logger, its handler writes to a closed file in every later
    test ("--- Logging error ---" and a stack in each failure's output). Taken off here, levels put back."""
    root, kafkatx_logger = logging.getLogger(), logging.getLogger("kafkatx")
    levels = root.level, kafkatx_logger.level
    yield
    configured = [h for h in root.handlers if getattr(h, "_kafkatx_configured", False)]  # kafkatx.logging's mark
    for handler in configured:
        root.removeHandler(handler)
    if configured:
        root.setLevel(levels[0])
        kafkatx_logger.setLevel(levels[1])
        logging.captureWarnings(False)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put the root logger and kafkatx's loggers back as they were, for tests that configure logging.

    The root's handlers are taken off meanwhile, so that a configure() does not close pytest's capture
    handlers."""
    root = logging.getLogger()
    names = ("kafkatx", "kafkatx.librdkafka", "kafkatx.dlq.librdkafka")
    saved = (root.level, list(root.handlers), {n: logging.getLogger(n).level for n in names})
    for handler in saved[1]:
        root.removeHandler(handler)
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(saved[0])
    for handler in saved[1]:
        root.addHandler(handler)
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(False)


@pytest.fixture(scope="session")
def spark_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone Spark master and two 1-core workers (127.0.0.1, 127.0.0.2), for the test run.

    Gives the master's ``spark://`` URL."""
    from spark_servers import standalone_cluster

    with standalone_cluster(tmp_path_factory.mktemp("standalone")) as url:
        yield url


@pytest.fixture(scope="session")
def spark_connect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server over local[2,3] (a task retried), for the test run; gives its ``sc://`` URL.

    Skips the test where the Connect client is not installed (``pip install 'kafkatx[spark-connect]'``)."""
    pytest.importorskip("grpc", reason="the Spark Connect client: pip install 'kafkatx[spark-connect]'")
    from spark_servers import connect_server

    with connect_server(tmp_path_factory.mktemp("connect")) as url:
        yield url
