"""``tag`` command line: thin entry points that parse, build, run.

Each command lives in its own module of this package exposing ``register(subparsers)``, which
adds its parser and sets ``func`` to a ``run(args) -> int`` function. Errors caused by input
(:class:`tag.errors.TagError`) print ONE line and exit 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys

from .. import __version__
from ..errors import TagError
from .common import HelpFormatter

# Command modules, in --help order. Each defines register(subparsers).
COMMANDS = ["inspect", "topology", "profile", "simulate", "plan", "execute", "run", "validate", "train", "tune",
            "bench"]


class _Parser(argparse.ArgumentParser):
    """Argument errors are ONE line too (``tag plan: error: argument --batch: ...``), like every
    other input error; subcommand parsers inherit the class, and its help formatter, which shows
    every option's default."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tag", description="TAG: topology-aware deployment of PyTorch training on heterogeneous GPUs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"tag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{name}":
                continue  # command not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or an argument error already printed in one line
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # Explicit on TAG's own logger too (basicConfig does nothing when logging is already set up):
    # what TAG hides unless --debug (torch's dumps, warnings) asks it.
    logging.getLogger("tag").setLevel(logging.DEBUG if args.debug else logging.NOTSET)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TagError as e:
        if args.debug:
            raise
        print(f"tag {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # (Interrupted: with what was kept, e.g. tag execute's run folder)
        print(f"tag {args.command}: interrupted" + (f": {e}" if str(e) else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`tag topology show X | head -1`): stop, as cat does
        return _closed_stdout()


def _closed_stdout() -> int:
    """Exit status after a write to a closed pipe: 128 + SIGPIPE, stdout pointed at /dev/null so
    that the interpreter's flush at exit does not fail on it again (Python's documented recipe)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def entry() -> int:
    """The ``tag`` program (``python -m tag`` and the installed script): :func:`main`, then the
    process's objects are frozen (``gc.freeze``) so that the interpreter's last garbage collection
    at exit skips them.

    That collection walks and frees every object in a reference cycle, after a capture the
    millions of torch, transformers and graph objects: 2-3.5 CPU s of ``tag inspect --model
    gpt2-small`` (of ~20; /usr/bin/time, 2026-11-26) spent after the output is written, for
    memory the OS takes back at exit anyway. ``main`` has closed its files by then (:mod:`tag.io`
    writes them whole); only ``__del__`` of objects in such cycles does not run, as Python does not
    promise it at exit. Tests call :func:`main`, which leaves the collector as it was."""
    code = main()
    try:
        sys.stdout.flush()  # what is still buffered, here rather than in the interpreter's exit
    except BrokenPipeError:
        code = _closed_stdout()
    gc.freeze()
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(entry())
