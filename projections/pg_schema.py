"""The Postgres read model's schema: versioned migrations, as data.

Pure: no I/O. `projections.postgres.migrate` applies them, each in its own transaction under an
advisory lock, recording each applied version in `haru.schema_migrations`; a version already
recorded is never applied again, so re-running is a no-op and a newer sink on an older schema
applies only the missing ones. A migration, once released, is never edited: add a new one.

Everything lives in the `haru` schema, so the read model can share a database with others.

    haru.schema_migrations   version, name, applied_at
    haru.sink_position       stream -> last sequence written (updated in the same transaction as rows)
    haru.residency_transitions   one row per residency event (seq = the HARU_EVENTS sequence)
    haru.incidents           a span from `lost` to `resident` again on one fleet/domain/model
    haru.gpu_observations    one row per gpu_observed event (presence and memory)
    haru.skipped_events      bodies on event subjects that were not valid events, or events that may not
                             stand on their subject (haru.core.authority) (position advanced)
    haru.operations          promotions and demotions: requested -> completed | aborted       (v2)
    haru.operation_steps     each step of an operation: started -> completed | failed | restarted (v2)
    haru.domains             each domain's provider and region, from domain_declared/changed/retired (v3)
    haru.prices, haru.tokens price_declared and tokens_counted rows; views haru.price_periods,
                             haru.tokens_per_day, haru.failover_costs (v6, docs/cost.md)
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA = "haru"
MIGRATIONS_TABLE = f"{SCHEMA}.schema_migrations"
POSITION_TABLE = f"{SCHEMA}.sink_position"

# pg_advisory_lock keys (two int4s): the migration lock and the one-writer lock of a sink.
LOCK_NAMESPACE = 0x4841_5255  # "HARU"
MIGRATION_LOCK = 1
SINK_LOCK = 2


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "residency, incidents, gpu observations, position",
        """
