"""A free TCP port on loopback: the one helper every launcher, the dev cluster and the tests use.

The port is released before its user binds it; another process could take it in between,
which on a test machine is rare enough that a clear "address in use" from the component is
the right answer (callers that start a server retry where that matters).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
