"""Helper processes die with the process that started them.

``tag execute`` (forkserver + one rank per device) and ``tag profile`` (timing workers) start
processes that, without this, keep running for minutes after a ``kill -9`` of the command,
reparented to pid 1. :func:`die_with` makes the calling process exit when a given ancestor does:

* the direct parent: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), set in
  the kernel, immediate;
* any other ancestor (the launcher above a forkserver): a daemon thread blocked on a pidfd of that
  process (``os.pidfd_open``, Linux >= 5.3), or polling it every 0.5 s where pidfds are missing.

Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading

__all__ = ["die_with"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.5  # fallback polling period when pidfd_open is unavailable


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _set_parent_death_signal() -> bool:
    """SIGKILL this process when the thread that forked it exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(pid: int) -> None:
    """Daemon thread: SIGKILL this process once ``pid`` has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        _kill_self()
        return
    except (AttributeError, OSError):
        fd = None

    def wait() -> None:
        if fd is not None:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not poller.poll():
                pass
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                threading.Event().wait(_POLL_S)
        _kill_self()

    threading.Thread(target=wait, name=f"tag-die-with-{pid}", daemon=True).start()


def die_with(ancestor: int | None = None) -> None:
    """Exit (SIGKILL) when the parent exits and, when given, when process ``ancestor`` exits.

    Call it first thing in a child process. ``ancestor`` None: the parent only (a parent that
    died before the call is only caught when it is also given as ``ancestor``)."""
    _set_parent_death_signal()
    if ancestor is not None and ancestor != os.getpid():  # also covers a parent that died before
        with contextlib.suppress(RuntimeError):  # no threads at interpreter shutdown
            _watch(ancestor)
