"""JetStream's names for an append's headers: the expected last sequence of its subject and its
deduplication id. The record itself and the chain arithmetic (`Record`, `body_hash`, `msg_id`,
`decode_record`) are the core's (haru/core/record.py); they are named here too for the log's modules.
No I/O.
"""

from __future__ import annotations

from haru.core.record import Record, body_hash, datetime_to_ns, decode_record, msg_id

__all__ = ["EXPECTED_LAST_SUBJECT_SEQ", "MSG_ID", "Record", "body_hash", "datetime_to_ns", "decode_record", "msg_id"]

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
MSG_ID = "Nats-Msg-Id"
