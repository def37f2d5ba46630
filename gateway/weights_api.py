"""The control API's traffic weights: POST /v1/fleets/{fleet}/weights.

    POST /v1/fleets/{fleet}/weights   {"weights": {"b": 10}, "model": "qwen3:0.6b"}   b gets 10%, the active the rest
                                      {"reset": true [, "model": ...]}                  the active takes all again

It asks for a `weighting` operation (haru.log.requests), as `haru route weight` does: 202 accepted
(or joined) with the op_id (the domain given a new share is woken and probed first, then the promoter
records the split), 200 when the split is already so, 400 `invalid_weights` for weights that cannot
apply (an unknown domain, shares that do not add up, a model the active does not serve), 409 when
another operation is in flight (`conflict`) or the domain cannot be woken now (`refused`), 404 for no
such fleet. The split in force is in GET /v1/fleets/{fleet}/route-intent (`weights`, `model_weights`).
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import structlog
from aiohttp import web

from haru.gateway.control import Control, json_response, request_body, requested
from haru.gateway.errors import ApiError
from haru.log.requests import request_weights

log = structlog.get_logger("haru.gateway")

STATUS = {
    "noop": 200,
    "accepted": 202,
    "joined": 202,
    "conflict": 409,
    "refused": 409,
    "not_found": 404,
    "invalid": 400,
}


class _WeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    weights: dict[str, int] = {}
    model: str = ""
    reset: bool = False


_decode = msgspec.json.Decoder(_WeightsBody).decode


async def post_weights(control: Control, request: web.BaseRequest, fleet: str) -> web.Response:
    fleet = control._fleet(fleet)
    body = await request_body(
        request, _decode, _WeightsBody(), param="weights", hint=' (send {"weights": {"b": 10}} or {"reset": true})'
    )
    events = control._need_log()
    result = await requested(
        request_weights(
            events, fleet, body.weights, model=body.model, reset=body.reset, by=control.writer, now=datetime.now(UTC)
        ),
        invalid="invalid_weights",
    )
    status = STATUS.get(result.status, 500)
    if result.status == "invalid":
        raise ApiError(400, "invalid_weights", result.message, param="weights")
    log.info(
        "gateway.weights_requested",
        fleet=fleet,
        weights=body.weights,
        model=body.model,
        reset=body.reset,
        status=result.status,
        op_id=result.op_id,
    )
    out = {
        "op_id": result.op_id,
        "status": result.status,
        "message": result.message,
        "fleet": fleet,
        "kind": "weighting",
        "weights": body.weights,
        "model": body.model,
        "reset": body.reset,
    }
    return json_response(out, status, {"x-should-retry": "false"} if status >= 400 else None)
