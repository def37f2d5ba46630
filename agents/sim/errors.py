"""Errors of the simulator. A leaf module: it imports nothing from the package.

SimError              (haru.core.errors.HaruError)
├── BadSize           a size like "4GiB" that cannot be parsed          (operator)
└── NoSimGpu          a simulated GPU file that does not exist          (operator)
"""

from __future__ import annotations

from haru.core.errors import HaruError


class SimError(HaruError):
    """Base of every error the simulator raises on purpose."""


class BadSize(SimError, ValueError):
    """A memory size that is neither bytes nor a number with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB)."""


class NoSimGpu(SimError):
    """The simulated GPU file does not exist: nobody created that GPU."""
