"""What a runtime that exited while loading said: its error lines, picked from its output. Pure."""

from __future__ import annotations

import re

__all__ = ["runtime_said", "LINE_LIMIT"]

LINE_LIMIT = 300  # one line of what a runtime said (vLLM lists every architecture it knows on one line)
_LOG_PREFIX = re.compile(r"^[\d.:]+\s+[A-Z]\s+")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(: |$)|^Value error, ")
_ERROR_MARKERS = ("error", "failed", "invalid", "cannot", "unable", "exception", "not found", "no such")


def runtime_said(output: str, code: int, limit: int = 1000) -> str:
    """What a runtime that exited while loading said: its error lines from this attempt's output."""
    attempt = output.rsplit("--- haru agent starting:", 1)[-1]
    lines = [ln.strip() for ln in attempt.splitlines()[1:] if ln.strip()]
    # A Python runtime (vLLM) ends in a traceback: its exception lines are what it said ("ValueError:
    # ...", pydantic's "Value error, ..."); its log lines before them merely mention paths and args.
    raised = [ln for ln in lines if _RAISED.search(ln)]
    picked: list[str] = []
    for ln in raised or (ln for ln in lines if any(m in ln.lower() for m in _ERROR_MARKERS)):
        ln = _LOG_PREFIX.sub("", ln)[:LINE_LIMIT]  # llama.cpp's "0.00.002.891 E " timestamp and level
        if ln not in picked:
            picked.append(ln)
    # The first errors say what went wrong, the last one how it ended.
    said = " | ".join(picked[:2] + picked[-1:] if len(picked) > 3 else picked or lines[-3:])
    return (
        f"exited with code {code} while loading: {said}"[:limit] if said else f"exited with code {code} while loading"
    )
