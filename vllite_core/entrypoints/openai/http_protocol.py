"""uvicorn's h11 protocol with a deadline for a request's line and headers.

uvicorn times out a keep-alive connection that stays silent after a response, but nothing else: a
connection that is opened and never sends a request, or one that sends its headers a byte at a
time (slowloris), holds a socket, a file descriptor and a protocol object for ever, and enough of
them lock everyone out. Here every connection must deliver a complete request head within
``timeout_s`` of opening, or of the first byte after a finished response; otherwise it is closed.
(The body has its own deadline: ``--body-read-timeout``, a 408.)
"""
from __future__ import annotations

import asyncio
from typing import Any

DEFAULT_HEADER_READ_TIMEOUT_S = 30.0


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._between_requests():
                self._disarm()  # a request head arrived: its cycle runs
            elif self._head_timer is None:
                self._arm()  # the first bytes of the next head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.timeout_keep_alive_handler()  # uvicorn's own close of a silent connection

    return HeaderTimeoutProtocol
