"""The layout the architecture promises, checked: ``proxy`` never imports ``filters`` and keys
nothing by a filter's name (filters are reached through ``proxy.lifecycle`` only), no product
module over 500 lines, no function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

from proxy.chain import filter_factories

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [p for d in ("proxy", "filters") for p in sorted((ROOT / d).rglob("*.py"))
           if "pb" not in p.relative_to(ROOT).parts]
# The admin API's command-line readers and the embedded default's config document speak of
# filters by name on purpose: they are clients of the interface, not the proxy's core.
CLIENTS = {"status.py", "report.py", "embedded.py", "demo_client.py"}
DOCUMENTS = {("proxy/config/model.py", "limits")}
"""Config data, not code keyed by a name: the default chain of a route that names none."""


def test_proxy_never_imports_filters() -> None:
    found = []
    for path in PRODUCT:
        if path.relative_to(ROOT).parts[0] != "proxy":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "filters"]
    assert found == []


def test_proxy_keys_nothing_by_a_filters_name() -> None:
    names = set(filter_factories())
    assert {"fault", "shadow", "fallback"} <= names  # the check can see what it looks for
    found = []
    for path in PRODUCT:
        if path.relative_to(ROOT).parts[0] != "proxy" or path.name in CLIENTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = (str(path.relative_to(ROOT)), node.value if isinstance(node, ast.Constant)
                     else None)
            if isinstance(node, ast.Constant) and node.value in names and where not in DOCUMENTS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
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
