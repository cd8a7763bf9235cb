"""A free TCP port on this host, for the rendezvous of a single-node process group."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it); pass it as ``MASTER_PORT`` to every rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
