"""Errors a client can cause, each with the HTTP status and code the API answers with."""

from __future__ import annotations


class ApiError(Exception):
    """A refusal the API turns into `{"error": {"message", "code"}}` with `status`."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class BadRequest(ApiError):
    status = 400
    code = "bad_request"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class Conflict(ApiError):
    status = 409
    code = "conflict"
