"""The pure core: the language of the system and its functions.

Events, subjects, specs, layouts, residency, the planner, launch plans, views, the fleet fold, route
intents, causes, checkpoints, the sagas' tables (saga), how soon each side of a failover serves
(standby), the verdicts on operators' requests (requests, weighing), the OpenAI error table and the
exception tree. Nothing here does I/O:
no asyncio, nats, aiohttp, sockets or logging (the `pure` import contract in pyproject.toml); time,
ids and outside facts arrive as arguments. Every other layer imports from here; this imports from
no other layer.
"""
