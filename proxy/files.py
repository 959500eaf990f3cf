"""Reading a file that the operator's config names, bounded.

Guards against a config key pointed at something that is not a small file: ``/dev/zero`` as a
``secret_file`` or ``cert_file`` (a plain ``read_bytes()`` grew the process by 2.9 GB before a
reload was refused, with an empty reason), a FIFO (an ``open`` that never returns), a
directory, or a 2 GiB file where a 40-byte token was meant.

What MUST hold:
- The file is opened without blocking (``O_NONBLOCK``: opening a FIFO with no writer returns
  at once), checked with ``fstat`` on the open descriptor (no race between check and read), and
  refused unless it is a regular file of at most ``limit`` bytes.
- At most ``limit + 1`` bytes are ever read, so a file that grows after ``fstat`` is refused
  too, never read whole.
- Every refusal is a ``ValueError`` whose message names the file, what it is, and the limit:
  the config error, the reload's 409 and ``check-config`` print it as it is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB

SECRET_BYTES = 64 * KiB
"""Tokens and keys read from a file (``token_file``, ``secret_file``)."""
PEM_BYTES = 4 * MiB
"""A certificate chain, private key or CA bundle (a full public CA bundle is ~250 KiB)."""
CONFIG_BYTES = 32 * MiB
"""The config file itself."""
DATA_BYTES = 64 * MiB
"""Small data files a filter reads (a drift baseline, a tokenizer's vocabulary)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def regular_file_problem(path: Path, limit: int | None = None) -> str | None:
    """Why ``path`` may not be read as a config file (None when it may): missing, not a regular
    file, or (with ``limit``) larger than ``limit`` bytes. Follows symlinks, as a read does."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is {_kind(st.st_mode)}; a regular file is expected"
    if limit is not None and st.st_size > limit:
        return f"{path} is {st.st_size} bytes; at most {limit} bytes are read from it"
    return None


def read_bounded(path: Path | str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; ``ValueError`` naming the file
    and the reason otherwise (missing, unreadable, not a regular file, too large)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {_kind(st.st_mode)}; a regular file is expected")
        if st.st_size > limit:
            raise ValueError(f"{path} is {st.st_size} bytes; at most {limit} bytes are read "
                             "from it")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise ValueError(f"{path} grew past {limit} bytes while it was read; at most "
                             f"{limit} bytes are read from it")
        return b"".join(chunks)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
