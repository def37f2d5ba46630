"""Adapters to the host: the embedded nats-server, child processes, /proc, task and signal
helpers, HTTP guards on untrusted clients, the /metrics endpoint and the control plane's liveness
beats. Imports only the core.
"""
