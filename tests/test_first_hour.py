"""A new user's first hour (issue 15): every example runs as its docstring says, the docs name real
options and functions, public methods say what they do, and nothing prints librdkafka's raw lines."""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import os_threads, wait_for_client_threads_to_end
from process_helpers import read_until

from kafkatx.testing import KafkaTestKit, produce, read_topic, wait_for

ROOT = Path(__file__).resolve().parent.parent
#: README.md and docs/*.md, but the benchmark report and two documents other sessions own.
DOCS = [
    ROOT / "README.md",
    *(
        p
        for p in sorted((ROOT / "docs").glob("*.md"))
        if p.name not in ("BENCHMARKS.md", "DATABASE.md", "ARCHITECTURE.md")
    ),
]


def _run_local(target: str, cwd: Path = ROOT) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("KAFKATX_BOOTSTRAP_SERVERS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "kafkatx", "run", target, "--local", "--no-status"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(proc: subprocess.Popen[str], seen: list[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    text = "".join(seen) + out
    assert proc.returncode == 0, text
    assert "%3|" not in text and "%4|" not in text, "librdkafka's lines go through logging"
    return text


# -- the examples -------------------------------------------------------------------
def test_every_example_app_is_run_under_local_by_the_suite() -> None:
    apps = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if re.search(r"^app = App\(", p.read_text(), re.M))
    assert apps == ["orders", "payments", "people", "spark_wordcount"], apps
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in apps:
        assert re.search(rf"\"examples\.{name}:app\"[^\n]*\"--local\"|_run_local\(\"examples\.{name}:app\"", tests), (
            f"no test runs `kafkatx run examples.{name}:app --local`"
        )


