"""A scripted day of a two-domain fleet, with every event's time chosen, and what it cost worked out by hand.

Fleet `day`: domain `a` a static host priced by its GPU (2 x L4 at 1.00 USD/h, 2.50 from 06:00), domain `b`
a SkyPilot host at 3.00 USD/h per the layout, whose first cluster SkyPilot's cost report prices at 2.88
USD/h when it is torn down. The day (UTC, 2026-12-01):

    00:00     fleet declared; a loads m1; b is provisioned
    00:05     a resident; the route points at a
    00:10     b's cluster is up (launch completed); b loads m1; asleep at 00:20, training starts
    03:00     b's training exits on its own; restarted at 03:00:30
    04:00     the gateway counts 1M tokens
    06:00     a's price changes to 2 x 1.25
    08:00     a's GPU is detached (m1 lost); promotion f1 to b requested 08:00:10: b's training stopped
              08:00:12, b waking 08:00:13, resident 08:00:16, route moved 08:00:20
    09:00     a reloads m1 (asleep 09:03); a trains from 09:05
    10:00     the gateway counts 2M tokens
    12:00     b unreachable; promotion f2 to a requested 12:00:05: a's training stopped 12:00:06, a waking
              12:00:07, resident 12:00:10, route moved 12:00:12
    13:00     b reachable again; a replacement of b requested: b's cluster torn down 13:10 (SkyPilot: 37.44
              USD over 46800 s), the new one up 13:30, m1 loading, asleep 13:45, training from 13:50
    20:00     the gateway counts 1M tokens
    24:00     the end of the period

`EXPECTED` is the same day cut by hand into the seconds of each class at each price; `expected()` adds
them up with Decimal, as the docs say the figures are derived.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.events import encode
from haru.core.prices import Price
from haru.core.record import Record, datetime_to_ns
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, ProvisionSpec, TrainingSpec

FLEET = "day"
DAY = datetime(2026, 12, 1, tzinfo=UTC)
SINCE = DAY
UNTIL = DAY + timedelta(days=1)


def t(hms: str) -> datetime:
    h, m, s = (int(x) for x in hms.split(":"))
    return DAY + timedelta(hours=h, minutes=m, seconds=s)


def _script() -> list[tuple[str, ev.Event]]:
    decl, op, route, usage = sj.decl(FLEET), sj.op(FLEET), sj.route(FLEET), sj.usage(FLEET)
    m = "m1"

    def model(d: str) -> str:
        return sj.model(FLEET, d, m)

    def training(d: str) -> str:
        return sj.training(FLEET, d, "lora")

    gpus = [GpuSpec(index=0, memory_bytes=24 << 30, name="L4"), GpuSpec(index=1, memory_bytes=24 << 30, name="L4")]
    a = DomainSpec(name="a", region="local-1", gpus=gpus)
    b = DomainSpec(
        name="b",
        provider="skypilot",
        region="us-east-1",
        gpus=[GpuSpec(index=0, memory_bytes=80 << 30, name="A100-80GB")],
        provision=ProvisionSpec(cloud="aws", accelerators="A100-80GB:1"),
    )
    spec = ModelSpec(name=m, slot="chat", gpu_index=0, vram_bytes=20 << 30)
    lora = TrainingSpec(slot="lora", gpu_index=0, command=["train"], checkpoint_dir="/ck", vram_bytes=8 << 30)
    a_price = Price(per_hour="2", currency="USD", basis="2 x L4 at 1")
    out: list[tuple[str, ev.Event]] = [
        (decl, ev.FleetDeclared(at=t("00:00:00"), fleet=FLEET, policy=Policy())),
        (decl, ev.DomainDeclared(at=t("00:00:00"), spec=a)),
        (decl, ev.PriceDeclared(at=t("00:00:00"), domain="a", price=a_price)),
        (decl, ev.DomainDeclared(at=t("00:00:00"), spec=b)),
        (decl, ev.PriceDeclared(at=t("00:00:00"), domain="b", price=Price(per_hour="3", currency="USD"))),
    ]
    for d in ("a", "b"):
        out += [
            (decl, ev.ModelDeclared(at=t("00:00:00"), domain=d, spec=spec)),
            (decl, ev.TrainingDeclared(at=t("00:00:00"), domain=d, spec=lora)),
        ]
    out += [
        (op, ev.ProvisionRequested(at=t("00:00:00"), op_id="p1", target="b")),
        (model("a"), ev.ModelLoading(at=t("00:00:00"), domain="a", model=m)),
        (model("a"), ev.ModelResident(at=t("00:05:00"), domain="a", model=m)),
        (route, ev.RouteMoved(at=t("00:05:00"), active="a")),
        (op, ev.StepCompleted(at=t("00:10:00"), op_id="p1", step="launch", detail="cluster haru-day-b launched")),
        (model("b"), ev.ModelLoading(at=t("00:10:00"), domain="b", model=m)),
        (op, ev.OperationCompleted(at=t("00:15:00"), op_id="p1")),
        (model("b"), ev.ModelSleeping(at=t("00:20:00"), domain="b", model=m)),
        (training("b"), ev.TrainingStarted(at=t("00:20:00"), domain="b", slot="lora", pid=11, gpu_index=0)),
        (training("b"), ev.TrainingStopped(at=t("03:00:00"), domain="b", slot="lora", how="exited", exit_code=0)),
        (training("b"), ev.TrainingStarted(at=t("03:00:30"), domain="b", slot="lora", pid=12, gpu_index=0)),
        (usage, _tokens("04:00:00", 600_000, 400_000, 1000)),
        (decl, ev.PriceDeclared(at=t("06:00:00"), domain="a", price=Price(per_hour="2.5", currency="USD"))),
        # 08:00 a's GPU goes; the promoter fails over to b
        (model("a"), ev.ModelLost(at=t("08:00:00"), domain="a", model=m, reason="gpu_detached")),
        (
            op,
            ev.PromotionRequested(at=t("08:00:10"), op_id="f1", target="b", source="a", reason="gpu_detached"),
        ),
        (training("b"), ev.TrainingStopped(at=t("08:00:12"), domain="b", slot="lora", how="terminated")),
        (model("b"), ev.ModelWaking(at=t("08:00:13"), domain="b", model=m)),
        (model("b"), ev.ModelResident(at=t("08:00:16"), domain="b", model=m)),
        (route, ev.RouteMoved(at=t("08:00:20"), active="b", previous="a", op_id="f1")),
        (op, ev.OperationCompleted(at=t("08:00:21"), op_id="f1")),
        (model("a"), ev.ModelLoading(at=t("09:00:00"), domain="a", model=m)),
        (model("a"), ev.ModelSleeping(at=t("09:03:00"), domain="a", model=m)),
        (training("a"), ev.TrainingStarted(at=t("09:05:00"), domain="a", slot="lora", pid=21, gpu_index=0)),
        (usage, _tokens("10:00:00", 1_000_000, 1_000_000, 2000)),
        # 12:00 b goes silent; the promoter fails over to a
        (sj.liveness(FLEET, "b"), ev.DomainUnreachable(at=t("12:00:00"), domain="b", silent_ms=5000)),
        (
            op,
            ev.PromotionRequested(at=t("12:00:05"), op_id="f2", target="a", source="b", reason="domain_unreachable"),
        ),
        (training("a"), ev.TrainingStopped(at=t("12:00:06"), domain="a", slot="lora", how="killed")),
        (model("a"), ev.ModelWaking(at=t("12:00:07"), domain="a", model=m)),
        (model("a"), ev.ModelResident(at=t("12:00:10"), domain="a", model=m)),
        (route, ev.RouteMoved(at=t("12:00:12"), active="a", previous="b", op_id="f2")),
        (op, ev.OperationCompleted(at=t("12:00:13"), op_id="f2")),
        (sj.liveness(FLEET, "b"), ev.DomainReachable(at=t("13:00:00"), domain="b")),
        # 13:00 b is replaced by a new cluster
        (op, ev.ReplaceRequested(at=t("13:00:00"), op_id="r1", target="b")),
        (
            op,
            ev.StepCompleted(
                at=t("13:10:00"),
                op_id="r1",
                step="down",
                detail="tore down haru-day-b",
                costs=[ev.ClusterCost(cluster="haru-day-b", total="37.44", seconds=46800.0)],
            ),
        ),
        (op, ev.StepCompleted(at=t("13:30:00"), op_id="r1", step="launch", detail="cluster haru-day-b-00r1 up")),
        (model("b"), ev.ModelLoading(at=t("13:30:00"), domain="b", model=m)),
        (model("b"), ev.ModelSleeping(at=t("13:45:00"), domain="b", model=m)),
        (op, ev.OperationCompleted(at=t("13:46:00"), op_id="r1")),
        (training("b"), ev.TrainingStarted(at=t("13:50:00"), domain="b", slot="lora", pid=31, gpu_index=0)),
        (usage, _tokens("20:00:00", 500_000, 500_000, 1000)),
    ]
    return out


def _tokens(at: str, prompt: int, completion: int, responses: int) -> ev.TokensCounted:
    return ev.TokensCounted(
        at=t(at),
        fleet=FLEET,
        gateway="gw-1",
        models=[ev.ModelTokens(model="m1", prompt=prompt, completion=completion, responses=responses)],
    )


SCRIPT = _script()


def records() -> list[Record]:
    """The script as stored records (sequence in script order), for the pure fold."""
    return [Record(i, subject, datetime_to_ns(e.at), encode(e), e) for i, (subject, e) in enumerate(SCRIPT, start=1)]


async def append_script(log) -> int:
    """Append the script to a log, each subject's appends sequence-checked. Returns the last sequence."""
    last: dict[str, int] = {}
    seq = 0
    for subject, e in SCRIPT:
        seq = await log.append(subject, e, expect=last.get(subject, 0))
        last[subject] = seq
    return seq


