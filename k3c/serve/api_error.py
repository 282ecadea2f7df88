"""OpenAI's error object, and the 400 that names a request field (protocol.py and tools.py raise them)."""
from __future__ import annotations


class APIError(Exception):
    """An error the client caused (4xx) or the server could not avoid (5xx), as OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def field_error(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param=param or None, code=code)


def json_kind(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)
