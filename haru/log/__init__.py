"""The event-log seam: the one place that speaks JetStream for events, views and intents.

The declared Protocols every service is typed against, the JetStream implementation, the in-memory
twin the tests hand to the same services, the core-NATS bus (heartbeats, liveness, agent commands),
the one follower, history (chain verification, causal trees), the bounded reads, and operators'
requests appended on the op subject (requests: what the control API and the CLI call). Imports only
the core.
"""
