"""A 404 from JetStream is read as "nothing stored there" only when it says so (haru/log/jetstream.py).

"stream not found" (10059) is a 404 like "no message found" (10037): the server that answered has no
assignment for the stream (never created, or a meta leader whose assignments lag after an election).
Read as empty, a gateway's resync would take its route for rewound and a restarting projector would fold
a fleet from nothing.
"""

from __future__ import annotations

import nats.js.errors as js_errors
import pytest

from haru.core.errors import LogUnavailable, StreamUnknown
from haru.log.jetstream import NO_MESSAGE_FOUND, holds_nothing, not_an_answer


def api_404(err_code: int | None) -> js_errors.NotFoundError:
    return js_errors.NotFoundError(code=404, err_code=err_code, description="stream not found")


def as_kv_get(err: BaseException) -> js_errors.KeyNotFoundError:
    """What nats-py's KV get raises in its place (`raise KeyNotFoundError` in an except clause)."""
    try:
        try:
            raise err
        except js_errors.NotFoundError:
            raise js_errors.KeyNotFoundError()  # noqa: B904 - as nats-py does: the 404 stays its __context__
    except js_errors.KeyNotFoundError as exc:
        return exc


@pytest.mark.parametrize("make", [lambda e: e, as_kv_get], ids=["get_msg", "kv_get"])
def test_only_no_message_found_means_nothing_is_stored(make):
    assert holds_nothing(make(api_404(NO_MESSAGE_FOUND)))
    assert holds_nothing(make(api_404(None)))  # a direct get's 404 status: no code, and only ever "no message"
    assert not holds_nothing(make(api_404(10059)))


def test_a_stream_the_server_does_not_know_yet_is_unavailable_and_says_why():
    exc = not_an_answer("reading view rf", as_kv_get(api_404(10059)))
    assert isinstance(exc, StreamUnknown) and isinstance(exc, LogUnavailable)
    assert "code 10059" in str(exc) and "meta leader" in str(exc) and "haru up" in str(exc)


def test_a_direct_gets_404_raised_while_handling_another_error_is_still_no_message():
    """nats-py raises a direct get's NotFoundError with no code; raised inside an except clause (a writer
    reading the stored message after a Conflict), its __context__ is that other error, not JetStream's answer."""
    try:
        try:
            raise js_errors.APIError(code=400, err_code=10071, description="wrong last sequence")
        except js_errors.APIError:
            raise js_errors.NotFoundError()  # noqa: B904 - as nats-py's direct get does
    except js_errors.NotFoundError as exc:
        assert holds_nothing(exc)
