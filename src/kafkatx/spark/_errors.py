"""Spark job errors, unwrapped to the exception the user's code raised.

A Python UDF that raises ``PoisonError`` reaches the driver as a
``PythonException`` whose only trace of the original is the last
``module.Class: message`` line of a worker traceback; the exception object
itself is gone. :func:`as_job_error` turns that (and ``Py4JJavaError``,
``AnalysisException`` and every other PySpark error) into a
:class:`SparkJobError` that names the original class, so that

- dead-letter headers (``kafka_dlt-exception-fqcn``) show the user's class,
  because :func:`kafkatx.rollback.classifier.exception_fqcn` honours
  ``original_fqcn``;
- ``not_retryable=[PoisonError]`` and ``except PoisonError`` match: when the
  original class can be resolved in the driver (it is normally imported
  there, since the handler refers to it), the error is an instance of a
  subclass of both :class:`SparkJobError` and that class.
"""

from __future__ import annotations

import builtins
import importlib
import re
import sys
from typing import Any

from kafkatx.errors import KafkaClientError, KafkaTxError, OutputError

__all__ = ["SparkJobError", "SparkOutputError", "as_job_error", "is_data_independent"]

_CLASS_TOKEN = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_SQLSTATE = re.compile(r"\s*SQLSTATE:\s*\w+\s*$")
_FILE_LINE = re.compile(r"^\s+File \"")
_MAX_NOTE = 8_000


