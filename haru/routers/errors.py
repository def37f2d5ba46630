"""The route follower's errors: one base, and a leaf module that imports nothing from the package.

RouterError            the follower cannot do its job (a bad option: the operator's to fix)
└── NotApplied         the router did not take a plan (it refused, it is down, the command failed)
"""

from __future__ import annotations

from haru.core.errors import HaruError


class RouterError(HaruError):
    """A route follower cannot do its job."""


class NotApplied(RouterError):
    """The router did not take the plan: the message names the router, what it said, and the fix."""