def test_the_readme_demo_runs_and_checks_itself() -> None:
    """README's first command ends with `python examples/quickstart.py`."""
    env = {k: v for k, v in os.environ.items() if k != "KAFKATX_BOOTSTRAP_SERVERS"}
    result = subprocess.run(
        [sys.executable, "examples/quickstart.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exactly-once check: OK" in result.stdout and "3 dead-lettered records" in result.stdout, result.stdout
    assert "%3|" not in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.local_broker_only
def test_the_people_example_runs_under_local_and_leaves_no_database_behind(tmp_path: Path) -> None:
    """Its database stores how far each partition was processed: a file kept across runs of a temporary
    broker made the second run skip the new broker's records as done. The default is now temporary too."""
    pytest.importorskip("sqlalchemy")
    pattern = str(Path(tempfile.gettempdir()) / "kafkatx-people-*")
    before = set(glob.glob(pattern))
    proc, seen = _run_local("examples.people:app", cwd=tmp_path), []
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)", 120, seen).group(1)
        read_until(proc, r"assigned people-in\[", 120, seen)
        produce(bootstrap, "people-in", [(b"1", b'{"id": 1, "name": "Ada"}'), (b"2", b'{"id": 2}')])
        wait_for(
            lambda: len(read_topic(bootstrap, "people-in-dlt")) == 1, 60, message="the nameless person dead-lettered"
        )
        events = [json.loads(r.value or b"{}") for r in read_topic(bootstrap, "people-saved")]
        assert events == [{"event": "person-saved", "id": 1}]
        _stop(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(tmp_path.iterdir()) == [], "no people.db in the directory it was run from"
    assert set(glob.glob(pattern)) == before, "the temporary database is removed at exit"


@pytest.mark.spark
@pytest.mark.slow
def test_the_spark_wordcount_example_runs_under_local() -> None:
    pytest.importorskip("pyspark")
    proc, seen = _run_local("examples.spark_wordcount:app"), []
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)", 120, seen).group(1)
        read_until(proc, r"assigned lines\[", 170, seen)
        produce(bootstrap, "lines", [b"the cat and the hat", b"The end"])

        def totals() -> dict[str, int]:
            counts: dict[str, int] = {}
            for r in read_topic(bootstrap, "word-counts"):
                counts[(r.key or b"").decode()] = counts.get((r.key or b"").decode(), 0) + int(r.value or b"0")
            return counts

        expected = {"the": 3, "cat": 1, "and": 1, "hat": 1, "end": 1}
        # The two lines may sit in different partitions, committed by different transactions: wait for both.
        wait_for(lambda: totals() == expected, 120, message=f"the word counts {expected}")
        # A marker into each of the 3 partitions: a line counted twice would be committed before the marker.
        produce(bootstrap, "lines", [{"value": b"marker", "partition": p} for p in range(3)])
        wait_for(lambda: totals().get("marker") == 3, 120, message="the markers counted")
        assert totals() == {**expected, "marker": 3}, "nothing counted twice"
        _stop(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the docs -----------------------------------------------------------------------
def _python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in DOCS:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            blocks.append((path.name, block))
    return blocks


def _signature_of(call: ast.Call) -> inspect.Signature | None:
    """The signature a snippet's call must match, for the kafkatx calls worth checking."""
    from kafkatx import App
    from kafkatx.listener.options import LISTENER_DEFAULTS, SparkListenerOptions

    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in ("listener", "spark_listener"):
        keys = LISTENER_DEFAULTS if name == "listener" else SparkListenerOptions.__annotations__
        return inspect.Signature([inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in keys])
    if name == "App":
        return inspect.signature(App)
    dotted = ast.unparse(func)
    if dotted.startswith("kafkatx."):  # kafkatx.spark.configure(...), kafkatx.logging.configure(...)
        module_name, _, attr = dotted.rpartition(".")
        return inspect.signature(getattr(importlib.import_module(module_name), attr))
    bare = {
        "serve_metrics": "kafkatx.metrics",
        "instrument": "kafkatx.metrics",
        "inspect_dlq": "kafkatx.dlq.tools",
        "replay_dlq": "kafkatx.dlq.tools",
        "send": "kafkatx",
    }
    if isinstance(func, ast.Name) and name in bare:
        return inspect.signature(getattr(importlib.import_module(bare[name]), name))
    return None


def test_the_python_in_the_docs_imports_real_names_and_passes_real_options() -> None:
    pytest.importorskip("pyspark")
    pytest.importorskip("prometheus_client")
    problems = []
    for doc, block in _python_blocks():
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kafkatx"):
                module = importlib.import_module(node.module)
                problems += [f"{doc}: {node.module} has no {a.name}" for a in node.names if not hasattr(module, a.name)]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kafkatx"):
                        importlib.import_module(alias.name)
            elif isinstance(node, ast.Call):
                signature = _signature_of(node)
                if signature is None:
                    continue
                params = signature.parameters
                takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
                problems += [
                    f"{doc}: {ast.unparse(node.func)}() has no option {k.arg!r}"
                    for k in node.keywords
                    if k.arg and k.arg not in params and not takes_any
                ]
    assert problems == []


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", text))


def test_the_option_lists_name_every_option() -> None:
    from kafkatx import App
    from kafkatx.listener.options import LISTENER_DEFAULTS, SparkListenerOptions

    readme = (ROOT / "README.md").read_text()
    listener_part, app_part = (
        readme.split("Listener options (", 1)[1].split("**Threading.**", 1)[0].split("App options:")
    )
    assert set(LISTENER_DEFAULTS) - _backticked(listener_part) == set()
    assert set(inspect.signature(App).parameters) - {"name"} - _backticked(app_part) == set()
    spark = (ROOT / "docs" / "SPARK.md").read_text().split("## Options", 1)[1].split("## The SparkSession", 1)[0]
    assert set(SparkListenerOptions.__annotations__) - _backticked(spark) == set()
    for path in DOCS:
        assert "options={" not in path.read_text(), f"{path.name}: a listener has no options= argument"


# -- docstrings -----------------------------------------------------------------------


def _undocumented() -> set[str]:
    import kafkatx
    import kafkatx.local
    import kafkatx.testing

    missing = set()
    for module in (kafkatx, kafkatx.testing, kafkatx.local):
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.isclass(obj):
                if callable(obj) and not inspect.getdoc(obj):
                    missing.add(f"{module.__name__}.{name}")
                continue
            for attr in dir(obj):
                if attr.startswith("_"):
                    continue
                static = inspect.getattr_static(obj, attr)
                if isinstance(static, (staticmethod, classmethod)):
                    static = static.__func__
                if isinstance(static, property) and not inspect.getdoc(static):
                    missing.add(f"{module.__name__}.{name}.{attr}")
                elif inspect.isfunction(static) and not inspect.getdoc(getattr(obj, attr)):
                    missing.add(f"{module.__name__}.{name}.{attr}")
    return missing


def test_public_classes_functions_methods_and_properties_have_docstrings() -> None:
    assert _undocumented() == set()


def test_every_pytest_fixture_says_what_it_gives() -> None:
    """``pytest --fixtures`` shows these docstrings: the plugin's fixtures and their methods are found there."""
    tree = ast.parse((ROOT / "src" / "kafkatx" / "testing" / "plugin.py").read_text())
    fixtures = [
        f
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and not f.name.startswith("_")
        and any("fixture" in ast.unparse(d) for d in f.decorator_list)
    ]
    assert {f.name for f in fixtures} >= {"kafka_broker", "bootstrap_servers", "kafka", "make_topic", "postgres"}
    assert [f.name for f in fixtures if not ast.get_docstring(f)] == []
    kafka_doc = ast.get_docstring(next(f for f in fixtures if f.name == "kafka")) or ""
    assert all(f"kafka.{m}(" in kafka_doc for m in ("topic", "produce", "read", "values", "committed", "caught_up"))


# -- quiet clients ----------------------------------------------------------------------
def test_the_test_kit_logs_through_logging_not_raw_lines(capfd: pytest.CaptureFixture[str]) -> None:
    from kafkatx.testing import create_topic

    before = os_threads()
    with pytest.raises(Exception):  # noqa: B017 - whatever confluent-kafka raises for a broker that is down
        create_topic("127.0.0.1:1", "never", timeout=1)
    wait_for_client_threads_to_end(before)  # all it could print is printed
    assert "%3|" not in capfd.readouterr().err


def test_chained_listeners_are_found_through_declared_send_targets() -> None:
    from dataclasses import dataclass

    from kafkatx.local import chained_listeners

    @dataclass
    class Listener:
        name: str
        topics: tuple[str, ...]
        output: str | None = None
        dlq_topic: str | None = None
        sends_to: tuple[str, ...] = ()

    listeners = [Listener("a", ("src",), output="out", sends_to=("audit",)), Listener("b", ("audit",))]
    assert chained_listeners(listeners) == [("a", "audit", "b")]


def test_dlq_inspect_says_what_replayed_means(
    kafka: KafkaTestKit, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafkatx.cli import main

    monkeypatch.setenv("KAFKATX_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    dlt, target = kafka.topic(), kafka.topic()
    kafka.produce(dlt, [(b"k1", b"v1"), (b"k2", b"v2"), (b"k3", b"v3")])
    assert main(["dlq", "replay", dlt, "--to", target, "--filter", "key=k2", "--no-progress"]) == 0
    assert "skipped 2 record(s)" in capsys.readouterr().out
    assert main(["dlq", "inspect", dlt]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"0@\d", line)]
    assert [row[-2:] for row in rows] == [["yes", "-"]] * 3, out  # REPLAYED, then the (absent) message
    assert (
        f"REPLAYED yes: 3 record(s) behind the offsets of replay group kafkatx-dlq-replay.{dlt}" in out
        and "skipped by its --filter" in out
    ), out