class SparkJobError(KafkaTxError):
    """A Spark job failed; it names the exception that caused it.

    - ``original_fqcn``: ``module.Class`` of the original exception
      (``builtins.ValueError``, ``mymodule.PoisonError``, a PySpark class such
      as ``pyspark.errors.exceptions.captured.AnalysisException``, or a Java
      class for JVM-side failures);
    - ``original_message``: its message (also ``str(error)``);
    - ``original_type``: the class itself when it could be resolved in this
      process, else None;
    - ``spark_error``: the PySpark / py4j exception that was caught;
    - ``worker_traceback``: the Python traceback from the worker, if any (also
      attached as a note, so it shows in logs and dead-letter stack traces).

    When ``original_type`` is a resolvable ``Exception`` subclass, the
    instance's class is a subclass of both SparkJobError and that type.
    """

    def __init__(
        self,
        message: str,
        *,
        original_fqcn: str,
        original_type: type[BaseException] | None = None,
        spark_error: BaseException | None = None,
        worker_traceback: str | None = None,
        data_independent: bool = False,
    ) -> None:
        # Exception.__init__ directly: the original class's __init__ may take other arguments.
        Exception.__init__(self, message)
        self.original_message = message
        self.original_fqcn = original_fqcn
        self.original_type = original_type
        self.spark_error = spark_error
        self.worker_traceback = worker_traceback
        # True when the failure cannot depend on which records are in the batch
        # (a missing column): isolating poison records would be pointless.
        self.data_independent = data_independent
        if worker_traceback:
            text = worker_traceback if len(worker_traceback) <= _MAX_NOTE else "..." + worker_traceback[-_MAX_NOTE:]
            self.add_note(f"Spark worker traceback:\n{text}")

    def __str__(self) -> str:
        return self.original_message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.original_fqcn}: {self.original_message!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # The dynamic class is not importable and spark_error may not pickle: rebuild from text.
        return (_rebuild, (self.original_message, self.original_fqcn, self.worker_traceback, self.data_independent))


class SparkOutputError(OutputError):
    """A Spark handler returned something kafkatx cannot produce (no ``value`` column,
    an unsupported column type, a topic that does not exist...).

    Like every :class:`~kafkatx.OutputError` it is not
    retryable by default. ``data_independent`` is True for schema problems,
    which no subset of the batch can fix.
    """

    def __init__(self, message: str, *, data_independent: bool = False) -> None:
        super().__init__(message)
        self.data_independent = data_independent


def is_data_independent(exc: BaseException) -> bool:
    """True if the failure does not depend on the records (bisecting cannot isolate anything)."""
    return bool(getattr(exc, "data_independent", False))


def _rebuild(message: str, fqcn: str, worker_traceback: str | None, data_independent: bool) -> SparkJobError:
    return _make(message, fqcn, _resolve(fqcn), None, worker_traceback, data_independent)


# -- building the error ---------------------------------------------------------
_subclasses: dict[type[BaseException], type[SparkJobError]] = {}


def _job_error_class(original: type[BaseException] | None) -> type[SparkJobError]:
    """SparkJobError, or a subclass that is also ``original`` (cached per class).

    Not for PySpark's own errors: their methods (getCondition()...) need state
    a SparkJobError does not have; they are chained as ``__cause__`` instead.
    """
    if (
        original is None
        or not issubclass(original, Exception)
        or original.__module__.startswith(("pyspark.", "py4j."))
        or issubclass(original, (SparkJobError, KafkaClientError))  # never let a UDF error look like a Kafka error
        or original is Exception
    ):
        return SparkJobError
    cls = _subclasses.get(original)
    if cls is None:
        try:
            cls = type(
                f"SparkJobError[{original.__qualname__}]",
                (SparkJobError, original),
                {"__module__": __name__, "__qualname__": f"SparkJobError[{original.__qualname__}]"},
            )
        except TypeError:  # incompatible layout or metaclass: keep the plain class
            cls = SparkJobError
        _subclasses[original] = cls
    return cls


def _make(
    message: str,
    fqcn: str,
    original_type: type[BaseException] | None,
    spark_error: BaseException | None,
    worker_traceback: str | None,
    data_independent: bool = False,
) -> SparkJobError:
    kwargs = dict(
        original_fqcn=fqcn,
        original_type=original_type,
        spark_error=spark_error,
        worker_traceback=worker_traceback,
        data_independent=data_independent,
    )
    cls = _job_error_class(original_type)
    try:
        return cls(message, **kwargs)  # type: ignore[arg-type]
    except Exception:  # an exotic __new__ in the original class
        return SparkJobError(message, **kwargs)  # type: ignore[arg-type]


def _resolve(fqcn: str) -> type[BaseException] | None:
    """The exception class named ``fqcn``, from loaded modules or by importing its module."""
    parts = fqcn.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name, attrs = ".".join(parts[:cut]), parts[cut:]
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except Exception:
                continue
        obj: Any = module
        for attr in attrs:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return obj
    return None


def _fqcn(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def parse_python_traceback(text: str) -> tuple[str, str] | None:
    """``(fqcn, message)`` of the last exception in a formatted Python traceback.

    Python omits the module for builtins and ``__main__`` classes; they come
    back as ``builtins.X`` or ``__main__.X``.
    """
    lines = [ln for ln in text.splitlines() if not _SQLSTATE.fullmatch(ln)]
    last_file = max((i for i, ln in enumerate(lines) if _FILE_LINE.match(ln)), default=None)
    if last_file is None:
        return None
    start = None
    for i in range(last_file + 1, len(lines)):
        if lines[i] and not lines[i][0].isspace():
            start = i
            break
    if start is None:
        return None
    m = _CLASS_TOKEN.match(lines[start])
    if m is None:
        return None
    name, first = m.group(1), m.group(2) or ""
    rest = [first, *lines[start + 1 :]]
    message = _SQLSTATE.sub("", "\n".join(rest).strip())
    if "." not in name:
        obj = getattr(builtins, name, None)
        module = "builtins" if isinstance(obj, type) and issubclass(obj, BaseException) else "__main__"
        name = f"{module}.{name}"
    return name, message


def _from_worker_text(text: str, spark_error: BaseException) -> SparkJobError | None:
    parsed = parse_python_traceback(text)
    if parsed is None:
        return None
    fqcn, message = parsed
    start = text.find("Traceback (most recent call last)")
    worker_tb = _SQLSTATE.sub("", text[start:] if start >= 0 else text).strip()
    return _make(message, fqcn, _resolve(fqcn), spark_error, worker_tb)


def _java_root(exc: BaseException) -> tuple[str, str, str | None] | None:
    """(class, message, python worker text or None) of the deepest cause of a
    Py4JJavaError that has a message (``Python worker exited unexpectedly``
    rather than the EOFException under it)."""
    java = getattr(exc, "java_exception", None)
    if java is None:
        return None
    try:
        current, python_text, best = java, None, None
        for _ in range(20):
            cls_name = str(current.getClass().getName())
            message = current.getMessage()
            if cls_name == "org.apache.spark.api.python.PythonException" and python_text is None:
                python_text = str(message)
            if message or best is None:
                best = (cls_name, str(message or "").strip().split("\n", 1)[0])
            current = current.getCause()
            if current is None:
                break
        assert best is not None
        return best[0], best[1], python_text
    except Exception:  # the JVM may be gone
        return None


def as_job_error(exc: BaseException) -> BaseException:
    """A :class:`SparkJobError` for a PySpark / py4j error; any other exception unchanged."""
    if isinstance(exc, SparkJobError):
        return exc
    try:
        from pyspark.errors import AnalysisException, PySparkException, PythonException
    except ImportError:  # pragma: no cover - the spark extra is installed if we get here
        return exc
    if isinstance(exc, PythonException):
        job_error = _from_worker_text(str(exc), exc)
        if job_error is not None:
            return _detached(job_error)
        return _detached(_make(str(exc), _fqcn(type(exc)), type(exc), exc, None))
    if isinstance(exc, PySparkException):
        # A Spark-side error (AnalysisException, ArithmeticException...): the PySpark
        # class is the original. Chained, so not_retryable=[AnalysisException] matches.
        error = _make(
            str(exc).strip(),
            _fqcn(type(exc)),
            type(exc),
            exc,
            None,
            data_independent=isinstance(exc, AnalysisException),
        )
        error.__cause__ = exc
        return error
    if type(exc).__name__ == "Py4JJavaError":
        root = _java_root(exc)
        if root is not None:
            cls_name, message, python_text = root
            if python_text:
                job_error = _from_worker_text(python_text, exc)
                if job_error is not None:
                    return _detached(job_error)
            return _detached(_make(message or cls_name, cls_name, None, exc, None))
        return _detached(
            _make(
                str(exc).strip().splitlines()[0] if str(exc).strip() else "Py4JJavaError",
                _fqcn(type(exc)),
                None,
                exc,
                None,
            )
        )
    return exc


def _detached(error: SparkJobError) -> SparkJobError:
    """No implicit chaining to the Spark exception: the root cause is the user's error."""
    error.__cause__ = None
    error.__suppress_context__ = True
    return error
