"""kafkatx.logging: the record's coordinates in text and JSON log lines, and librdkafka's lines through logging.

No broker needed.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kafkatx.logging import JsonFormatter, TextFormatter, configure

COORDS = {"topic": "orders", "partition": 3, "offset": 42, "attempt": 2}


def make_record(
    msg: str = "orders/3@42 failed", *, extra: dict[str, object] | None = None, exc: bool = False
) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("poison pill")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.getLogger("kafkatx.rollback").makeRecord(
        "kafkatx.rollback", logging.WARNING, __file__, 1, msg, (), exc_info, extra=extra
    )


def test_text_appends_coordinates_and_attempt() -> None:
    line = TextFormatter().format(make_record(extra=COORDS))
    assert line.endswith("orders/3@42 failed [orders/3@42 attempt=2]")
    assert "WARNING kafkatx.rollback:" in line


def test_text_without_coordinates_is_the_plain_line() -> None:
    line = TextFormatter("%(levelname)s %(message)s").format(make_record("started"))
    assert line == "WARNING started"


def test_text_puts_the_traceback_after_the_coordinates() -> None:
    line = TextFormatter().format(make_record(extra=COORDS, exc=True))
    first, *rest = line.splitlines()
    assert first.endswith("[orders/3@42 attempt=2]")
    assert rest[-1] == "ValueError: poison pill"


def test_json_has_coordinates_as_typed_fields() -> None:
    out = json.loads(JsonFormatter().format(make_record(extra=COORDS)))
    assert out["topic"] == "orders"
    assert (out["partition"], out["offset"], out["attempt"]) == (3, 42, 2)
    assert (out["level"], out["logger"], out["message"]) == ("WARNING", "kafkatx.rollback", "orders/3@42 failed")
    assert out["timestamp"].endswith("+00:00") and "T" in out["timestamp"]
    assert "exception" not in out and "listener" not in out


def test_json_exception_listener_and_other_extras() -> None:
    record = make_record(extra={**COORDS, "listener": "enrich", "order_id": 7, "blob": object()}, exc=True)
    line = JsonFormatter().format(record)
    assert "\n" not in line  # one object per line, even with a traceback
    out = json.loads(line)
    assert out["listener"] == "enrich"
    assert out["exception"].startswith("Traceback") and out["exception"].endswith("ValueError: poison pill")
    assert out["order_id"] == 7
    assert out["blob"].startswith("<object object")  # not JSON: written as str()


def test_listener_comes_from_the_container_thread() -> None:
    """Log lines of a handler (which runs on its container's thread) name the listener."""
    lines: list[str] = []

    def log_from_container() -> None:
        lines.append(JsonFormatter().format(make_record("handler says hi", extra=COORDS)))
        lines.append(TextFormatter().format(make_record("handler says hi", extra=COORDS)))

    t = threading.Thread(target=log_from_container, name="kafkatx-enrich#1")
    t.start()
    t.join()
    assert json.loads(lines[0])["listener"] == "enrich#1"
    assert lines[1].endswith("[enrich#1 orders/3@42 attempt=2]")


def test_kafkatxs_other_threads_are_not_taken_for_listeners() -> None:
    """A bounded client call runs on ``kafkatx-call-<client>`` (a transactional.id, a container): its lines
    (say, a producer closed while the broker is down) must not claim a listener named ``call-...``."""
    lines: list[str] = []
    for name in ("kafkatx-call-orders-orders.orders.0", "kafkatx-status"):
        t = threading.Thread(target=lambda: lines.append(JsonFormatter().format(make_record("closing"))), name=name)
        t.start()
        t.join()
    assert ["listener" in json.loads(line) for line in lines] == [False, False]


def test_configure_json_replaces_handlers_and_sets_level(restore_logging: None) -> None:
    stream = io.StringIO()
    configure("debug", json=False, stream=io.StringIO())
    configure("INFO", json=True, stream=stream)  # a second call replaces, never duplicates
    assert len(logging.getLogger().handlers) == 1
    log = logging.getLogger("myapp.handlers")
    log.debug("hidden")
    log.warning("%s failed", "orders/3@42", extra=COORDS)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["offset"] == 42


def test_configure_rejects_an_unknown_level(restore_logging: None) -> None:
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        configure("LOUD")


def test_configure_sends_python_warnings_through_the_formatter(restore_logging: None) -> None:
    """confluent-kafka warns (RuntimeWarning) when a failed producer is closed: with ``--log-format json``
    that line must be JSON too, not Python's raw two-line warning on stderr."""
    import warnings

    stream = io.StringIO()
    configure("INFO", json=True, stream=stream)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("Producer abort_transaction failed during close", RuntimeWarning, stacklevel=1)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, lines
    line = json.loads(lines[0])
    assert line["level"] == "WARNING" and line["logger"] == "py.warnings"
    assert "RuntimeWarning: Producer abort_transaction failed during close" in line["message"]


def test_the_test_kit_logs_through_logging_not_raw_lines() -> None:
    # In a process of its own: the threads of clients that other tests left behind cannot blur the check.
    code = (
        "from helpers import client_threads, wait_for_client_threads_to_end\n"
        "from kafkatx.testing import create_topic\n"
        "before = client_threads()\n"
        "try:\n    create_topic('127.0.0.1:1', 'never', timeout=1)\nexcept Exception:\n    pass\n"
        "else:\n    raise SystemExit('created a topic on a broker that is down')\n"
        "wait_for_client_threads_to_end(before)  # all it could print is printed\n"
    )
    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "%3|" not in proc.stderr
