"""The coordinator's one error type; `http/app.py` turns it into a JSON answer with its status."""

from __future__ import annotations


class ApiError(Exception):
    """An answer other than 2xx: HTTP status, a detail that names the problem, a short reason code."""

    def __init__(self, status: int, detail: str, reason: str = "error") -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.reason = reason
