"""HTTP connections the server drops: those that stall before their request is read, and those
past a cap on open connections.

uvicorn closes a connection idle between requests (its keep-alive timeout) but gives a request in
progress unlimited time: a client that never finishes its headers, or sends 10 of 1,000 announced
body bytes, would hold a socket and a task forever. ``guarded_h11`` is uvicorn's h11 protocol with
one deadline per request: from the request's first byte (or the connection's opening) to its last
body byte, at most ``read_timeout_s``; past it the connection is closed. Connections beyond
``max_connections`` are closed as they open, with a 503.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

_TOO_MANY = b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


def guarded_h11(read_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request read deadline and a connection cap (for
    ``uvicorn.Config(http=...)``)."""
    if read_timeout_s <= 0 or max_connections < 1:
        raise ValueError("read_timeout_s and max_connections must be positive")

    class GuardedH11Protocol(H11Protocol):
        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(_TOO_MANY)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._read_deadline is None and self._between_requests():
                self._arm()
            super().data_received(data)
            if self._request_read():
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()  # idle from here on: uvicorn's keep-alive timeout takes over
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _request_read(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete and not self.cycle.more_body

        def _arm(self) -> None:
            self._disarm()
            self._read_deadline = self.loop.call_later(read_timeout_s, self._on_read_timeout)

        def _disarm(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _on_read_timeout(self) -> None:
            self._read_deadline = None
            if not self._request_read() and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
