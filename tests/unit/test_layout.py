"""The layout the architecture promises, checked.

- ``proxy`` never imports ``filters`` and keys nothing by a filter's name (filters are reached
  through the registry and ``proxy.lifecycle`` only);
- each package of ``proxy`` imports only the packages below it (``LAYERS``), so a folder's name
  says what it may depend on; filters import only the SDK and ``proxy.wire.openai``;
- no import circle between modules (``TYPE_CHECKING`` imports included: a circle that only the
  type checker sees is still a wrong cut);
- every filter's name is written once: its entry point, which its factory's ``name`` matches;
- no product module over 500 lines, no function over 80;
- the module table of ``docs/architecture.md`` names every module, and nothing that is gone.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

from proxy.registry import filter_factories

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [p for d in ("proxy", "filters") for p in sorted((ROOT / d).rglob("*.py"))
           if "pb" not in p.relative_to(ROOT).parts]
# The admin API's command-line readers and the embedded default's config document speak of
# filters by name on purpose: they are clients of the interface, not the proxy's core.
CLIENTS = {"proxy/cli/embedded.py", "proxy/cli/demo.py"}
DOCUMENTS = {("proxy/config/model.py", "limits")}
"""Config data, not code keyed by a name: the default chain of a route that names none."""

SDK = ("proxy.call", "proxy.tensor", "proxy.errors", "proxy.contract", "proxy.clock",
       "proxy.strict", "proxy.keys", "proxy.lifecycle", "proxy.share", "proxy.chain",
       "proxy.registry", "proxy.files", "proxy.pod", "proxy.telemetry", "proxy.pb", "proxy")
"""The filter SDK: what a filter is written against. ``proxy.pod`` is the pod's decide-once
state and ``proxy.telemetry`` the one way a decision becomes visible."""
LAYERS: list[tuple[str, ...]] = [
    SDK,
    ("proxy.wire",),
    ("proxy.config",),
    ("proxy.shm",),
    ("proxy.backends",),
    ("proxy.engine",),
    ("proxy.fronts",),
    ("proxy.process",),
    ("proxy.cli",),
]
"""Bottom to top: a module may import its own layer and those below, never one above."""
FILTERS_MAY_IMPORT = (*SDK, "proxy.wire.openai", "filters")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every module ``path`` imports (at any depth of the file, ``TYPE_CHECKING`` included)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*head, base] if base else head)
            for a in node.names:  # ``from pkg import module`` depends on the module
                sub = f"{base}.{a.name}"
                yield node.lineno, sub if sub in MODULES else base


MODULES = {module_name(p): p for p in PRODUCT}


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for _, name in imports(path):
            if name in MODULES and name != m and name not in ("proxy", "filters"):
                graph[m].add(name)
    return graph


def layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or (p != "proxy" and module.startswith(p + ".")) for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: give its package a place")


def test_each_package_imports_only_what_lies_below_it() -> None:
    found = []
    for m, path in MODULES.items():
        mine = layer(m) if m.startswith("proxy") else None
        for line, name in imports(path):
            if not name.startswith(("proxy.", "filters")) or name not in MODULES:
                continue
            where = f"{path.relative_to(ROOT)}:{line}: {name}"
            if mine is None:  # a filter
                if not any(name == p or (p != "proxy" and name.startswith(p + "."))
                           for p in FILTERS_MAY_IMPORT):
                    found.append(where)
            elif name.startswith("filters") or layer(name) > mine:
                found.append(where)
    assert found == []


def test_no_import_circle() -> None:
    graph, circles = edges(), []
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_a_filters_name_is_its_entry_point() -> None:
    factories = filter_factories()
    names = {ep.name for ep in entry_points(group="mmguard.filters")}
    assert names == set(factories) and {"fault", "shadow", "fallback"} <= names
    assert {n: f.name for n, f in factories.items()} == {n: n for n in factories}


def test_proxy_keys_nothing_by_a_filters_name() -> None:
    names = set(filter_factories())
    found = []
    for path in PRODUCT:
        rel = str(path.relative_to(ROOT))
        if path.relative_to(ROOT).parts[0] != "proxy" or rel in CLIENTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and node.value in names
                    and (rel, node.value) not in DOCUMENTS):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert found == []


def test_no_module_over_500_lines_nor_function_over_80() -> None:
    long_modules = [f"{p.relative_to(ROOT)}: {n}" for p in PRODUCT
                    if (n := p.read_text().count("\n")) > 500]
    long_functions = []
    for path in PRODUCT:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.name}: {lines}")
    assert long_modules == [] and long_functions == []


def test_the_architecture_docs_module_table_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    named = set(re.findall(r"`((?:proxy|filters)/[\w/]+(?:\.py|/))`", table))
    files = {str(p.relative_to(ROOT)) for p in PRODUCT if p.name != "__init__.py"}
    folders = {str(p.parent.relative_to(ROOT)) + "/" for p in PRODUCT if p.name == "__init__.py"}
    covered = {f for f in files if f in named or any(f.startswith(d) for d in named
                                                         if d.endswith("/") and d in folders)}
    assert sorted(files - covered) == [], "modules the table does not name"
    assert sorted(n for n in named if n not in files and n not in folders) == [], "names gone"
