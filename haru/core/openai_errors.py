"""OpenAI's error shape and the one status table, shared by the gateway and the agent's serving port.

    body = error_body(404, "model_not_found", "the model `x` does not exist", "model")
    status, code = answer_status("lost", "gpu_detached")        # (503, "gpu_detached")
    model = model_of(request_body)                              # the model asked for, or a BadBody (400)

Pure: no I/O. Both surfaces that answer OpenAI clients (the gateway's proxy and control API, the
agent's serving port) build every error body here, so a client sees the same `type` and `code` for the
same condition wherever it asked. `ANSWER_STATUS` maps a router answer (`haru.core.residency.ANSWERS`) to
an HTTP status and OpenAI `error.code`: docs/design.md's "What a client is told" table, read by code, tests and
docs alike.
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = [
    "ANSWER_STATUS",
    "BadBody",
    "ERROR_TYPES",
    "NOT_RETRYABLE",
    "TOO_DEEP",
    "answer_status",
    "error_body",
    "error_type",
    "model_of",
    "FLEET_NOT_FOUND",
    "MODEL_NOT_FOUND",
    "NO_ACTIVE_DOMAIN",
    "INVALID_REQUEST",
    "REQUEST_TIMEOUT",
    "PAYLOAD_TOO_LARGE",
    "UPSTREAM_TIMEOUT",
    "UPSTREAM_UNREACHABLE",
    "UNAUTHORIZED",
]

# answer (or answer:reason) -> (HTTP status, error.code)
ANSWER_STATUS: Final[dict[str, tuple[int, str]]] = {
    "warming": (503, "model_warming"),
    "asleep": (503, "model_asleep"),
    "lost:gpu_detached": (503, "gpu_detached"),
    "lost": (503, "model_lost"),
    "not_admitted": (409, "model_not_admitted"),
    "unknown": (503, "residency_unknown"),
}

# Conditions that are not router answers.
FLEET_NOT_FOUND: Final = (404, "fleet_not_found")
MODEL_NOT_FOUND: Final = (404, "model_not_found")
NO_ACTIVE_DOMAIN: Final = (503, "no_active_domain")
INVALID_REQUEST: Final = (400, "invalid_request")
UNAUTHORIZED: Final = (401, "unauthorized")
REQUEST_TIMEOUT: Final = (408, "request_timeout")
PAYLOAD_TOO_LARGE: Final = (413, "payload_too_large")
UPSTREAM_TIMEOUT: Final = (504, "upstream_timeout")
UPSTREAM_UNREACHABLE: Final = (502, "upstream_unreachable")

# OpenAI's `error.type` per HTTP status. The SDKs pick their exception class from the status
# (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 409 ConflictError,
# 413 APIStatusError, >= 500 InternalServerError); `type` is informative. A 404 is OpenAI's
# `invalid_request_error` (what api.openai.com says for an unknown model), not a type of our own.
ERROR_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "upstream_error",
}

# Statuses a client must not retry: the same request would get the same answer.
NOT_RETRYABLE: Final = frozenset({400, 401, 404, 405, 409, 413})

TOO_DEEP: Final = (
    "request body is nested too deeply to be read (more levels than the JSON decoder allows); "
    "send a flatter JSON object"
)


def error_type(status: int) -> str:
    """OpenAI's `error.type` for an HTTP status."""
    return ERROR_TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")


def answer_status(answer: str, reason: str = "") -> tuple[int, str]:
    """(HTTP status, error.code) for a router answer that is not `ready` (a reason may refine it)."""
    return ANSWER_STATUS.get(f"{answer}:{reason}") or ANSWER_STATUS.get(answer) or ANSWER_STATUS["unknown"]


_encode = msgspec.json.Encoder().encode


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return _encode({"error": {"message": message, "type": error_type(status), "param": param, "code": code}})


# ----------------------------------------------------------------------------- the request body


class BadBody(msgspec.Struct, frozen=True):
    """Why a request body names no model: the 400 `invalid_request`'s message, and the param it is about."""

    message: str
    param: str | None = None


class _ModelOnly(msgspec.Struct):
    """The only part of a request body the gateway and the serving port read."""

    model: str


_decode_model = msgspec.json.Decoder(_ModelOnly).decode


def model_of(body: bytes) -> str | BadBody:
    """`model` from a JSON request body, or what is wrong and where (msgspec's path)."""
    try:
        model = _decode_model(body).model
    except msgspec.ValidationError as exc:
        text = str(exc)
        return BadBody(f"invalid request body: {text}", "model" if "`model`" in text or "$.model" in text else None)
    except msgspec.DecodeError as exc:
        if not body.strip():
            return BadBody("request body is empty: send a JSON object with a `model` field")
        return BadBody(f"request body is not valid JSON: {exc}")
    except RecursionError:  # msgspec refuses a body nested thousands deep this way
        return BadBody(TOO_DEEP)
    if not model:
        return BadBody("invalid request body: `model` is empty - at `$.model`", "model")
    return model
