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


#: listener/'s folders, highest first: each imports (at run time) only the folders below it.
_LISTENER_LAYERS = ("loop", "runners", "failure", "transaction", "")


def _listener_layer(module: str) -> str:
    """The folder of listener/ that ``module`` (dotted) is in; "" for listener/'s own modules."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[2] in _LISTENER_LAYERS else ""


def test_listener_folders_import_downwards_only() -> None:
    listener = SRC / "listener"
    upward = []
    for path in listener.rglob("*.py"):
        dotted = ".".join(("kafkatx", *path.relative_to(SRC).with_suffix("").parts))
        here = _LISTENER_LAYERS.index(_listener_layer(dotted))
        for module in _runtime_imports(path):
            if module.startswith("kafkatx.listener.") and _LISTENER_LAYERS.index(_listener_layer(module)) < here:
                upward.append(f"{dotted} -> {module}")
    assert upward == [], upward


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


#: Packages held to the two checks below (no import circle at all, nothing private of another module): all of them.
STRICT_SCOPE: tuple[str, ...] = tuple(
    sorted({p.relative_to(SRC).parts[0].removesuffix(".py") for p in SRC.rglob("*.py")})
)

#: Deliberate exceptions, each with its reason (none today: the record runner fills record.MessageRecord through
#: its public slot).
_PRIVATE_ALLOWED: set[tuple[str, str]] = set()


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names the module itself defines (its classes' attributes, slots and methods, its globals)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            own.update(
                c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return own


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _in_scope(path: Path) -> bool:
    rel = path.relative_to(SRC).parts
    return rel[0].removesuffix(".py") in STRICT_SCOPE


def _all_imports(path: Path, modules: set[str]) -> set[str]:
    """kafkatx modules ``path`` imports anywhere: TYPE_CHECKING blocks and function bodies included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            base = node.module or ""
            for alias in node.names:  # ``from kafkatx.listener.loop import health`` imports the module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules}


def test_no_import_circle_between_modules_type_checking_imports_included() -> None:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(paths)
    edges = {name: _all_imports(path, modules) - {name} for name, path in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    ours = [c for c in circles if any(_in_scope(paths[m]) for m in c)]
    assert ours == [], f"import circles through {STRICT_SCOPE}: {ours}"


def _private_module_of_another_package(module: str, importer: str) -> bool:
    """True if ``module`` is private (a part of its name starts with one underscore) to a package that the
    module ``importer`` is not in: ``kafkatx._suggest`` is every module's, ``kafkatx.database._store`` database's."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            package = ".".join(parts[:i])
            return importer != package and not importer.startswith(package + ".")
    return False


def test_no_module_uses_another_modules_private_members() -> None:
    offences: list[tuple[str, str, str]] = []
    for path in sorted(SRC.rglob("*.py")):
        if not _in_scope(path):
            continue
        rel = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        foreign: set[str] = (
            set()
        )  # names bound by imports from outside kafkatx: their private members are their business
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("kafkatx"):
                foreign.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                foreign.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "kafkatx")
        for node in tree.body:  # ``_E = KafkaError``: an alias of a foreign name is foreign
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in foreign:
                foreign.update(t.id for t in node.targets if isinstance(t, ast.Name))
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kafkatx"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                offences += [(rel, name, f"from {node.module} import {name}") for name in private]
                if _private_module_of_another_package(node.module or "", _module_name(path)):
                    offences.append((rel, node.module or "", f"from {node.module} import ..."))
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in foreign):
                    continue
                if node.attr in own:  # the module's own class, used by the module itself
                    continue
                offences.append((rel, node.attr, f"line {node.lineno}: {ast.unparse(node)}"))
    offences = [o for o in offences if (o[0], o[1]) not in _PRIVATE_ALLOWED]
    assert offences == [], "\n".join(f"{rel}: {what}" for rel, _, what in offences)


def test_no_function_is_longer_than_80_lines() -> None:
    # A function that does not fit on a screen hides its structure; split it along a real seam.
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1  # the docstring counts too
                if lines > 80:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], long


def test_the_runner_interface_is_public_under_the_name_the_docs_use() -> None:
    # docs/ARCHITECTURE.md types a custom runner on `kafkatx.Unit`; TransactionUnit is what a container passes.
    import inspect
    import typing

    import kafkatx
    from kafkatx.listener import host
    from kafkatx.listener.host import Unit

    assert kafkatx.Unit is Unit and "Unit" in kafkatx.__all__
    roles = [cls for cls in Unit.__mro__ if cls.__module__ == host.__name__ and cls is not Unit]
    assert roles and all(typing.Protocol in cls.__bases__ for cls in roles), "Unit is its role ports together"
    members = [
        name
        for role in roles
        for name, v in [*vars(role).items(), *dict.fromkeys(inspect.get_annotations(role)).items()]
        if not name.startswith("_") and (v is None or callable(v) or isinstance(v, property))
    ]
    assert {"messages", "outputs", "records", "transact", "recover", "seek", "publish", "stopping"} <= set(members)
    assert [name for name in members if not hasattr(kafkatx.TransactionUnit, name)] == []


#: A port says what one role needs (docs/ARCHITECTURE.md); past a dozen members it is several roles.
MAX_PORT_MEMBERS = 12


def _declared_members(cls: ast.ClassDef) -> list[str]:
    """The members a class body declares itself: its methods, properties and annotated attributes (a
    ``TYPE_CHECKING`` block's too); what it inherits is not counted."""
    names: dict[str, None] = {}
    body = list(cls.body)
    while body:
        stmt = body.pop(0)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[stmt.name] = None  # a property's setter is the same member
        elif isinstance(stmt, ast.AnnAssign):
            names[ast.unparse(stmt.target)] = None
        elif isinstance(stmt, ast.If):
            body[:0] = [*stmt.body, *stmt.orelse]
    return list(names)


def _ports(path: Path) -> dict[str, list[str]]:
    """Each Protocol class of ``path`` (by name) and the members it declares itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name: _declared_members(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).split("[")[0].split(".")[-1] == "Protocol" for base in node.bases)
    }


def test_every_port_is_small() -> None:
    # The ports by role (listener/host.py, health's, the after-rollback context's, and the composites helpers
    # declare next to them): each at most a dozen members; a composite of roles (ContainerHost, Unit...)
    # declares none of its own.
    host = _ports(SRC / "listener" / "host.py")
    assert {"ContainerHost", "TransactionHost", "Unit", "ListenerSettings", "ContainerIdentity"} <= set(host)
    assert {name: host[name] for name in ("ContainerHost", "TransactionHost", "Unit", "ListenerSettings")} == {
        "ContainerHost": [],
        "TransactionHost": [],
        "Unit": [],
        "ListenerSettings": [],
    }, "a composite of roles declares nothing of its own"
    ports = {
        f"{path.relative_to(SRC)}:{name}": members
        for path in sorted(SRC.rglob("*.py"))
        for name, members in _ports(path).items()
    }
    too_big = {name: members for name, members in ports.items() if len(members) > MAX_PORT_MEMBERS}
    assert not too_big, f"split these ports by role (at most {MAX_PORT_MEMBERS} members each): {too_big}"


def test_no_function_is_more_complex_than_the_lint_settings_allow() -> None:
    # McCabe complexity 12 (pyproject.toml): a feature plugs in as a stage, not as branches in one function.
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", str(SRC), "--select", "C901", "--output-format", "concise"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert found.returncode == 0, found.stdout + found.stderr
