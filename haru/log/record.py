"""JetStream's names for an append's headers: the expected last sequence of its subject, its
deduplication id, and an atomic batch's. The record itself and the chain arithmetic (`Record`, `body_hash`, `msg_id`,
`decode_record`) are the core's (haru/core/record.py); they are named here too for the log's modules.
No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from haru.core.events import Event, encode
from haru.core.record import Record, body_hash, datetime_to_ns, decode_record, msg_id, with_absolute_cause

__all__ = [
    "BATCH_COMMIT",
    "BATCH_ID",
    "BATCH_SEQ",
    "EXPECTED_LAST_SUBJECT_SEQ",
    "MSG_ID",
    "Record",
    "body_hash",
    "datetime_to_ns",
    "decode_record",
    "msg_id",
    "stage_batch",
    "with_absolute_cause",
]

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# An atomic batch (nats-server >= 2.12, ADR-50): its id, each message's position, and the last one's commit.
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQ = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
MSG_ID = "Nats-Msg-Id"


def stage_batch(
    appends: Sequence[tuple[str, Event]], prevs: dict[str, tuple[int, str]], writer: str
) -> list[tuple[str, bytes, dict[str, str], Event]]:
    """(subject, body, headers, event) for each event of an atomic batch, in order: `by` filled, `prev` chained
    (to the body before the batch, then to the batch's own), its deterministic id named by the position the
    batch checked, and that check (the subject's expected last sequence) on the first message of each subject.
    `prevs`: subject -> (the sequence the batch expects there, the hash of the body stored at it)."""
    tips = dict(prevs)
    out: list[tuple[str, bytes, dict[str, str], Event]] = []
    for subject, event in appends:
        want, prev = tips[subject]
        if event.prev != prev or not event.by:
            event = msgspec.structs.replace(event, prev=prev, by=event.by or writer)
        data = encode(event)
        headers = {MSG_ID: msg_id(subject, want, data)}
        if all(staged[0] != subject for staged in out):
            headers[EXPECTED_LAST_SUBJECT_SEQ] = str(want)
        tips[subject] = (want, body_hash(data))
        out.append((subject, data, headers, event))
    return out
