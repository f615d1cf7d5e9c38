"""Finding free TCP ports on the loopback interface (for servers started side by side)."""
from __future__ import annotations

import socket


def is_free(port: int, host: str = '127.0.0.1') -> bool:
    """Whether ``port`` on ``host`` can be bound now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(count: int = 1, host: str = '127.0.0.1') -> int:
    """A port ``p`` such that ``p`` .. ``p + count - 1`` on ``host`` are free now (another process may
    take them before they are bound)."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port + count <= 65536 and all(is_free(port + i, host) for i in range(1, count)):
            return port
