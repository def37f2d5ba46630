"""What the serving port takes from the environment, as one value: read once by the command that starts
the process (`haru agent` for the agent's serving port, the port holder's own `main` for the holder) and
handed down, so no part reads the environment on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from haru.host.httpguard import ClientLimits, env_int

__all__ = ["ServingEnv", "DEFAULT_MAX_BODY"]

DEFAULT_MAX_BODY = 32 * 1024 * 1024


@dataclass(frozen=True)
class ServingEnv:
    """What the serving port takes from the environment, read once by the command that starts the agent
    (`haru agent`) and handed down: the bearer token, the largest body, the client limits."""

    token: str = ""  # HARU_SERVING_TOKEN: every request needs it as a bearer token; unset = loopback only
    max_body: int = DEFAULT_MAX_BODY  # HARU_SERVING_MAX_BODY_BYTES
    limits: ClientLimits = field(default_factory=ClientLimits)  # HARU_CLIENT_{HEADER,BODY}_TIMEOUT_MS, _MAX_IDLE

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ServingEnv:
        """Read `env` (a bad number is a ConfigError naming the variable)."""
        return cls(
            token=env.get("HARU_SERVING_TOKEN", ""),
            max_body=env_int(env, "HARU_SERVING_MAX_BODY_BYTES", DEFAULT_MAX_BODY, 1),
            limits=ClientLimits.from_env(env),
        )
