"""HTTP transport limits for ``jakiro serve``: a uvicorn configuration whose connections must send
a complete request head within a time limit (uvicorn's own keep-alive timeout only covers idle
connections after a response), with a cap on concurrent connections."""

from __future__ import annotations

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..settings import ServeSettings

KEEP_ALIVE_S = 5


def _awaiting_request(proto: H11Protocol) -> bool:
    return proto.cycle is None or proto.cycle.response_complete


class HeaderTimeoutH11(H11Protocol):
    """Closes a connection that has not sent a whole request head ``header_timeout`` seconds
    after it opened (or after it started sending the next request on a kept-alive connection)."""

    header_timeout = ServeSettings.header_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not _awaiting_request(self):
            self._cancel_head_timer()
        elif self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_overdue)

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if _awaiting_request(self) and not self.transport.is_closing():
            self.transport.close()


def server_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  header_timeout: float = ServeSettings.header_timeout,
                  max_connections: int = ServeSettings.max_connections,
                  **kwargs) -> uvicorn.Config:
    protocol = type("JakiroH11", (HeaderTimeoutH11,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=max_connections, **kwargs)
