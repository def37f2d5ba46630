"""What can go wrong provisioning a domain, and whose fault each one is.

    ProvisionError                 base: everything haru.provision raises
    ├── NotProvisionable           the operator's: a static domain, or one without a provision block
    ├── SecretMissing              the operator's: a declared secret is not in the launching environment
    ├── SkyUnavailable             the set-up's: the `sky` executable cannot be run
    ├── SkyTimeout                 a `sky` command ran past its bound; it was killed (with its children)
    └── SkyFailed                  a `sky` command exited non-zero; carries its argv, status and output
        ├── CapacityError          the provider had no capacity where asked (the next placement is tried)
        ├── LaunchFailed           every placement was tried and none launched; carries the attempts
        └── TeardownFailed         `sky down` / `sky serve down` failed: the cluster may still be billed

This module imports nothing from the package.
"""

from __future__ import annotations


class ProvisionError(Exception):
    """Base of every error haru.provision raises."""


class NotProvisionable(ProvisionError):
    pass


class SecretMissing(ProvisionError):
    pass


class SkyUnavailable(ProvisionError):
    pass


class SkyTimeout(ProvisionError):
    def __init__(self, argv: list[str], timeout_s: float) -> None:
        self.argv = list(argv)
        self.timeout_s = timeout_s
        super().__init__(
            f"`{' '.join(argv)}` ran past its {timeout_s:g} s bound and was killed; "
            "raise the domain's provision timeout if SkyPilot needs longer there"
        )


class SkyFailed(ProvisionError):
    def __init__(
        self, message: str, *, argv: list[str] | None = None, returncode: int | None = None, output: str = ""
    ) -> None:
        self.argv = list(argv or [])
        self.returncode = returncode
        self.output = output
        super().__init__(message)


class CapacityError(SkyFailed):
    pass


class LaunchFailed(SkyFailed):
    def __init__(self, message: str, attempts: list) -> None:
        self.attempts = list(attempts)
        super().__init__(message)


class TeardownFailed(SkyFailed):
    pass
