"""Spark on a cluster: what a user must install and set is said, and a failing task is not retried by Spark.

Checked without a cluster: the Spark Connect client's packages are missing from the test venv (the case a user
hits first), and kafkatx's defaults for a cluster master are plain settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from kafkatx.testing import KafkaTestKit

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
