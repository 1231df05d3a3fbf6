"""pagedserve.gateway.openai.write_timeout around the app's streamed responses (pagedserve.gateway.openai.app
_Stream): a client that reads nothing for the write timeout is dropped and its request
aborted; one that reads, however slowly in all, gets every event."""
import asyncio

from pagedserve.gateway.openai.app import _Stream
from pagedserve.gateway.openai.write_timeout import WriteTimeout

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "path": "/v1/completions",
         "client": ("127.0.0.1", 5000)}


async def events(n: int):
    for i in range(n):
        yield f"data: {i}\n\n"


async def no_disconnect():
    await asyncio.Event().wait()


def serve(send, timeout: float, n: int = 50) -> list:
    """Stream `n` events to `send` through the middleware; the times on_close ran."""
    closed = []

    async def main():
        app = WriteTimeout(_Stream(events(n), lambda: closed.append(True)), timeout)
        await asyncio.wait_for(app(SCOPE, no_disconnect, send), 30)
    asyncio.run(main())
    return closed


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted():
    sent = []

    async def send(message):
        if len(sent) == 4:  # the client's buffers are full: this send never returns
            await asyncio.Event().wait()
        sent.append(message)

    assert serve(send, timeout=0.05) == [True]
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert not any(m.get("more_body") is False for m in sent)  # left unfinished: uvicorn closes it


def test_a_client_that_reads_slowly_gets_every_event():
    sent = []

    async def send(message):
        await asyncio.sleep(0.02)  # each send waits a little; all of them together, past the timeout
        sent.append(message)

    assert serve(send, timeout=0.5, n=40) == [True]
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 41 and sent[-1]["more_body"] is False
    assert bodies[39] == b"data: 39\n\n"


def test_other_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["type"], send))

    async def send(message):
        pass

    asyncio.run(WriteTimeout(app, 0.01)({"type": "lifespan"}, no_disconnect, send))
    assert seen == [("lifespan", send)]
