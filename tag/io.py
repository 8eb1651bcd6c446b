"""Small file helpers shared by every subpackage."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """TAG's user cache folder: ``$TAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/tag``, else ``~/.cache/tag``."""
    override = os.environ.get("TAG_CACHE_DIR")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tag"


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace``.

    A crash or kill mid-write leaves either the old file or the new one, never a torn file.
    The file keeps the mode of the file it replaces; a new file gets the mode ``open()`` would
    give it (0o666 less the umask), not mkstemp's private 0o600.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = p.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask (read by setting it, then restoring it at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> None:
    """Atomically write ``obj`` as JSON."""
    write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def read_json(path: str | os.PathLike, error: type[Exception], what: str) -> Any:
    """The JSON in ``path``; ``error`` with one line naming the file otherwise (``<path>: cannot
    read <what>: <reason>`` or ``<path>: line N: not valid JSON: <reason>``)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{p}: line {e.lineno}: not valid JSON: {e.msg}") from e
