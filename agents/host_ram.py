"""The host's RAM as /proc/meminfo says it: what level-1 sleep (a standby's weights) and trainers use.

    read_host_ram(path) -> (total_bytes, available_bytes)     (0, 0) where there is no /proc/meminfo
    parse_meminfo(text) -> dict of field -> bytes              pure

The agent reports it once when it starts (`agent_started`), and `haru status` shows it beside what the
plan books in host RAM (haru/core/planner.py: a domain's declared `host_ram`).
"""

from __future__ import annotations

__all__ = ["parse_meminfo", "read_host_ram"]


def parse_meminfo(text: str) -> dict[str, int]:
    """`MemTotal:  263842412 kB` lines as bytes per field (kB is KiB there). Pure."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        out[name.strip()] = int(parts[0]) * (1024 if unit == "kb" else 1)
    return out


def read_host_ram(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; (0, 0) when the file cannot be read (not Linux)."""
    try:
        with open(path) as fh:
            info = parse_meminfo(fh.read())
    except OSError:
        return 0, 0
    return info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
