"""Spark on a cluster: what a user must install and set is said, a failing task is not retried by Spark, and the
word-count example's listener counts exactly once on a standalone cluster and through Spark Connect.

Checked without a cluster: the Spark Connect client's packages are missing from the test venv (the case a user
hits first), and kafkatx's defaults for a cluster master are plain settings. On a cluster (``pytest -m long``):
the session fixtures ``spark_standalone`` and ``spark_connect`` of conftest.py (tests/spark_servers.py).
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest
from helpers import summed_counts

from kafkatx.testing import KafkaTestKit, unique_name, wait_for

pytest.importorskip("pyspark")

ROOT = Path(__file__).resolve().parent.parent

APP = textwrap.dedent(
    """
    import os
    import kafkatx.spark
    from kafkatx import App

    app = App("connect-check", instance_id="t")
    kafkatx.spark.configure(app, master="sc://127.0.0.1:15002")

    @app.spark_listener(os.environ["SRC"], output=os.environ["OUT"])
    def job(df):
        return df
    """
)


def _connect_client_installed() -> bool:
    try:
        metadata.version("grpcio")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(_connect_client_installed(), reason="the Spark Connect client is installed here")
def test_spark_connect_without_its_client_says_what_to_install(kafka: KafkaTestKit, tmp_path: Path) -> None:
    (tmp_path / "connect_app.py").write_text(APP)
    src, out = kafka.topic(), kafka.topic()
    done = subprocess.run(
        [sys.executable, "-m", "kafkatx", "run", "connect_app:app", "--no-status"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SRC": src, "OUT": out, "KAFKATX_BOOTSTRAP_SERVERS": kafka.bootstrap_servers},
    )
    assert done.returncode == 78, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "pip install 'kafkatx[spark-connect]'" in line and "grpcio" in line, done.stderr
    assert "listening there" not in done.stderr, "nothing was asked of a server"


def test_the_spark_connect_extra_brings_the_connect_client() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'spark-connect = ["kafkatx[spark]", "pyspark[connect]==4.3.0"]' in text
    spark_pin = next(r for r in metadata.requires("pyspark") or [] if r.startswith("pyarrow") and "connect" in r)
    assert '"pyarrow>=18"' in text and spark_pin.startswith("pyarrow>=18"), "kafkatx's pin meets pyspark[connect]'s"


def test_a_cluster_master_does_not_retry_a_failing_task() -> None:
    from kafkatx.spark import default_conf

    assert default_conf("spark://master:7077")["spark.task.maxFailures"] == "1"
    assert "spark.task.maxFailures" not in default_conf("local[2]"), "local masters never retry a task"
    assert "spark.task.maxFailures" not in default_conf("sc://server:15002"), "the Connect server's static setting"


# ---------------------------------------------------------------------------------------------------------------
# On a cluster: examples/spark_wordcount.py's handler under `kafkatx run`, a driver of its own (a Connect client
# for sc://), its master given by $KAFKATX_SPARK_MASTER (tests/spark_wordcount_app.py).


def _run_wordcount(master: str, kit: KafkaTestKit, lines: str, counts: str, group: str, log: Path) -> str:
    """Run the word-count App on ``master`` until ``group`` has committed all of ``lines``, stop it; give its log."""
    from spark_servers import server_env

    env = server_env(
        KAFKATX_SPARK_MASTER=master,
        KAFKATX_BOOTSTRAP_SERVERS=kit.bootstrap_servers,
        KAFKATX_INSTANCE_ID=unique_name("wordcount"),
        WORDCOUNT_LINES=lines,
        WORDCOUNT_COUNTS=counts,
        WORDCOUNT_GROUP=group,
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env["PYTHONPATH"]])  # `examples.spark_wordcount`
    command = [sys.executable, "-m", "kafkatx", "run", "spark_wordcount_app:app", "--no-status"]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:

        def caught_up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"kafkatx run exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            return kit.caught_up(group, lines)

        wait_for(caught_up, timeout=600, message="the word-count App committed every line")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return log.read_text()


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cluster", ["spark_standalone", "spark_connect"])
def test_on_a_cluster_the_word_count_counts_every_line_once_and_commits_its_offsets(
    cluster: str, request: pytest.FixtureRequest, kafka: KafkaTestKit, tmp_path: Path
) -> None:
    master = request.getfixturevalue(cluster)
    example = runpy.run_path(str(ROOT / "examples" / "spark_wordcount.py"))  # its text and its word separators
    lines = [line for _ in range(250) for line in example["TEXT"].splitlines()]
    lines_topic, counts_topic = kafka.topic(partitions=3), kafka.topic(partitions=2)
    kafka.produce(lines_topic, [{"value": line, "partition": i % 3} for i, line in enumerate(lines)])
    group = unique_name("wordcount")

    log = _run_wordcount(master, kafka, lines_topic, counts_topic, group, tmp_path / "run.log")

    assert f"SparkSession started (master {master})" in log, log[-3000:]
    per_partition = Counter(i % 3 for i in range(len(lines)))
    assert kafka.committed(group, lines_topic) == dict(per_partition), "each partition's offsets committed to its end"
    out = kafka.read(counts_topic)  # read_committed
    totals = summed_counts(out)
    separators = example["WORD_SEPARATORS"]
    expected = Counter(w for line in lines for w in re.split(separators, line.lower()) if w)
    assert totals == expected, "every word of every line counted once: nothing lost, nothing counted twice"
    assert len(out) > len(expected), "several batches (one count per word and batch), not one"
