"""The system Chromium the console's browser tests drive (through Playwright, never a downloaded browser)."""

from __future__ import annotations

import os

import pytest

CHROMIUM = os.environ.get("HARU_CHROMIUM", "/usr/bin/chromium")


# Chromium as root in a container, with nothing reaching off the machine.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def need_chromium() -> None:
    """Skip without Chromium, saying how to get it; with HARU_REQUIRE_BROWSER=1 (CI) fail instead."""
    if os.access(CHROMIUM, os.X_OK):
        return
    reason = f"Chromium not found at {CHROMIUM}: apt-get install chromium (or set HARU_CHROMIUM)"
    if os.environ.get("HARU_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + " [HARU_REQUIRE_BROWSER=1]")
    pytest.skip(reason)
