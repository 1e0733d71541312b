"""The shape of the package: packages import downwards only, and spark/ builds on the public unit interface."""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "kafkatx"


def _in_a_fresh_interpreter(code: str) -> str:
    """What ``code`` prints when run by a new Python process (nothing of kafkatx imported yet)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def _runtime_imports(path: Path) -> list[str]:
    """Modules imported by ``path`` at run time (function-level imports included, TYPE_CHECKING blocks not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    return [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("kafkatx.")
        and id(node) not in type_only
    ]


def _top(module: str) -> str:
    return module.split(".")[1]


def test_no_import_cycle_between_packages_and_modules() -> None:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in SRC.rglob("*.py"):
        if path == SRC / "__init__.py":
            continue  # the public API re-exports everything
        here = path.relative_to(SRC).parts[0].removesuffix(".py")
        for module in _runtime_imports(path):
            if _top(module) != here:
                edges[here].add(_top(module))
    cycles = []
    for start in list(edges):
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*trail, nxt]))
                elif nxt not in trail:
                    stack.append((nxt, [*trail, nxt]))
    assert cycles == [], cycles


def test_spark_uses_nothing_private_of_listener() -> None:
    for path in (SRC / "spark").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kafkatx.listener"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private and "._" not in node.module, f"{path.name} imports {node.module}: {private}"
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("c", "container", "_c")
            ):
                assert not node.attr.startswith("_"), f"{path.name} reaches into the container: .{node.attr}"


def test_no_module_grows_past_600_lines() -> None:
    # A module holds one concept and its seams follow the ports; 600 lines is the ceiling, not the goal.
    sizes = {str(p.relative_to(SRC)): len(p.read_text(encoding="utf-8").splitlines()) for p in SRC.rglob("*.py")}
    too_big = {name: n for name, n in sizes.items() if n > 600}
    assert not too_big, f"split these along a natural seam (docs/ARCHITECTURE.md): {too_big}"


def test_an_app_for_a_real_cluster_does_not_load_the_embedded_broker_module() -> None:
    # kafkatx.local manages the embedded broker's process (ctypes, tempfile, shutil, pathlib: ~12 ms of
    # imports). An App asks at start whether it runs on that broker; the answer needs none of it.
    code = (
        "import sys, kafkatx\n"
        "app = kafkatx.App('orders', bootstrap_servers='kafka.example:9092')\n"
        "@app.listener('in', output='out')\n"
        "def handle(record):\n    return record.value\n"
        "from kafkatx.client.brokers import is_embedded_broker, warn_about_chained_listeners\n"
        "assert not is_embedded_broker('kafka.example:9092') and not warn_about_chained_listeners(app.listeners, 'x:1')\n"
        "print(sorted(m for m in ('kafkatx.local', 'ctypes', 'tempfile', 'uuid') if m in sys.modules))\n"
    )
    assert _in_a_fresh_interpreter(code) == "[]"


def test_importing_kafkatx_leaves_the_dead_letter_tools_for_their_first_use() -> None:
    # An application that only publishes dead letters does not import the inspect/replay tools at start-up
    # (about 10 ms); their public names still resolve from kafkatx.dlq.
    code = (
        "import sys, kafkatx, kafkatx.dlq as dlq\n"
        "assert 'kafkatx.dlq.tools' not in sys.modules, 'tools imported with kafkatx'\n"
        "from kafkatx.dlq import DlqToolError, inspect_dlq, replay_dlq\n"
        "assert inspect_dlq.__name__ == 'inspect_dlq' and issubclass(DlqToolError, Exception)\n"
        "try:\n    dlq.no_such_name\nexcept AttributeError as exc:\n    print(exc)\n"
    )
    assert _in_a_fresh_interpreter(code) == "module 'kafkatx.dlq' has no attribute 'no_such_name'"
