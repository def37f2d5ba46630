"""The gateway's exceptions. A leaf module: it imports nothing from the `gateway` package.

GatewayError                (haru.core.errors.HaruError)
├── ApiError                an HTTP answer that is a refusal: status, OpenAI `error.code`, message
└── UpstreamError           an upstream could not be reached, or broke off           (the domain's)
    └── ProtocolError       what an upstream sent is not an HTTP/1.1 response         (the domain's)
"""

from __future__ import annotations

from haru.core.errors import HaruError


class GatewayError(HaruError):
    """Base of every error the gateway raises on purpose."""


class ApiError(GatewayError):
    """A request the gateway answers with an error body (OpenAI's shape) instead of a result.

    `retry_after` (seconds) becomes a `Retry-After` header; `param` names the offending field.
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        super().__init__(message)


class UpstreamError(GatewayError):
    """An upstream could not be reached or broke off; the message says how.

    `retryable` is True only for a reused keep-alive connection that closed before a single byte of
    the response: the request may not have been seen, and is sent once more on a fresh connection.
    """

    retryable = False


class ProtocolError(UpstreamError):
    """An upstream sent something that is not an HTTP/1.1 response."""
