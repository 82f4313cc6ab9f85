"""The coordinator's one error type; `http/app.py` turns it into a JSON answer with its status."""

from __future__ import annotations


class ApiError(Exception):
    """An answer other than 2xx: HTTP status, a detail that names the problem, a short reason code."""

    def __init__(
        self, status: int, detail: str, reason: str = "error", headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.reason = reason
        self.headers = headers or {}
        """Extra response headers (Retry-After on a 429, the server's time on a clock refusal)."""
