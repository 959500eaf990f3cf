"""Every file a doc or a comment names exists: a reader sent to a file that is not there (a
dependencies page, a rules script, both once named here) stops trusting the rest. Also no
path of one machine (a developer's work or home folder) in what the repository ships."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("proxy", "filters", "tests", "docs", "deploy", "scripts", "bench", "examples", "protos",
       "k8s", "prometheus", "grafana", "fleet", "kserve", ".ci")
NAMED = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP)
                   + r")/[\w./-]*\w\.(?:py|md|yaml|yml|json|sh|toml|proto|mjs|txt|lock))\b")
ROOT_FILES = re.compile(r"(?<![\w./-])(README\.md|pyproject\.toml)\b")
MACHINE = re.compile(r"(?<![\w.-])/(?:work|home|root)/[\w.-]+")
"""A developer's or a build machine's own folders (``/opt/...`` in the image is the image's)."""
SCANNED = (".md", ".py", ".sh", ".yaml", ".yml", ".toml", ".json", ".mjs", "Dockerfile", "run")


def shipped() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith(SCANNED) and not n.startswith("proxy/pb/")]


def _exists(name: str, where: Path) -> bool:
    """Relative to the repository, deploy/ (docs name `k8s/...`, `fleet/...`), the file's
    folder or a folder above it. What a tool writes (an ignored folder) is not required."""
    if (ROOT / name).exists() or (ROOT / "deploy" / name).exists():
        return True
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", name], cwd=ROOT)
    if ignored.returncode == 0:
        return True
    return any((d / name).exists() for d in [where.parent, *where.parent.parents]
               if ROOT in (d, *d.parents))


def test_the_pattern_finds_a_named_file() -> None:
    text = "see docs/nothing-here.md and (scripts/gone.py), not docs/architecture.md"
    assert [m.group(1) for m in NAMED.finditer(text)] == [
        "docs/nothing-here.md", "scripts/gone.py", "docs/architecture.md"]
    assert not _exists("docs/nothing-here.md", ROOT / "README.md")
    assert _exists("docs/architecture.md", ROOT / "README.md")


def test_every_named_file_exists() -> None:
    missing = []
    for path in shipped():
        if path == Path(__file__).resolve():
            continue  # its own examples name missing files on purpose
        text = path.read_text(errors="replace")
        for m in [*NAMED.finditer(text), *ROOT_FILES.finditer(text)]:
            name = m.group(1).rstrip(".")
            if "*" in name or "{" in name or "<" in name:
                continue
            if not _exists(name, path):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not missing, "\n".join(missing)


def test_no_path_of_one_machine() -> None:
    found = []
    for path in shipped():
        if path.relative_to(ROOT).parts[0] == "tests":
            continue  # tests may look for a machine's tools; what ships must not
        text = path.read_text(errors="replace")
        for m in MACHINE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not found, "\n".join(found)