# ------------------------------------------------------------------------------- by hand

# (domain, class, start, end, USD an hour, serving: the route pointed at it)
EXPECTED: list[tuple[str, str, str, str, str, bool]] = [
    # a: static, 2.00 until 06:00, 2.50 after
    ("a", "waking", "00:00:00", "00:05:00", "2", False),
    ("a", "active", "00:05:00", "06:00:00", "2", True),
    ("a", "active", "06:00:00", "08:00:00", "2.5", True),
    ("a", "lost", "08:00:00", "08:00:20", "2.5", True),  # lost while the route still points at it
    ("a", "lost", "08:00:20", "09:00:00", "2.5", False),
    ("a", "waking", "09:00:00", "09:03:00", "2.5", False),
    ("a", "standby_idle", "09:03:00", "09:05:00", "2.5", False),
    ("a", "standby_training", "09:05:00", "12:00:06", "2.5", False),
    ("a", "standby_idle", "12:00:06", "12:00:07", "2.5", False),
    ("a", "waking", "12:00:07", "12:00:10", "2.5", False),
    ("a", "standby_idle", "12:00:10", "12:00:12", "2.5", False),
    ("a", "active", "12:00:12", "24:00:00", "2.5", True),
    # b: no host until 00:10; SkyPilot's 2.88 over its first cluster's life [00:10, 13:10); 3.00 after
    ("b", "waking", "00:10:00", "00:20:00", "2.88", False),
    ("b", "standby_training", "00:20:00", "03:00:00", "2.88", False),
    ("b", "standby_idle", "03:00:00", "03:00:30", "2.88", False),
    ("b", "standby_training", "03:00:30", "08:00:12", "2.88", False),
    ("b", "standby_idle", "08:00:12", "08:00:13", "2.88", False),
    ("b", "waking", "08:00:13", "08:00:16", "2.88", False),
    ("b", "standby_idle", "08:00:16", "08:00:20", "2.88", False),
    ("b", "active", "08:00:20", "12:00:00", "2.88", True),
    ("b", "unreachable", "12:00:00", "12:00:12", "2.88", True),
    ("b", "unreachable", "12:00:12", "13:00:00", "2.88", False),
    ("b", "standby_idle", "13:00:00", "13:10:00", "2.88", False),
    # [13:10, 13:30): no host, not billed
    ("b", "waking", "13:30:00", "13:45:00", "3", False),
    ("b", "standby_idle", "13:45:00", "13:50:00", "3", False),
    ("b", "standby_training", "13:50:00", "24:00:00", "3", False),
]

