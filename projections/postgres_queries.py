"""The example queries over the Postgres read model, as the exact SQL the docs show.

docs/postgres.md prints these strings and tests/postgres/test_postgres_queries.py runs them
against a database filled by the sink, so the documentation cannot drift from what works.
Each is plain SQL (no parameters), runnable in psql as it stands.
"""

from __future__ import annotations

GPU_DETACHMENTS_30D = """\
-- GPU detachments per domain and provider over the last 30 days: the provider took the GPU,
-- not the operator's fault. A detachment is an observation of a GPU as absent right after one
-- of it as present; models_lost counts the models that went lost{gpu_detached} with it.
WITH gpu AS (
    SELECT fleet, domain, gpu_index, present, observed_at,
           lag(present) OVER (PARTITION BY fleet, domain, gpu_index ORDER BY seq) AS was_present
    FROM haru.gpu_observations
), detached AS (
    SELECT fleet, domain, count(*) AS gpu_detachments
    FROM gpu
    WHERE present IS FALSE AND was_present IS TRUE
      AND observed_at >= now() - interval '30 days'
    GROUP BY fleet, domain
), lost AS (
    SELECT fleet, domain, count(*) AS models_lost
    FROM haru.residency_transitions
    WHERE state = 'lost' AND reason = 'gpu_detached'
      AND observed_at >= now() - interval '30 days'
    GROUP BY fleet, domain
)
SELECT fleet, domain,
       coalesce(d.provider, 'unknown') AS provider,
       coalesce(d.region, '') AS region,
       coalesce(detached.gpu_detachments, 0) AS gpu_detachments,
       coalesce(lost.models_lost, 0) AS models_lost
FROM detached
FULL JOIN lost USING (fleet, domain)
LEFT JOIN haru.domains d USING (fleet, domain)
ORDER BY gpu_detachments DESC, models_lost DESC, fleet, domain;
"""

MEAN_TIME_TO_RESIDENT = """\
-- Mean time to resident per model: from `loading` (a cold start) or `waking` (a wake from
-- level-1 sleep) to the `resident` that followed it on the same domain, in milliseconds.
WITH t AS (
    SELECT fleet, domain, model, state, observed_at,
           lag(state) OVER w AS from_state,
           lag(observed_at) OVER w AS from_at
    FROM haru.residency_transitions
    WINDOW w AS (PARTITION BY fleet, domain, model ORDER BY seq)
)
SELECT fleet, model, from_state,
       count(*) AS times,
       round(avg(extract(epoch FROM observed_at - from_at) * 1000))::bigint AS mean_ms,
       round(max(extract(epoch FROM observed_at - from_at) * 1000))::bigint AS max_ms
FROM t
WHERE state = 'resident' AND from_state IN ('loading', 'waking')
GROUP BY fleet, model, from_state
ORDER BY fleet, model, from_state;
"""

FAILOVER_STEP_DURATIONS = """\
-- Failover durations per step: how long each step of promotions (and demotions) took, in the
-- saga's order, with how often it failed or had to be restarted.
SELECT coalesce(o.kind, 'unknown') AS kind,
       s.step,
       count(*) AS runs,
       count(*) FILTER (WHERE s.outcome = 'failed') AS failed,
       count(*) FILTER (WHERE s.outcome = 'restarted') AS restarted,
       round(avg(s.duration_ms))::bigint AS mean_ms,
       percentile_disc(0.5) WITHIN GROUP (ORDER BY s.duration_ms) AS p50_ms,
       percentile_disc(0.95) WITHIN GROUP (ORDER BY s.duration_ms) AS p95_ms,
       max(s.duration_ms) AS max_ms
FROM haru.operation_steps s
LEFT JOIN haru.operations o USING (fleet, op_id)
WHERE s.outcome IS NOT NULL AND s.duration_ms IS NOT NULL
GROUP BY 1, s.step
ORDER BY 1, array_position(
    ARRAY['apply_standby', 'stop_training', 'verify_gpu', 'wake', 'probe', 'flip', 'apply_old_active',
     'settle_old_active', 'sleep', 'start_training'],
    s.step);
"""

OPEN_INCIDENTS = """\
-- Open incidents: models lost and not resident again yet, oldest first.
SELECT fleet, domain, model, reason, detail, opened_at,
       round(extract(epoch FROM now() - opened_at))::bigint AS open_for_s
FROM haru.incidents
WHERE closed_at IS NULL
ORDER BY opened_at, fleet, domain, model;
"""

INCIDENTS_PER_DOMAIN_30D = """\
-- Incidents per domain and reason over the last 30 days, with their total and longest duration
-- (open ones count up to now): whose fault, and how much it cost.
SELECT i.fleet, i.domain, coalesce(d.provider, 'unknown') AS provider, i.reason,
       count(*) AS incidents,
       count(*) FILTER (WHERE i.closed_at IS NULL) AS still_open,
       round(sum(extract(epoch FROM coalesce(i.closed_at, now()) - i.opened_at)))::bigint AS total_s,
       round(max(extract(epoch FROM coalesce(i.closed_at, now()) - i.opened_at)))::bigint AS longest_s
FROM haru.incidents i
LEFT JOIN haru.domains d USING (fleet, domain)
WHERE i.opened_at >= now() - interval '30 days'
GROUP BY i.fleet, i.domain, d.provider, i.reason
ORDER BY total_s DESC, i.fleet, i.domain, i.reason;
"""

EXAMPLES: dict[str, str] = {
    "GPU detachments per domain and provider, last 30 days": GPU_DETACHMENTS_30D,
    "Mean time to resident per model": MEAN_TIME_TO_RESIDENT,
    "Failover durations per step": FAILOVER_STEP_DURATIONS,
    "Open incidents": OPEN_INCIDENTS,
    "Incidents per domain and reason, last 30 days": INCIDENTS_PER_DOMAIN_30D,
}
