"""A free TCP port on an address, for a server or rendezvous this process is about to start.

What it is: `free_port(host)`, the port the kernel hands out for a bind to port 0 on `host`. The
port is released before it is returned, so another process may take it first: callers that must
not race (a rendezvous) bind port 0 themselves where they can.
What it is not: a port reservation.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
