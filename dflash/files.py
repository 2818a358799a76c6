"""Small file helpers with one owner each: replacing a file atomically, a byte count for people."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write `data` to a hidden temporary sibling of `path`, then rename it over `path`: a kill leaves the
    old file or the new one, never a mix. An OSError names `path`, not the temporary file; the temporary
    file is removed on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e


def format_bytes(n: int) -> str:
    """`n` bytes for a log line: GiB from 1 GiB on, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