TRAINING = {  # domain -> (slot-seconds, runs, stopped by a failover, seconds those had run)
    "a": (3 * 3600 - 5 * 60 + 6, 1, 1, 3 * 3600 - 5 * 60 + 6),  # [09:05, 12:00:06)
    "b": (9600 + 17982 + 36600, 3, 1, 17982),  # [00:20, 03:00) + [03:00:30, 08:00:12) + [13:50, 24:00)
}
FAILOVERS = [("f1", "a", "b", "gpu_detached", 10.0), ("f2", "b", "a", "domain_unreachable", 7.0)]
TOKENS = 4_000_000


def _seconds(start: str, end: str) -> int:
    return int((t(end) - t(start)).total_seconds())


def cent(x: Decimal) -> str:
    return str(x.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def expected() -> dict:
    """The figures `haru cost --json` must print, added up from EXPECTED."""
    seconds: dict[str, dict[str, int]] = {}
    cost: dict[str, dict[str, Decimal]] = {}
    serving = Decimal(0)
    for d, cls, start, end, price, is_serving in EXPECTED:
        s = _seconds(start, end)
        money = Decimal(s) * Decimal(price) / 3600
        seconds.setdefault(d, {}).setdefault(cls, 0)
        seconds[d][cls] += s
        cost.setdefault(d, {}).setdefault(cls, Decimal(0))
        cost[d][cls] += money
        if is_serving:
            serving += money
    total = sum((sum(c.values(), Decimal(0)) for c in cost.values()), Decimal(0))
    harvested = sum((c.get("standby_training", Decimal(0)) for c in cost.values()), Decimal(0))
    net = total - harvested
    return {
        "seconds": seconds,
        "cost_by_class": {d: {k: cent(v) for k, v in c.items()} for d, c in cost.items()},
        "domain_cost": {d: cent(sum(c.values(), Decimal(0))) for d, c in cost.items()},
        "cost": cent(total),
        "serving_cost": cent(serving),
        "ha_premium": cent(total - serving),
        "harvested": cent(harvested),
        "net_cost": cent(net),
        "two_hot_replicas": cent(2 * serving),
        "difference": cent(2 * serving - net),
        "per_million_tokens": {
            "with_ha": cent(total * 1_000_000 / TOKENS),
            "without_ha": cent(serving * 1_000_000 / TOKENS),
            "net_of_training": cent(net * 1_000_000 / TOKENS),
        },
    }
