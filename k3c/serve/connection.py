"""uvicorn's HTTP/1.1 protocol (h11) with a header timeout.

    config = uvicorn.Config(app, http=with_header_timeout(10.0), ...)

uvicorn closes a connection idle between requests after its keep-alive timeout, but one that never finishes
sending a request's headers (connected and silent, or trickling a byte at a time) it keeps forever. Here a
connection's headers must be complete within `seconds` of its opening, and of the end of its previous response on
a kept-alive connection; otherwise it is closed, with no answer (there is no request to answer). The request body's
own deadline is the app's (app.Server.body_timeout: 408).
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_timeout(seconds: float) -> type[asyncio.Protocol]:
    """An H11Protocol class whose connections close when a request's headers take longer than `seconds`."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:     # a request's headers have come
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()                               # the next request's headers: the same deadline

    return HeaderTimeoutProtocol
