"""Ports for the suite's processes.

    port = lasting_port()   # a free loopback port no bind(0) on this machine can take meanwhile

A test that chooses a port for another process to bind later (a serving port in a layout, a node
restarted on its own ports) must not take one from the kernel's ephemeral range: between the choice and
the bind, any `bind(0)` on the machine (a gateway with `port=0`, an outgoing connection's local end) may
be handed the same port, and the process then fails with "address already in use". Three workers running
the suite side by side made it happen.
"""

from __future__ import annotations

import collections
import os
import random
import socket
from pathlib import Path

__all__ = ["lasting_port"]


# The ports this process chose lately: two choices before either is bound would both find the port free (a demo
# layout's two serving ports drew the same one, and the second agent could never open it). Only the recent ones:
# a port chosen long ago was bound, or given up, by then, and a worker's share must not run out.
_handed_out: collections.deque[int] = collections.deque(maxlen=512)


def lasting_port() -> int:
    """A free loopback port below the kernel's ephemeral range (the module docstring says why): for a port
    another process binds later, or binds again after a restart. The kernel never hands out a port below its
    ephemeral range, so only another explicit choice could collide there (1 in ~12,000)."""
    low = _ephemeral_low()
    base = max(1024, low - 12_000)
    # each pytest-xdist worker draws from its own share of the range, so two workers' tests never choose the
    # same port (a node of one, down for a restart, had its port chosen by another's test)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % workers if worker[2:].isdigit() else 0
    share = (low - base) // workers
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(base + index * share, base + (index + 1) * share)
        if port in _handed_out:  # free now, but chosen already for a process that has not bound it yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.append(port)
            return port
    raise AssertionError(f"no free loopback port found below {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
