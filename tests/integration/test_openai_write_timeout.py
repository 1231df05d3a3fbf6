"""--http-write-timeout over a real socket: a streaming client that stops reading is dropped
once the server's buffers are full and the timeout passes, its request aborted (its blocks
freed) long before its output would have ended; it never gets `[DONE]`."""
import json
import socket
import time

from pagedserve.gateway.openai.server import start_openai
from tests.support.openai_server import Server


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted(tokenizer):  # noqa: F811
    s = Server(tokenizer, num_blocks=1024, delay=0.005)  # 2000 tokens: over 10 s of steps
    try:
        s.g._call(s.http.stop())
        s.http = s.g._call(start_openai(s.g.gateway, "127.0.0.1", 0, write_timeout=0.5))
        for server in s.http.server.servers:  # small buffers, inherited by accepted sockets
            for sock in server.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        s.g.wait_ready()
        body = json.dumps({"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                           "logprobs": 5}).encode()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", s.http.port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while not s.g.runner.loop.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.g.runner.loop.requests  # it runs, while the client reads nothing
        while s.g.runner.loop.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not s.g.runner.loop.requests and s.wait_unreferenced() == 0
        client.settimeout(10)
        data = b""
        while chunk := client.recv(1 << 16):  # what the buffers held, then the server's close
            data += chunk
        client.close()
        assert data.startswith(b"HTTP/1.1 200") and b"[DONE]" not in data
        assert 0 < data.count(b"data: ") < 2000
    finally:
        s.close()