CREATE TABLE haru.sink_position (
    stream      text PRIMARY KEY,
    last_seq    bigint NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE haru.residency_transitions (
    seq          bigint PRIMARY KEY,
    fleet        text NOT NULL,
    domain       text NOT NULL,
    model        text NOT NULL,
    state        text NOT NULL CHECK (state IN
                   ('loading', 'resident', 'sleeping', 'waking', 'lost', 'failed', 'stopped')),
    reason       text,             -- lost: evicted | gpu_detached | process_exited | unhealthy
    detail       text NOT NULL DEFAULT '',
    observed_at  timestamptz NOT NULL,   -- event.at: when the writer observed it
    recorded_at  timestamptz NOT NULL,   -- JetStream's timestamp: when the log recorded it
    writer       text NOT NULL DEFAULT '',
    warmup_ms    bigint,           -- resident
    exit_code    bigint            -- lost{process_exited}
);
CREATE INDEX residency_transitions_model ON haru.residency_transitions (fleet, domain, model, seq);
CREATE INDEX residency_transitions_lost ON haru.residency_transitions (observed_at)
    WHERE state = 'lost';

CREATE TABLE haru.incidents (
    opened_seq   bigint PRIMARY KEY,       -- the model_lost that opened it
    fleet        text NOT NULL,
    domain       text NOT NULL,
    model        text NOT NULL,
    reason       text NOT NULL,            -- the reason of the loss that opened it
    detail       text NOT NULL DEFAULT '',
    opened_at    timestamptz NOT NULL,
    closed_seq   bigint,                   -- the model_resident that closed it (NULL = open)
    closed_at    timestamptz,
    duration_ms  bigint,                   -- closed_at - opened_at
    CHECK ((closed_seq IS NULL) = (closed_at IS NULL))
);
CREATE UNIQUE INDEX incidents_one_open ON haru.incidents (fleet, domain, model) WHERE closed_seq IS NULL;
CREATE INDEX incidents_opened_at ON haru.incidents (opened_at);

CREATE TABLE haru.gpu_observations (
    seq                 bigint PRIMARY KEY,
    fleet               text NOT NULL,
    domain              text NOT NULL,
    gpu_index           bigint NOT NULL,
    present             boolean,           -- NULL: the host has no NVML, presence unknowable
    name                text NOT NULL DEFAULT '',
    memory_total_bytes  bigint NOT NULL DEFAULT 0,
    memory_used_bytes   bigint NOT NULL DEFAULT 0,
    processes           bigint NOT NULL DEFAULT 0,
    mig                 boolean NOT NULL DEFAULT false,
    observed_at         timestamptz NOT NULL,
    recorded_at         timestamptz NOT NULL
);
CREATE INDEX gpu_observations_gpu ON haru.gpu_observations (fleet, domain, gpu_index, seq);

CREATE TABLE haru.skipped_events (
    seq          bigint PRIMARY KEY,
    subject      text NOT NULL,
    error        text NOT NULL,
    recorded_at  timestamptz NOT NULL,
    body         bytea NOT NULL
);
""",
    ),
    Migration(
        2,
        "operations and their steps",
        """
CREATE TABLE haru.operations (
    fleet          text NOT NULL,
    op_id          text NOT NULL,
    kind           text,                   -- promotion | demotion (NULL: its request was never seen)
    target         text NOT NULL DEFAULT '',
    source         text NOT NULL DEFAULT '',
    reason         text NOT NULL DEFAULT '',
    detail         text NOT NULL DEFAULT '',
    requested_seq  bigint,
    requested_at   timestamptz,
    outcome        text CHECK (outcome IN ('completed', 'aborted')),   -- NULL: in flight
    finished_seq   bigint,
    finished_at    timestamptz,
    duration_ms    bigint,
    failed_step    text NOT NULL DEFAULT '',
    error          text NOT NULL DEFAULT '',
    PRIMARY KEY (fleet, op_id)
);
CREATE INDEX operations_requested_at ON haru.operations (requested_at);

CREATE TABLE haru.operation_steps (
    seq           bigint PRIMARY KEY,      -- step_started (or the finishing event if no start was seen)
    fleet         text NOT NULL,
    op_id         text NOT NULL,
    step          text NOT NULL,
    attempt       bigint NOT NULL DEFAULT 1,
    started_at    timestamptz,
    outcome       text CHECK (outcome IN ('completed', 'failed', 'restarted')),   -- NULL: running
    finished_seq  bigint,
    finished_at   timestamptz,
    duration_ms   bigint,                  -- finished_at - started_at
    took_ms       bigint,                  -- as the promoter reported it
    detail        text NOT NULL DEFAULT '',
    error_code    text NOT NULL DEFAULT '',
    error         text NOT NULL DEFAULT ''
);
CREATE INDEX operation_steps_op ON haru.operation_steps (fleet, op_id, seq);
CREATE UNIQUE INDEX operation_steps_one_running ON haru.operation_steps (fleet, op_id, step)
    WHERE outcome IS NULL;
""",
    ),
    Migration(
        3,
        "domains with provider and region",
        """
CREATE TABLE haru.domains (
    fleet        text NOT NULL,
    domain       text NOT NULL,
    provider     text,
    region       text,
    serving_url  text,
    serve        text,
    gpus         bigint,
    seq          bigint NOT NULL,          -- the last declaration event applied
    changed_at   timestamptz NOT NULL,
    retired_at   timestamptz,
    PRIMARY KEY (fleet, domain)
);
""",
    ),
    Migration(
        4,
        "pulling: a model's files fetched into the agent's store",
        """
ALTER TABLE haru.residency_transitions DROP CONSTRAINT residency_transitions_state_check;
ALTER TABLE haru.residency_transitions ADD CONSTRAINT residency_transitions_state_check CHECK (state IN
    ('pulling', 'loading', 'resident', 'sleeping', 'waking', 'lost', 'failed', 'stopped'));
ALTER TABLE haru.residency_transitions
    ADD COLUMN reference    text,      -- pulling: the layout's reference (hf:..., ollama:..., a URL)
    ADD COLUMN done_bytes   bigint,    -- pulling: bytes in the store so far
    ADD COLUMN total_bytes  bigint;    -- pulling: bytes of every file
""",
    ),
    Migration(
        5,
        "cascading promotions: the standbys a promotion tried before its target",
        """
ALTER TABLE haru.operations
    ADD COLUMN tried  text[] NOT NULL DEFAULT '{}';   -- promotion_retargeted: the standbys left, in order
""",
    ),
    Migration(
        6,
        "cost: prices, tokens served, and views over them (docs/cost.md)",
        """
CREATE TABLE haru.prices (
    seq          bigint PRIMARY KEY,       -- price_declared
    fleet        text NOT NULL,
    domain       text NOT NULL,
    per_hour     numeric,                  -- NULL: unpriced from then on
    currency     text,
    source       text NOT NULL DEFAULT '',
    basis        text NOT NULL DEFAULT '',
    declared_at  timestamptz NOT NULL
);
CREATE TABLE haru.tokens (
    seq          bigint NOT NULL,          -- tokens_counted: one row per model it counted
    model        text NOT NULL,
    fleet        text NOT NULL,
    gateway      text NOT NULL,
    prompt       bigint NOT NULL,
    completion   bigint NOT NULL,
    responses    bigint NOT NULL,
    counted_at   timestamptz NOT NULL,
    PRIMARY KEY (seq, model)
);
-- Each declared price with the period it was in force: [valid_from, valid_until), NULL = still.
CREATE VIEW haru.price_periods AS
SELECT fleet, domain, per_hour, currency, source, basis, declared_at AS valid_from,
       LEAD(declared_at) OVER (PARTITION BY fleet, domain ORDER BY declared_at, seq) AS valid_until
FROM haru.prices;
-- Tokens served per fleet, model and UTC day, from the gateways' tokens_counted deltas.
CREATE VIEW haru.tokens_per_day AS
SELECT fleet, model, date_trunc('day', counted_at AT TIME ZONE 'UTC') AS day,
       sum(prompt) AS prompt, sum(completion) AS completion, sum(prompt + completion) AS tokens,
       sum(responses) AS responses
FROM haru.tokens GROUP BY fleet, model, date_trunc('day', counted_at AT TIME ZONE 'UTC');
-- Each promotion with the seconds from its request to its end, and what its target cost an hour then.
CREATE VIEW haru.failover_costs AS
SELECT o.fleet, o.op_id, o.source, o.target, o.reason, o.requested_at, o.outcome,
       o.duration_ms / 1000.0 AS seconds, p.per_hour AS target_per_hour, p.currency
FROM haru.operations o
LEFT JOIN haru.price_periods p
  ON p.fleet = o.fleet AND p.domain = o.target AND p.valid_from <= o.requested_at
 AND (p.valid_until IS NULL OR o.requested_at < p.valid_until)
WHERE o.kind = 'promotion';
""",
    ),
)

LATEST = MIGRATIONS[-1].version

BOOTSTRAP = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
"""

# ------------------------------------------------------------------ columns of the batched writes

TRANSITION_COLUMNS = (
    "seq", "fleet", "domain", "model", "state", "reason", "detail",
    "observed_at", "recorded_at", "writer", "warmup_ms", "exit_code", "reference", "done_bytes",
    "total_bytes",
)  # fmt: skip
GPU_COLUMNS = (
    "seq", "fleet", "domain", "gpu_index", "present", "name", "memory_total_bytes",
    "memory_used_bytes", "processes", "mig", "observed_at", "recorded_at",
)  # fmt: skip
INCIDENT_COLUMNS = (
    "opened_seq", "fleet", "domain", "model", "reason", "detail", "opened_at",
    "closed_seq", "closed_at", "duration_ms",
)  # fmt: skip
SKIPPED_COLUMNS = ("seq", "subject", "error", "recorded_at", "body")
STEP_COLUMNS = (
    "seq", "fleet", "op_id", "step", "attempt", "started_at", "outcome", "finished_seq",
    "finished_at", "duration_ms", "took_ms", "detail", "error_code", "error",
)  # fmt: skip
OPERATION_COLUMNS = (
    "fleet", "op_id", "kind", "target", "source", "reason", "detail", "requested_seq",
    "requested_at", "outcome", "finished_seq", "finished_at", "duration_ms", "failed_step", "error", "tried",
)  # fmt: skip
DOMAIN_COLUMNS = (
    "fleet", "domain", "provider", "region", "serving_url", "serve", "gpus", "seq", "changed_at",
    "retired_at",
)  # fmt: skip

PRICE_COLUMNS = ("seq", "fleet", "domain", "per_hour", "currency", "source", "basis", "declared_at")
TOKEN_COLUMNS = ("seq", "model", "fleet", "gateway", "prompt", "completion", "responses", "counted_at")

# Rows appended by COPY (their keys are new by construction: the stream sequence).
COPY_TABLES = {
    "residency_transitions": TRANSITION_COLUMNS,
    "gpu_observations": GPU_COLUMNS,
    "incidents": INCIDENT_COLUMNS,
    "operation_steps": STEP_COLUMNS,
    "skipped_events": SKIPPED_COLUMNS,
    "prices": PRICE_COLUMNS,
    "tokens": TOKEN_COLUMNS,
}

# Statements run with executemany, in this order, after the COPYs of a batch.
CLOSE_INCIDENT = """
UPDATE haru.incidents SET closed_seq = $2, closed_at = $3, duration_ms = $4
WHERE opened_seq = $1 AND closed_seq IS NULL
"""
INSERT_OPERATION = f"""
INSERT INTO haru.operations ({", ".join(OPERATION_COLUMNS)})
VALUES ({", ".join(f"${i}" for i in range(1, len(OPERATION_COLUMNS) + 1))})
ON CONFLICT (fleet, op_id) DO NOTHING
"""
FINISH_OPERATION = """
UPDATE haru.operations
SET outcome = $3, finished_seq = $4, finished_at = $5, duration_ms = $6, failed_step = $7, error = $8
WHERE fleet = $1 AND op_id = $2 AND outcome IS NULL
"""
RETARGET_OPERATION = """
UPDATE haru.operations SET target = $3, tried = array_append(tried, $4)
WHERE fleet = $1 AND op_id = $2
"""
FINISH_STEP = """
UPDATE haru.operation_steps
SET outcome = $2, finished_seq = $3, finished_at = $4, duration_ms = $5, took_ms = $6,
    detail = $7, error_code = $8, error = $9
WHERE seq = $1 AND outcome IS NULL
"""
UPSERT_DOMAIN = f"""
INSERT INTO haru.domains ({", ".join(DOMAIN_COLUMNS)})
VALUES ({", ".join(f"${i}" for i in range(1, len(DOMAIN_COLUMNS) + 1))})
ON CONFLICT (fleet, domain) DO UPDATE SET
    provider = COALESCE(excluded.provider, haru.domains.provider),
    region = COALESCE(excluded.region, haru.domains.region),
    serving_url = COALESCE(excluded.serving_url, haru.domains.serving_url),
    serve = COALESCE(excluded.serve, haru.domains.serve),
    gpus = COALESCE(excluded.gpus, haru.domains.gpus),
    seq = excluded.seq,
    changed_at = excluded.changed_at,
    retired_at = excluded.retired_at
"""

# What a sink reads on start: the carried state of open spans.
OPEN_INCIDENTS = """
SELECT fleet, domain, model, opened_seq, opened_at FROM haru.incidents WHERE closed_seq IS NULL
"""
OPEN_OPERATIONS = """
SELECT fleet, op_id, requested_seq, requested_at FROM haru.operations WHERE outcome IS NULL
"""
RUNNING_STEPS = """
SELECT fleet, op_id, step, seq, started_at FROM haru.operation_steps WHERE outcome IS NULL
"""
