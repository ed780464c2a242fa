"""GET /metrics: Prometheus' text format, for an operator's scraper.

Every sample comes from one SQL statement (the `thumbq.metrics` view of sql/functions/90_views.sql,
which Supabase users can also read without scraping); this module only names and types them.
Readable with the admin secret or THUMBQ_METRICS_TOKEN (read-only: it opens nothing else);
with neither configured the route is closed (503 `not_configured`), as the admin routes are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from flask import Blueprint, Response

from api.auth import bearer_token, secret_matches
from api.contract import ADMIN, ADMIN_ERRORS, Answer, Op, describe
from api.errors import ApiError
from api.thumbnails import state
from worker.engine import db

bp = Blueprint("metrics", __name__)

# name -> (type, help, label names). Histograms are read as buckets, _count and _sum rows.
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "thumbq_jobs": ("Jobs waiting or running, by task and status.", ("task", "status")),
    "thumbq_jobs_finished_15m": (
        "Jobs that ended in the last 15 minutes, by task and status.",
        ("task", "status"),
    ),
    "thumbq_failures_15m": (
        "Jobs whose error (by code) was recorded in the last 15 minutes: failures, retries and "
        "files that cannot be made.",
        ("code",),
    ),
    "thumbq_queue_messages": (
        "Messages in each pgmq queue: waiting (visible) or in_flight (read by a worker, or "
        "waiting out a retry's backoff).",
        ("queue", "state"),
    ),
    "thumbq_queue_oldest_message_age_seconds": (
        "Age of each queue's oldest message (0 when it is empty).",
        ("queue",),
    ),
    "thumbq_rate_limit_tokens": ("Tokens in each rate-limit bucket now.", ("bucket",)),
    "thumbq_rate_limit_capacity": ("Capacity of each rate-limit bucket.", ("bucket",)),
}
HISTOGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "thumbq_batch_duration_seconds": ("Duration of the batch runs of the last hour.", ()),
    "thumbq_render_duration_seconds": (
        "Time to make a thumbnail, by the source's content type, over the last 15 minutes.",
        ("content_type",),
    ),
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def require_scraper() -> None:
    """Let the admin secret or THUMBQ_METRICS_TOKEN through; 401 for another token, 503 when
    neither is configured (nothing is open by default)."""
    config = state().config
    secrets = [s for s in (config.metrics_token, config.cron_secret) if s]
    if not secrets:
        raise ApiError(
            503,
            "not_configured",
            "neither THUMBQ_METRICS_TOKEN nor THUMBQ_CRON_SECRET is set, so /metrics is closed",
        )
    token = bearer_token()
    # Compare with every secret (each in constant time), so that the answer's time does not
    # tell which one came close.
    if not any([secret_matches(token, s) for s in secrets]):
        raise ApiError(
            401,
            "unauthorized",
            "the bearer token is neither THUMBQ_METRICS_TOKEN nor the admin secret",
            {"WWW-Authenticate": 'Bearer realm="thumbq", error="invalid_token"'},
        )


class _Samples:
    """A prometheus_client collector over the rows of thumbq.metrics."""

    def __init__(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self.rows = list(rows)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily

        by_name: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for r in self.rows:
            by_name[r["metric"]].append(r)
        for name, (text, labels) in GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=list(labels))
            for r in by_name.get(name, []):
                family.add_metric([str(r["labels"].get(k, "")) for k in labels], r["value"])
            yield family
        for name, (text, labels) in HISTOGRAMS.items():
            # The windowed histograms can go down as runs leave the hour: gauge histograms.
            hist = GaugeHistogramMetricFamily(name, text, labels=list(labels))
            series: dict[tuple[str, ...], dict[str, Any]] = defaultdict(
                lambda: {"buckets": [], "count": 0.0, "sum": 0.0}
            )
            for r in by_name.get(name + "_bucket", []):
                key = tuple(str(r["labels"].get(k, "")) for k in labels)
                series[key]["buckets"].append((float(r["labels"]["le"]), r["value"]))
            for part in ("count", "sum"):
                for r in by_name.get(f"{name}_{part}", []):
                    key = tuple(str(r["labels"].get(k, "")) for k in labels)
                    series[key][part] = r["value"]
            for key, s in sorted(series.items()):
                buckets = [(_le(le), v) for le, v in sorted(s["buckets"])]
                buckets.append(("+Inf", s["count"]))
                hist.add_metric(list(key), buckets, gsum_value=s["sum"])
            yield hist


def _le(value: float) -> str:
    return repr(value) if value != int(value) else f"{int(value)}.0"


def exposition(rows: Iterable[Mapping[str, Any]]) -> bytes:
    """The rows of thumbq.metrics in Prometheus' text format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Samples(rows))
    return generate_latest(registry)


@bp.get("/metrics")
@describe(
    Op(
        "getMetrics",
        "Prometheus' text format: jobs, failures, queues, rate limits, durations. The bearer is "
        "the admin secret or THUMBQ_METRICS_TOKEN (read-only).",
        {
            200: Answer(
                "Prometheus text exposition 0.0.4.",
                content={"text/plain": {"schema": {"type": "string"}}},
            ),
            **ADMIN_ERRORS,
        },
        security=ADMIN,
    )
)
def metrics() -> Response:
    """Jobs, failures, queues, rate limits and durations, for Prometheus (one SQL statement)."""
    require_scraper()
    st = state()
    with st.connection() as conn:
        rows = db.run(conn, "metrics")
    return Response(
        exposition(rows), 200, {"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"}
    )
