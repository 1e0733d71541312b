"""The docs name real options and functions, and public names say what they do (issue 15, a new user's first hour).

The Python in README.md and docs/*.md imports real names and passes real options; the option lists name every
option; public classes, functions, methods, properties and the pytest fixtures have docstrings.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

ROOT = Path(__file__).resolve().parent.parent


#: README.md and every page of docs/.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: A fenced block's info string, and what the suite does with it.
RUN = "python"  # run as written, each block alone in a fresh interpreter (test_every_python_block_runs_as_written)
FRAGMENT = "python fragment"  # uses names a page defines in its prose (app, a running broker): compiled and
#                               checked for real names and options, not run
NOT_PYTHON = {"bash", "text", "json", "promql", "yaml"}  # shell commands (each command has its own tests; CI runs the
#                                                  README's test command), output and queries: not run here


def _blocks() -> list[tuple[str, str, str]]:
    """``(page, info string, code)`` of every fenced block of the docs."""
    blocks = []
    for path in DOCS:
        for info, code in re.findall(r"(?m)^```([^\n]*)\n(.*?)^```", path.read_text(), re.S):
            blocks.append((path.name, info.strip(), code))
    return blocks


def _python_blocks() -> list[tuple[str, str]]:
    return [(page, code) for page, info, code in _blocks() if info in (RUN, FRAGMENT)]


def _signature_of(call: ast.Call) -> inspect.Signature | None:
    """The signature a snippet's call must match, for the kafkatx calls worth checking."""
    from kafkatx import App
    from kafkatx.listener.options import LISTENER_DEFAULTS, BatchListenerOptions, SparkListenerOptions

    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in ("listener", "spark_listener", "batch_listener"):
        keys = {
            "listener": LISTENER_DEFAULTS,
            "spark_listener": SparkListenerOptions.__annotations__,
            "batch_listener": BatchListenerOptions.__annotations__,
        }[name]
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
        readme.split("Listener options (", 1)[1].split("Everything is validated", 1)[0].split("App options:")
    )
    assert set(LISTENER_DEFAULTS) - _backticked(listener_part) == set()
    assert set(inspect.signature(App).parameters) - {"name"} - _backticked(app_part) == set()
    spark = (ROOT / "docs" / "SPARK.md").read_text().split("## Options", 1)[1].split("## The SparkSession", 1)[0]
    assert set(SparkListenerOptions.__annotations__) - _backticked(spark) == set()
    for path in DOCS:
        assert "options={" not in path.read_text(), f"{path.name}: a listener has no options= argument"


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


def _first_python_block(path: Path) -> str:
    return next(code for page, info, code in _blocks() if page == path.name and info == RUN)


def test_every_code_block_says_what_it_is() -> None:
    """A block is Python that runs as written, a marked fragment, or not Python at all (see RUN, FRAGMENT)."""
    unmarked = [(page, info) for page, info, _ in _blocks() if info not in {RUN, FRAGMENT, *NOT_PYTHON}]
    assert unmarked == [], "give each block a language: python, python fragment, bash, text, json, promql or yaml"
    for page, info, code in _blocks():
        if info == FRAGMENT:
            compile(code, page, "exec")  # fragments are checked for real names and options above


@pytest.mark.parametrize(
    "page_and_code", [(page, code) for page, info, code in _blocks() if info == RUN], ids=lambda pc: pc[0]
)
def test_every_python_block_runs_as_written(page_and_code: tuple[str, str], tmp_path: Path) -> None:
    """Each ``python`` block runs alone, in a fresh interpreter and an empty directory, and exits 0.

    Blocks that declare an App only declare it (nothing connects: the address is a closed port); the
    database block is also run against a broker below, and the README's example by tests/test_cli.py.
    """
    page, code = page_and_code
    if "pyspark" in code or "kafkatx.spark" in code:
        pytest.importorskip("pyspark")
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KAFKATX_BOOTSTRAP_SERVERS": "127.0.0.1:9"},
    )
    assert done.returncode == 0, f"{page}:\n{code}\n{done.stderr}"


def test_the_database_snippet_runs_as_written(
    kafka: KafkaTestKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/DATABASE.md's first block, run against the test broker (only its names made unique, and in tmp_path)."""
    pytest.importorskip("sqlalchemy")
    src, out, name = unique_name("people-in"), unique_name("people-saved"), unique_name("people")
    block = _first_python_block(ROOT / "docs" / "DATABASE.md")
    assert '"people-in"' in block and '"people-saved"' in block and 'App("people"' in block
    block = block.replace('"people-in"', repr(src)).replace('"people-saved"', repr(out))
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(block.replace('App("people"', f"App({name!r}"), "DATABASE.md", "exec"), namespace)
    with running(namespace["app"], kafka):
        kafka.produce(src, [b'{"id": 1, "name": "Ada"}'])
        wait_for(lambda: kafka.values(out) == [b"person-saved"], 30)
    with namespace["engine"].connect() as conn:
        assert conn.execute(namespace["people"].select()).all() == [(1, "Ada")]
