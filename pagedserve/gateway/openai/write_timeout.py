"""Drop an HTTP client that stops reading: ASGI middleware around the OpenAI app.

Contract: a `send` of the response that waits longer than `seconds` (uvicorn waits in
`send` while the socket's buffers are full, that is while the client reads nothing) raises
ClientTooSlow inside the app, where a streamed response ends as on a disconnect
(pagedserve.gateway.openai.app's `_Stream` aborts its request: its sequences are freed by the next
step). The middleware then returns with the response unfinished, and uvicorn closes the
connection (it logs that the response was not completed). A client that reads, however
slowly, is never dropped: only one `send` that waits the whole time counts.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("pagedserve.gateway")


class ClientTooSlow(Exception):
    """The client read nothing for the write timeout."""


class WriteTimeout:
    def __init__(self, app, seconds: float):
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_in_time(message) -> None:
            try:
                async with asyncio.timeout(self.seconds):
                    await send(message)
            except TimeoutError:
                raise ClientTooSlow(f"the client read nothing for {self.seconds:g} s "
                                    "(--http-write-timeout)") from None

        try:
            await self.app(scope, receive, send_in_time)
        except ClientTooSlow as e:
            client = scope.get("client") or ("?", 0)
            log.warning("dropped %s:%s on %s: %s; its request is aborted", client[0], client[1],
                        scope.get("path", "?"), e)
