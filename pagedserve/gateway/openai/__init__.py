"""The OpenAI-compatible HTTP API over a running pagedserve.gateway.server.Gateway: the app (app.py),
request parsing (request.py, tool_calls.py), response bodies and chunks (response.py),
errors (errors.py) and the uvicorn server (server.py). Imported only for --http-port;
importing this package imports none of its modules (they need starlette, httpx, uvicorn).
See docs/ARCHITECTURE.md, "The three services".
"""
