"""OpenAI's error object for every error the router's HTTP API answers:

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

`type` is "invalid_request_error" for 4xx and "server_error" for 5xx; `code` names the case when a
client can act on it ("context_length_exceeded", "model_not_found", "request_too_large",
"no_workers", "backend_unavailable"), else null, as OpenAI does. `openai_errors` (an aiohttp
middleware) turns aiohttp's own error pages (404 unknown path, 405 wrong method, ...) into that
shape, and an unexpected exception into a 500 with a generic message while its traceback goes to
the log. Addresses of engines and other internals are never put in a message.

Errors relayed from an engine take the same shape (`engine_error_body`, used by the proxy on a
non-streamed answer whose status is >= 400, before any byte reached the client): the engine's
message is kept, `type` follows the status as above, `param` and `code` are kept only when they
are strings, as OpenAI's are. Read from vLLM's `{"error": {"message", "type": "BadRequestError",
"param", "code": 400}}` (vllm/entrypoints/openai/protocol.py ErrorResponse), SGLang's and older
vLLM's flat `{"object": "error", "message", "type", "param", "code": 400}`
(sglang/srt/entrypoints/openai/protocol.py ErrorResponse), FastAPI's `{"detail": ...}` and any
other body (its text is the message).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from aiohttp import web

from kvroute.data_plane.api.body import error_object

log = logging.getLogger("kvroute.router.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(
    message: str, status: int, code: str | None = None, param: str | None = None, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.json_response(error_object(message, status, code, param), status=status, headers=headers)


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
        return error_response("The router failed to handle the request (an internal error; its log has the details).", 500)


MAX_ENGINE_TEXT = 2000  # characters of a non-JSON engine error kept as the message (an HTML error page...)


def engine_error_body(status: int, body: bytes, headers: Iterable[tuple[str, str]]) -> bytes | None:
    """An engine's error answer (`status` >= 400, `body` whole) as OpenAI's error object, or None when
    the body is content-encoded (compressed: relayed as it is)."""
    for name, value in headers:
        if name.lower() == "content-encoding" and value.strip().lower() not in ("", "identity"):
            return None
    message, param, code = _engine_error_fields(body)
    if not message:
        message = f"the engine answered HTTP {status} with no message"
    return json.dumps(error_object(message, status, code, param)).encode()


def _engine_error_fields(body: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an engine's error body, whatever its shape."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return text[:MAX_ENGINE_TEXT], None, None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):  # vLLM, OpenAI-compatible servers
        parsed = parsed["error"]
    if not isinstance(parsed, dict):
        return _as_text(parsed), None, None
    if "message" in parsed:  # vLLM's inner object; SGLang's and older vLLM's flat one
        message = parsed["message"]
    elif "detail" in parsed:  # FastAPI's own errors (422 validation: a list of {loc, msg})
        message = _fastapi_detail(parsed["detail"])
    elif isinstance(parsed.get("error"), str):  # {"error": "..."}
        message = parsed["error"]
    else:
        message = parsed
    param, code = parsed.get("param"), parsed.get("code")
    return (_as_text(message), param if isinstance(param, str) else None, code if isinstance(code, str) and code else None)


def _fastapi_detail(detail: object) -> object:
    if isinstance(detail, list) and all(isinstance(d, dict) and "msg" in d for d in detail):
        return "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', ()))}: {d['msg']}" if d.get("loc") else str(d["msg"]) for d in detail
        )
    return detail


def _as_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)[:MAX_ENGINE_TEXT]
