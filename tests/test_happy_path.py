"""How many of kafkatx's files a clean record's transaction crosses at default settings (docs/ARCHITECTURE.md).

One turn of a container's loop that polls a record and commits its transaction is traced with ``sys.setprofile``
on the container thread: the files of ``src/kafkatx`` it enters (Python calls; the producer's helper thread, which
waits for the broker's answer to the commit, is not traced), and its calls from one file into another. A loop is
built from the features its listener uses: a feature it does not use is no stage of it, so none of its files is
entered. ``pytest tests/test_happy_path.py -s`` prints the files in the order they are first entered.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from helpers import make_app

import kafkatx
from kafkatx import Record
from kafkatx.listener.loop.container import ListenerContainer
from kafkatx.testing import KafkaTestKit, running, wait_for

SRC = Path(kafkatx.__file__).resolve().parent
#: Poll, gates, unit, runner, commit (issue 43): the files of the transaction's steps and the client calls.
MAX_FILES = {"group": 10, "partition": 11}  # "partition": its turns (partition_turns.py) are a stage of their own

Trace = tuple[list[str], int]  # files entered, in order; calls from one file into another


class _Turns:
    """Traces the container's turns while :attr:`on` is set."""

    def __init__(self) -> None:
        self.traced: list[Trace] = []
        self.on = threading.Event()

    def handled(self) -> list[Trace]:
        """The traced turns that ran the record runner."""
        return [turn for turn in self.traced if "listener/runners/record_runner.py" in turn[0]]

    def wrap(self, turn: Callable[[ListenerContainer], None]) -> Callable[[ListenerContainer], None]:
        def traced(container: ListenerContainer) -> None:
            if not self.on.is_set():
                turn(container)
                return
            files: dict[str, None] = {}
            crossings = 0

            def profile(frame: FrameType, event: str, arg: Any) -> None:
                nonlocal crossings
                path = frame.f_code.co_filename
                if event != "call" or not path.startswith(str(SRC)):
                    return
                files.setdefault(str(Path(path).relative_to(SRC)), None)
                caller = frame.f_back
                if caller is not None and caller.f_code.co_filename != path:
                    crossings += 1

            sys.setprofile(profile)
            try:
                turn(container)
            finally:
                sys.setprofile(None)
            self.traced.append((list(files), crossings))

        return traced


def _one_transaction(kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch, fencing: str) -> Trace:
    src, out = kafka.topic(), kafka.topic()
    app = make_app(kafka)

    @app.listener(src, output=out, fencing=fencing)
    def upper(record: Record) -> bytes:
        return (record.value or b"").upper()

    turns = _Turns()
    monkeypatch.setattr(ListenerContainer, "_poll_and_process", turns.wrap(ListenerContainer._poll_and_process))
    # The turn as on Apache Kafka: the embedded broker's partitions at their end are held (quiet_partitions.py)
    monkeypatch.setattr("kafkatx.app.application.is_embedded_broker", lambda *args, **kwargs: False)
    with running(app):
        kafka.produce(src, [b"first"])  # the first transaction is preceded by a claim (the crash guard's marker)
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 1}, 30, message="the first record committed")
        turns.on.set()
        wait_for(lambda: turns.traced, 30, message="a traced turn")  # not the turn under way when it was set
        kafka.produce(src, [b"second"])
        handled = wait_for(turns.handled, 30, message="a traced turn that handled the second record")
        turns.on.clear()
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 2}, 30, message="the second record committed")
    return handled[0]


@pytest.mark.parametrize("fencing", ["group", "partition"])
def test_a_clean_records_transaction_crosses_ten_files_or_so(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch, fencing: str
) -> None:
    files, crossings = _one_transaction(kafka, monkeypatch, fencing)
    print(f"\nfencing={fencing}: {len(files)} files, {crossings} calls across files:\n  " + "\n  ".join(files))
    assert len(files) <= MAX_FILES[fencing], files
    stages = {"listener/loop/container.py"} | (
        {"listener/loop/partition_turns.py"} if fencing == "partition" else set()
    )
    unused = [f for f in files if f.startswith("listener/loop/") and f not in stages]
    assert unused == [], "loop stages of features the listener does not use"
