"""Small file helpers shared by every subpackage."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """TAG's user cache folder: ``$TAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/tag``, else ``~/.cache/tag``."""
    return user_dir("cache")


def total_ram_bytes() -> int:
    """This machine's memory, bytes (``MemTotal`` of ``/proc/meminfo``, else ``sysconf``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # /proc/meminfo reports kB (KiB)
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace``.

    A crash or kill mid-write leaves either the old file or the new one, never a torn file.
    The file keeps the mode of the file it replaces; a new file gets the mode ``open()`` would
    give it (0o666 less the umask), not mkstemp's private 0o600. A device node, FIFO or socket at
    ``path`` is refused (ValueError): the rename would replace it (``/dev/full`` became a file).
    """
    p = Path(path)
    kind = special_kind(p)
    if kind is not None:  # os.replace would put a regular file where the node was
        raise ValueError(f"{p}: not a regular file ({kind}); refusing to replace it")
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


def check_folder(path: str | os.PathLike, error: type[Exception], what: str) -> None:
    """``error`` (one line naming ``what`` and the path) unless ``path`` is a folder or can be
    made one: neither it nor the nearest existing path above it is a file. Checked before any
    work, so that a command does not fail at its end on the folder it writes into."""
    p = Path(path)
    for q in (p, *p.absolute().parents):
        if q.exists():
            if not q.is_dir():
                at = "" if q == p else f" ({q} is a file)"
                raise error(f"{what}: {p} is not a folder{at}; expected a folder, new or existing")
            return


def special_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a folder (links
    followed): ``"a character device"``, ``"a block device"``, ``"a FIFO"``, ``"a socket"``; else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # absent (or a dangling link): written as a new file
        return None
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def check_output_file(path: str | os.PathLike, error: type[Exception], what: str) -> None:
    """``error`` (one line naming ``what`` and the path) unless an atomic write
    (:func:`write_atomic`) can put a file at ``path``: not a device node, FIFO or socket, and its
    folder is one (:func:`check_folder`) that this process can create files in (tried: a file
    made and removed in the nearest folder that exists; access rights alone say nothing of a
    read-only file system, nor for root). Checked before any work, so that a command does not
    fail at its end on what it writes."""
    p = Path(path)
    kind = special_kind(p)
    if kind is not None:
        raise error(f"{what}: {p} is not a regular file ({kind}); refusing to replace it; expected a file name")
    check_folder(p.parent, error, what)
    check_writable(p.parent, error, what)


def check_writable(folder: str | os.PathLike, error: type[Exception], what: str) -> None:
    """``error`` (one line) unless this process can create files in ``folder`` or, where it does
    not exist yet, in the nearest folder above it that does (where it would be made)."""
    q = Path(folder).absolute()
    while not q.exists() and q != q.parent:
        q = q.parent
    try:
        fd, probe = tempfile.mkstemp(dir=q, prefix=".tag-probe-")
    except OSError as e:
        raise error(f"{what}: cannot write into {q}: {e.strerror}; expected a folder this user can write") from None
    os.close(fd)
    os.unlink(probe)


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
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror}") from e
    except UnicodeDecodeError as e:  # a binary file
        raise error(f"{p}: cannot read {what}: not UTF-8 text (byte {e.start}); expected a JSON file") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{p}: line {e.lineno}: not valid JSON: {e.msg}") from e
    except ValueError as e:  # an integer of 5,000 digits: beyond int()'s limit on decimal digits
        raise error(f"{p}: not valid JSON: {huge_integer(e)}; expected a {what} file") from None
    except RecursionError as e:  # '[' * 100000: deeper than the parser's recursion
        raise error(f"{p}: not valid JSON: nested too deeply; expected a {what} file") from e


def huge_integer(exc: ValueError) -> str:
    """What a ValueError of int() on a huge decimal string says, in one line without its advice
    to raise the limit (Python's 4,300 digits, ``sys.get_int_max_str_digits``)."""
    import re
    import sys

    m = re.search(r"value has (\d+) digits", str(exc))
    digits = f"of {m.group(1)} digits" if m else "too long"
    return f"an integer {digits} (at most {sys.get_int_max_str_digits()} digits are read)"


def save_tensors(path: str | os.PathLike, obj: Any) -> None:
    """Atomically ``torch.save`` ``obj``: tensors and plain containers (dict, list, tuple, str,
    numbers), so that :func:`load_tensors` can read it back without unpickling code."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    write_atomic(path, buf.getvalue())


def load_tensors(path: str | os.PathLike, error: type[Exception], what: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU: tensors and plain containers only,
    never any other Python object (a pickle naming a function or class is refused before anything
    runs). ``error`` with one line naming the file otherwise. The one way TAG reads ``.pt`` files:
    a file a user was handed must never run code."""
    import pickle
    import re
    import warnings

    import torch

    p = Path(path)
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error says enough
            warnings.simplefilter("ignore")
            return torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise error(f"{p}: {what} not found") from None
    except pickle.UnpicklingError as e:
        # torch's message is many lines; one of them names the refused global (or pickle opcode).
        m = re.search(r"Unsupported (?:global: GLOBAL ([\w.]+)|operand (\d+))", str(e))
        which = f" (global {m.group(1)})" if m and m.group(1) else f" (pickle opcode {m.group(2)})" if m else ""
        raise error(f"{p}: not a {what}: it holds Python objects{which} beyond tensors and plain "
                    "containers; refused to unpickle it") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for a torn or foreign file
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise error(f"{p}: not a {what}: {first}") from None


# ------------------------------------------------------------------------ where commands write


def checkout_root() -> Path | None:
    """The repository TAG runs from (the folder holding TAG's ``pyproject.toml`` next to the ``tag``
    package: a clone, or an editable install of one), or None for an installed package."""
    root = Path(__file__).resolve().parents[1]
    try:
        ours = 'name = "tag-planner"' in (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return root if ours else None


def user_dir(kind: str) -> Path:
    """TAG's per-user folder (XDG base directories): ``kind`` ``"cache"`` is ``$TAG_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/tag``, else ``~/.cache/tag``; ``"data"`` is ``$TAG_DATA_DIR``, else
    ``$XDG_DATA_HOME/tag``, else ``~/.local/share/tag``."""
    home = {"cache": ".cache", "data": ".local/share"}[kind]
    override = os.environ.get(f"TAG_{kind.upper()}_DIR")
    if override:
        return Path(override)
    return Path(os.environ.get(f"XDG_{kind.upper()}_HOME") or Path.home() / home) / "tag"


def output_dir(rel: str) -> Path:
    """Default location of what a command writes unless told where (``rel``, e.g.
    ``"runs/predictor"``): ``<checkout>/<rel>`` when TAG runs from a checkout, else
    ``<user data folder>/<rel>`` (:func:`user_dir`), never inside an installed package nor the
    current folder."""
    return (checkout_root() or user_dir("data")) / rel
