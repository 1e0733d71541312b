"""A fast SparkSession for tests, and a session-scoped pytest fixture.

Use it in a test module or conftest.py::

    from kafkatx.spark.testing import spark_session  # noqa: F401  (the fixture)

    def test_job(spark_session, kafka):
        app = App(...)
        kafkatx.spark.configure(app, session=spark_session)  # kafkatx will not stop it

Starting a SparkSession takes seconds, so a test run should start one and
share it. Handler modules must be importable by Spark's Python workers; a
test module usually is not (pytest puts its directory on ``sys.path`` of the
driver only), so ship it by value: :func:`ship_module_by_value`.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["TEST_CONF", "create_test_session", "ship_module_by_value", "spark_session"]

#: Settings measured to make small local jobs fast (docs/SPARK.md).
TEST_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "1",
    "spark.default.parallelism": "1",
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
}


def create_test_session(master: str = "local[1]", **conf: str) -> Any:
    """A local SparkSession with :data:`TEST_CONF` (plus ``conf``), warmed up."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName("kafkatx-tests")
    for key, value in {**TEST_CONF, **conf}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("FATAL")  # failing test jobs would print every task's stack trace
    session.range(1).count()
    return session


def ship_module_by_value(module: types.ModuleType | str) -> None:
    """Pickle ``module``'s functions and classes by value, so workers need not import it."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[module] if isinstance(module, str) else module)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Any]:
    """One SparkSession for the whole test run (local[1]); stopped at the end."""
    session = create_test_session()
    try:
        yield session
    finally:
        session.stop()
