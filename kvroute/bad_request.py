"""The one error for input that cannot be answered as sent, in every plane.

    raise BadRequest("every KeyChain needs a block_size (got 0)")        # gRPC: INVALID_ARGUMENT
    raise BadRequest("body too large", 413, code="request_too_large")    # HTTP: OpenAI's error object

`status` is the HTTP status (400 unless said); `code` and `param` are OpenAI's error fields. A gRPC
servicer answers it with INVALID_ARGUMENT and its message.
"""

from __future__ import annotations


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
