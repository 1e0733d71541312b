"""PySpark jobs as kafkatx handlers, with poison-record isolation.

.. code-block:: python

    app = App("clicks-app")
    kafkatx.spark.configure(app, master="local[*]")  # optional

    @app.spark_listener("clicks", output="click-counts", max_attempts=3, dlq=True)
    def count(df: DataFrame) -> DataFrame:
        return df.groupBy("key").count().select("key", F.col("count").cast("string").alias("value"))

Each transaction unit becomes one DataFrame (columns ``topic, partition,
offset, timestamp, key, value, headers``); the returned DataFrame's rows
(``value`` and optionally ``key, topic, partition, headers``) are produced in
the unit's transaction together with its offsets. A unit that still fails
after ``max_attempts`` is bisected to find the records that make the job
fail: only those go to the recoverer (dead-letter topic), the rest commit
exactly once. See docs/SPARK.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow  # noqa: F401  - fail at import (the App turns it into a clear message) without the extra
import pyspark  # noqa: F401

from kafkatx._validate import is_int
from kafkatx.errors import InvalidConfigurationError
from kafkatx.listener.failure.poison_isolation import DEFAULT_MAX_BISECT_JOBS
from kafkatx.listener.options import SparkListenerOptions, check_option_names
from kafkatx.listener.spec import build_spec
from kafkatx.spark._errors import SparkJobError, SparkOutputError, as_job_error
from kafkatx.spark._frames import INPUT_SCHEMA, OUTPUT_COLUMNS
from kafkatx.spark._runner import SparkSessionError, SparkUnitRunner
from kafkatx.spark._session import ENV_MASTER, SessionLease, SparkHost, SparkSettings, configure, default_conf

if TYPE_CHECKING:
    from kafkatx.listener.host import ContainerHost

__all__ = [
    "DEFAULT_MAX_BATCH_MS",
    "DEFAULT_MAX_BATCH_RECORDS",
    "DEFAULT_MAX_BISECT_JOBS",
    "ENV_MASTER",
    "INPUT_SCHEMA",
    "OUTPUT_COLUMNS",
    "SparkJobError",
    "SparkOutputError",
    "SparkSessionError",
    "SparkSettings",
    "as_job_error",
    "configure",
    "default_conf",
    "spark_listener",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Spark's per-job overhead is almost fixed (~60-100 ms warm), so batches are big.
DEFAULT_MAX_BATCH_RECORDS = 50_000
DEFAULT_MAX_BATCH_MS = 2_000

_SESSION_OPTIONS = ("master", "conf", "spark_conf", "app_name", "session", "log_level", "warm_up")
_NOT_FOR_SPARK = {
    "kind": "Spark listeners are always batch listeners",
    "options": "kafkatx sets the container options of a Spark listener",
    "after_rollback": "a Spark listener isolates poison records itself (see max_bisect_jobs)",
    "retry": "a Spark listener retries its job from memory; there is no per-record in-place retry",
    "database": "a Spark job's database writes are its own (database= is for record listeners)",
    "in_flight": "a Spark job runs a whole batch at once, on the cluster (in_flight= is for record listeners)",
    "ordering": "a Spark job runs a whole batch at once, on the cluster (ordering= is for record listeners)",
    **dict.fromkeys(
        ("value_type", "key_type", "deserializer", "key_deserializer"),
        "a Spark job gets key and value as binary columns and decodes them itself (from_json, from_avro), "
        "so a record that fails to decode fails the job, and the job's poison isolation dead-letters it; "
        "typed payloads are for record listeners (@app.listener)",
    ),
}
_leases: weakref.WeakKeyDictionary[Any, SessionLease] = weakref.WeakKeyDictionary()


def _lease(app: SparkHost) -> SessionLease:
    lease = _leases.get(app)
    if lease is None:
        lease = _leases[app] = SessionLease(app)
    return lease


def spark_listener(app: SparkHost, topics: Sequence[str], options: Mapping[str, Any]) -> Callable[[F], F]:
    """The decorator behind :meth:`kafkatx.App.spark_listener`.

    Takes the usual listener options (``output``, ``max_attempts``,
    ``backoff``, ``dlq``, ``not_retryable``, ``fencing``, ``concurrency``...)
    with Spark-sized defaults ``max_batch_records=50_000`` and
    ``max_batch_ms=2_000``, plus ``max_bisect_jobs`` (default 128, 0 =
    dead-letter a failing unit whole). The SparkSession is set per App with
    :func:`configure`.
    """
    topics = tuple(topics)
    if not topics or (len(topics) == 1 and callable(topics[0]) and not isinstance(topics[0], str)):
        raise InvalidConfigurationError("use @app.spark_listener('topic', ...) with at least one topic name")
    opts = dict(options)
    for key in _SESSION_OPTIONS:
        if key in opts:
            raise InvalidConfigurationError(
                f"spark_listener does not take {key!r}: the SparkSession is one per process, set it with "
                f"kafkatx.spark.configure(app, {'conf' if key == 'spark_conf' else key}=...)"
            )
    for key, why in _NOT_FOR_SPARK.items():
        if key in opts:
            raise InvalidConfigurationError(f"spark_listener does not take {key!r}: {why}")
    check_option_names(opts, SparkListenerOptions.__annotations__, "spark_listener")
    max_bisect_jobs = opts.pop("max_bisect_jobs", DEFAULT_MAX_BISECT_JOBS)
    if not is_int(max_bisect_jobs, 0):
        raise InvalidConfigurationError(f"max_bisect_jobs must be an integer >= 0, got {max_bisect_jobs!r}")
    opts.setdefault("max_batch_records", DEFAULT_MAX_BATCH_RECORDS)
    opts.setdefault("max_batch_ms", DEFAULT_MAX_BATCH_MS)
    lease = _lease(app)

    def decorator(handler: F) -> F:
        if not callable(handler):
            raise InvalidConfigurationError(
                f"a spark listener handler must be callable (DataFrame -> DataFrame or None), got {handler!r}"
            )

        def runner(container: ContainerHost) -> SparkUnitRunner:
            # Called by each container as the App starts: the session is created and
            # warmed up here, before any consumer polls or any transaction begins.
            return SparkUnitRunner(spec, lease.acquire(), max_bisect_jobs)

        spec = build_spec(handler, topics, opts, kind="batch", runner=runner, where="spark_listener")
        app.register(spec)
        return handler

    return decorator


def __getattr__(name: str) -> Any:
    """``kafkatx.spark.streaming`` (Structured Streaming's "kafkatx" format) is imported on first use."""
    if name == "streaming":
        import importlib

        return importlib.import_module("kafkatx.spark.streaming")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
