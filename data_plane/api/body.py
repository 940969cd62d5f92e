"""An OpenAI request body -> what routing reads, the same for every transport (the HTTP router and the
endpoint picker, which gets the body from Envoy).

    fields, route_input = parse_routing_body(raw, "chat", headers)   # raises BadRequest

Only the routing fields are decoded (msgspec skips the rest, and the engine gets the bytes as they
are); a body msgspec refuses (malformed, or text with a lone UTF-16 surrogate, which Python's json
accepts) is parsed again by json, for the precise error. The session policy's key is the
`x-session-id` header, else OpenAI's end-user id (`user`), else "".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from kvroute.bad_request import BadRequest
from kvroute.data_plane.ops.traffic_capture import requested_output_tokens
from kvroute.data_plane.prepare.request_prep import RouteInput
from kvroute.data_plane.prepare.tokenization import lone_surrogate

SESSION_HEADER = "x-session-id"


def error_object(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object for an HTTP status: `type` is "server_error" for 5xx, else
    "invalid_request_error" (what each field carries: data_plane/api/errors.py)."""
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


_ROUTING_FIELDS = ("model", "lora_name", "cache_salt", "user")  # strings the router hashes or compares


class RoutingFields(msgspec.Struct):
    """The body fields the router reads; everything else goes to the engine untouched."""

    model: Any = None
    messages: Any = msgspec.UNSET  # UNSET: absent (for /v1/route, which takes either kind)
    prompt: Any = None
    lora_name: Any = None
    cache_salt: Any = None
    user: Any = None
    tools: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = True
    max_tokens: Any = None
    max_completion_tokens: Any = None

    def requested_output_tokens(self) -> int:
        return requested_output_tokens({"max_tokens": self.max_tokens, "max_completion_tokens": self.max_completion_tokens})


_FIELDS_DECODER = msgspec.json.Decoder(RoutingFields)
_FIELD_NAMES = RoutingFields.__struct_fields__


def _fields_from_json(raw: bytes) -> RoutingFields:
    """The slow path: Python's json (it keeps lone surrogates, so they can be named) and its errors."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # also an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name in _ROUTING_FIELDS:
        if (found := lone_surrogate(body.get(name), name)) is not None:
            raise BadRequest(f"{found} contains a lone UTF-16 surrogate: text must be valid Unicode", param=name)
    return RoutingFields(**{name: body[name] for name in _FIELD_NAMES if name in body})


def session_key_of(headers: Mapping[str, str], body: dict) -> str:
    """The session policy's key: the `x-session-id` header, else OpenAI's end-user id (`user`), else ""."""
    header = headers.get(SESSION_HEADER, "").strip()
    if header:
        # aiohttp keeps undecodable header bytes as lone surrogates (surrogateescape); the key is hashed as UTF-8.
        if lone_surrogate(header, SESSION_HEADER) is not None:
            raise BadRequest(f"the {SESSION_HEADER} header is not valid UTF-8")
        return header
    user = body.get("user")
    return user if isinstance(user, str) else ""


def parse_routing_body(raw: bytes, kind: str, headers: Mapping[str, str]) -> tuple[RoutingFields, RouteInput]:
    """A request body -> (the fields routing reads, what request preparation takes); `headers` give the
    session key. Shared with the endpoint picker (epp.py), which gets the same body from Envoy."""
    try:  # msgspec does not look at the text of the fields it skips, and the engine gets these bytes as they are
        raw.decode()
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: it is not UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        fields = _FIELDS_DECODER.decode(raw)
    except msgspec.ValidationError as exc:  # not an object, or a number out of range
        message = "must be a JSON object" if str(exc).startswith("Expected `object`") else f"is not valid: {exc}"
        raise BadRequest(f"request body {message}") from None
    except msgspec.DecodeError:
        fields = _fields_from_json(raw)
    for name in ("lora_name", "cache_salt", "user"):  # hashed or compared as text: another type is no name
        value = getattr(fields, name)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"'{name}' must be a string, got {type(value).__name__}", param=name)
    if kind == "either" and fields.messages is not msgspec.UNSET:
        kind = "chat"
    session_key = session_key_of(headers, {"user": fields.user})
    return fields, RouteInput(
        fields.model,
        kind,
        None if fields.messages is msgspec.UNSET else fields.messages,
        fields.prompt,
        lora_name=str(fields.lora_name or ""),
        cache_salt=str(fields.cache_salt or ""),
        session_key=session_key,
        tools=fields.tools,
        template_kwargs=fields.chat_template_kwargs,
        add_generation_prompt=fields.add_generation_prompt is not False,
    )
