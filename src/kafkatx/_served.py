"""An HTTP endpoint kafkatx serves from a daemon thread (metrics, health probes): where it is, and how it stops."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ServedEndpoint"]


class ServedEndpoint:
    """A running HTTP server: ``url`` and ``port`` (the one picked for port 0); :meth:`stop` frees the port."""

    #: Appended to ``url``: the route a user points a scraper at, if there is one.
    path = ""

    def __init__(self, server: Any, thread: threading.Thread, addr: str) -> None:
        self._server: Any = server
        self._thread = thread
        self.addr = addr
        self.port: int = int(server.server_address[1])

    @property
    def url(self) -> str:
        """``http://addr:port`` and the endpoint's path (IPv6 addresses in brackets)."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}{self.path}"

    def stop(self) -> None:
        """Stop serving and free the port. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(5)

    def __enter__(self) -> ServedEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"
