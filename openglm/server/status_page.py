"""`openglm serve`'s status page: requests running/waiting, KV-cache use, tokens/s and the TTFT /
inter-token-latency histograms, all read from the server's own Prometheus registry.

The page (`/status`) is a static shell with nothing in it; its data (`/v1/status`) is behind the
same API key as the rest of /v1. Registered from `server/app.py` with one line.
"""

from __future__ import annotations

import math
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).parent / "static" / "status.html"
HISTOGRAMS = {"ttft": "openglm_time_to_first_token_seconds", "itl": "openglm_inter_token_latency_seconds",
              "e2e": "openglm_e2e_request_latency_seconds"}


def snapshot(metrics) -> dict:
    """The page's figures from the registry: gauges and counters by name, histograms as bucket counts."""
    values: dict[str, float] = {}
    buckets: dict[str, list] = {k: [] for k in HISTOGRAMS}
    totals: dict[str, dict] = {k: {"count": 0, "sum": 0.0} for k in HISTOGRAMS}
    by_family = {v: k for k, v in HISTOGRAMS.items()}
    for family in metrics.registry.collect():
        key = by_family.get(family.name)
        for s in family.samples:
            if key is None:
                if not s.labels:
                    values[s.name] = s.value
                elif s.name == "openglm_requests_total":
                    values[s.name] = values.get(s.name, 0.0) + s.value
                continue
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[key].append({"le": None if math.isinf(le) else le, "count": s.value})
            elif s.name.endswith("_count"):
                totals[key]["count"] = s.value
            elif s.name.endswith("_sum"):
                totals[key]["sum"] = s.value
    total_blocks = values.get("openglm_kv_blocks_total", 0.0)
    return {
        "running": values.get("openglm_requests_running", 0.0), "waiting": values.get("openglm_requests_waiting", 0.0),
        "kv": {"used": values.get("openglm_kv_blocks_used", 0.0), "total": total_blocks,
               "cached": values.get("openglm_kv_blocks_cached", 0.0),
               "use": values.get("openglm_kv_blocks_used", 0.0) / total_blocks if total_blocks else 0.0},
        "tokens_per_s": values.get("openglm_generation_tokens_per_second", 0.0),
        "requests": values.get("openglm_requests_total", 0.0),
        "generated_tokens": values.get("openglm_generation_tokens_total", 0.0),
        "preemptions": values.get("openglm_preemptions", 0.0),
        "histograms": {k: {"buckets": buckets[k], **totals[k]} for k in HISTOGRAMS},
    }


def register(app: FastAPI, metrics, dependencies=()) -> None:
    """Add /status (page) and /v1/status (its data, guarded by `dependencies`, the API-key check)."""
    router = APIRouter(dependencies=list(dependencies))

    @router.get("/v1/status")
    async def status():
        return snapshot(metrics)

    @app.get("/status", include_in_schema=False)
    async def page():
        return HTMLResponse(PAGE.read_text())

    app.include_router(router)
