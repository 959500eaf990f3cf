"""The config watch sees a ConfigMap-style update (the ``..data`` symlink swapped to a new
directory), an in-place rewrite and a file that vanishes, and reports each change once."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from proxy.config.model import parse_config
from proxy.process.watch import FileWatch, watched_files


def _configmap(root: Path, version: str, text: str) -> None:
    """Lay out ``root`` as the kubelet does: <root>/..<version>/f, ..data -> it, f -> ..data/f."""
    data = root / f"..{version}"
    data.mkdir()
    (data / "mmguard.yaml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(data.name)
    tmp.replace(root / "..data")  # the atomic swap
    link = root / "mmguard.yaml"
    if not link.is_symlink():
        link.symlink_to("..data/mmguard.yaml")


def test_a_symlink_swap_an_edit_and_a_removal_are_each_seen_once(tmp_path: Path) -> None:
    _configmap(tmp_path, "v1", "a: 1\n")
    path = tmp_path / "mmguard.yaml"
    seen: list[list[str]] = []

    async def changed(paths: list[str]) -> None:
        seen.append(paths)

    async def scenario() -> None:
        watch = FileWatch(lambda: [path], 0.05, changed)
        watch.start()
        await asyncio.sleep(0.3)
        assert seen == []
        _configmap(tmp_path, "v2", "a: 1\n")  # same bytes, new inode: still a new version
        await asyncio.sleep(0.6)
        assert seen == [[str(path)]]
        os.utime(path.resolve(), ns=(1, 1))
        await asyncio.sleep(0.6)
        assert len(seen) == 2
        (tmp_path / "..v2" / "mmguard.yaml").unlink()
        await asyncio.sleep(0.6)
        assert len(seen) == 3
        await asyncio.sleep(0.3)
        assert len(seen) == 3  # a missing file is one change, not one per poll
        await watch.stop()

    asyncio.run(scenario())


def test_the_files_a_reload_reads_are_watched(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s")
    cfg = parse_config({"backends": [{"kind": "triton_grpc", "name": "t", "url": "127.0.0.1:1"}],
                        "models": [{"name": "m", "backend": "t"}],
                        "canary": {"share": 0.1, "secret_file": str(secret)}})
    assert watched_files(tmp_path / "c.yaml", cfg) == [tmp_path / "c.yaml", secret]
