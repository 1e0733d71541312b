"""A missing topic is reported with the closest existing one, as a misspelt option or property is (issue 42, item 9)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kafkatx.testing import KafkaTestKit, unique_name

APP = textwrap.dedent(
    """
    import os
    from kafkatx import App

    app = App(os.environ["APP_NAME"])

    @app.listener(os.environ["SRC"])
    def handle(record):
        return None
    """
)


def _kafkatx(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafkatx", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def _a_topic_and_a_misspelling(kafka: KafkaTestKit) -> tuple[str, str]:
    topic = kafka.topic(name=unique_name("invoices"))
    return topic, topic.replace("invoices", "invoice", 1)


def test_kafkatx_run_names_the_closest_topic_to_a_missing_input(kafka: KafkaTestKit, tmp_path: Path) -> None:
    topic, misspelt = _a_topic_and_a_misspelling(kafka)
    (tmp_path / "misspelt_app.py").write_text(APP)
    done = _kafkatx(
        "run",
        "misspelt_app:app",
        "--no-status",
        "--bootstrap-servers",
        kafka.bootstrap_servers,
        cwd=tmp_path,
        APP_NAME=unique_name("hint"),
        SRC=misspelt,
    )
    assert done.returncode == 78, done.stderr
    assert f"topic {misspelt!r} does not exist (did you mean {topic!r}?)" in done.stderr, done.stderr


def test_produce_and_the_dead_letter_tools_name_the_closest_topic(kafka: KafkaTestKit, tmp_path: Path) -> None:
    topic, misspelt = _a_topic_and_a_misspelling(kafka)
    servers = {"KAFKATX_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    produced = _kafkatx("produce", misspelt, "--value", "v", cwd=tmp_path, **servers)
    assert produced.returncode == 1 and f"(did you mean {topic!r}?)" in produced.stderr, produced.stderr
    inspected = _kafkatx("dlq", "inspect", misspelt, cwd=tmp_path, **servers)
    assert inspected.returncode == 1 and f"(did you mean {topic!r}?)" in inspected.stderr, inspected.stderr


def test_a_name_close_to_no_topic_gets_no_guess(kafka: KafkaTestKit, tmp_path: Path) -> None:
    produced = _kafkatx(
        "produce",
        "zzzz-" + unique_name(),
        "--value",
        "v",
        cwd=tmp_path,
        KAFKATX_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
    )
    assert produced.returncode == 1 and "did you mean" not in produced.stderr, produced.stderr
