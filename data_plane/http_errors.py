"""OpenAI's error object for every error the router's HTTP API answers:

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

`type` is "invalid_request_error" for 4xx and "server_error" for 5xx; `code` names the case when a
client can act on it ("context_length_exceeded", "model_not_found", "request_too_large",
"no_workers", "backend_unavailable"), else null, as OpenAI does. `openai_errors` (an aiohttp
middleware) turns aiohttp's own error pages (404 unknown path, 405 wrong method, ...) into that
shape, and an unexpected exception into a 500 with a generic message while its traceback goes to
the log. Addresses of engines and other internals are never put in a message.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

log = logging.getLogger("kvroute.router.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


def error_response(message: str, status: int, code: str | None = None, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": error_type(status), "param": param,
                                        "code": code}}, status=status, headers=headers)


def _http_exception_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"Invalid URL ({request.method} {request.path})"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return f"Method {request.method} is not allowed for {request.path} (allowed: {', '.join(sorted(exc.allowed_methods))})"
    return exc.reason


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(_http_exception_message(request, exc), exc.status, headers=allow)
    except Exception:
        if request.writer.output_size > 0:  # a streamed response had begun: aiohttp closes the connection
            raise
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return error_response("The router failed to handle the request (an internal error; its log has the details).",
                              500)
