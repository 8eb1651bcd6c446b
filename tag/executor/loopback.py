"""Single-machine runs listen on the loopback interface only.

torch's ``TCPStore`` server binds every interface (``*:<port>``), whatever host it is given: the
host only tells clients where to connect. A store with no authentication then accepts anybody who
can reach the machine. :func:`loopback_store` hands the store a socket already bound to
``127.0.0.1`` (``master_listen_fd``); :func:`loopback_launch_args` gives ``elastic_launch`` a
rendezvous backend whose two stores (the rendezvous store and the store the ranks share for
``init_process_group``) are such stores, and :func:`loopback_env` makes gloo's (and NCCL's
bootstrap) sockets use the loopback interface instead of the address the host name resolves to.
Runs across machines (``torchrun``) do not use any of this (SECURITY.md says what they expose).
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"
RDZV_BACKEND = "tag-loopback"
"""Name under which :func:`loopback_launch_args` registers the rendezvous backend with torch elastic."""


def loopback_store(port: int = 0, *, timeout_s: float = 300.0):
    """A ``TCPStore`` server listening on ``127.0.0.1:port`` only (``port`` 0: a free one; the
    store's ``port`` says which)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
        sock.listen(128)
        port = sock.getsockname()[1]
        # The store takes the descriptor over (and closes it with the server).
        return dist.TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=sock.detach(),
                             wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    finally:
        sock.close()  # after detach(): nothing; after a failure: the socket


def _create_handler(params):
    """torch elastic's c10d dynamic rendezvous over loopback stores (a backend creator for
    ``rendezvous_handler_registry``)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class Backend(C10dRendezvousBackend):
        name = RDZV_BACKEND  # the registry checks that the handler reports the requested name

    store = loopback_store(timeout_s=params.get_as_int("read_timeout", 60))
    handler = create_handler(store, Backend(store, params.run_id), params)
    # The store the ranks share (MASTER_ADDR/MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) is made by
    # this hook, which binds every interface too (tests/test_hardening.py checks both stores).
    handler._create_tcp_store_server = lambda addr, port: loopback_store(port)
    return handler


def loopback_launch_args() -> dict:
    """``LaunchConfig`` fields for a one-machine ``elastic_launch`` whose stores listen on
    ``127.0.0.1`` only (``local_addr`` is the MASTER_ADDR the ranks are given)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RDZV_BACKEND, _create_handler)  # idempotent for one creator
    return {"rdzv_backend": RDZV_BACKEND, "rdzv_endpoint": f"{LOOPBACK}:0", "local_addr": LOOPBACK}


@contextlib.contextmanager
def loopback_env():
    """While open: gloo's and NCCL's bootstrap sockets use the loopback interface (they otherwise
    bind the address the host name resolves to) for processes started now, unless the user set
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``. Nothing where no loopback interface is found."""
    names = {name for _, name in socket.if_nameindex()}
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    added = [k for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if lo and k not in os.environ]
    os.environ.update(dict.fromkeys(added, lo))
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
