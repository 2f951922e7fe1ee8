"""Every answer that is not a result, in OpenAI's error body: our own errors, FastAPI's (unknown route, wrong
method), unexpected failures, and the API key guard. Each is counted in /metrics."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specdecode.server.protocol import APIError

CountStatus = Callable[[str, int], None]  # (request path, status code) -> counted in /metrics


class ErrorResponse(JSONResponse):
    """ASCII-escaped JSON: a message may quote a path or value that is not valid UTF-8 on its own."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True).encode("ascii")


def error_response(error: APIError) -> ErrorResponse:
    return ErrorResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI, count: CountStatus) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> ErrorResponse:
        count(request.url.path, error.status)
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> ErrorResponse:
        if error.status_code == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif error.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(error.detail), None
        return await api_error(request, APIError(error.status_code, message, code=code, headers=error.headers))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> ErrorResponse:
        # A bug, not the client's mistake: still OpenAI's body and counted; the traceback goes to the server log.
        return await api_error(request, APIError(500, f"internal error: {type(error).__name__}: {error}",
                                                 "server_error"))


class APIKeyGuard:
    """Every route but the public ones answers 401 without 'Authorization: Bearer KEY' (the key compared in
    constant time; the scheme's name in any case, as RFC 7235 has it). An ASGI middleware, so FastAPI's own /docs
    and /openapi.json are guarded like the rest."""

    def __init__(self, app: ASGIApp, key: str, public_paths: frozenset[str], count: CountStatus):
        self.app = app
        self.expected = key.encode()
        self.public_paths = public_paths
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            scheme, _, credentials = given.partition(b" ")
            bearer = scheme.lower() == b"bearer"
            # The key is compared whatever the scheme, so the time taken does not tell which of the two was wrong.
            if not (hmac.compare_digest(credentials.lstrip(b" "), self.expected) and bearer):
                self.count(scope["path"], 401)
                error = APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
