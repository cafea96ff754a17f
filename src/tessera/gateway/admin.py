"""Operator endpoints: residency, and loading or unloading a model by hand."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tessera.gateway.common import engine_of

router = APIRouter(prefix="/admin")


@router.get("/residency")
async def residency(request: Request) -> JSONResponse:
    engine = engine_of(request)
    stats = engine.residency.stats()
    known = {m.name for m in stats.models}
    models = [dataclasses.asdict(m) for m in stats.models]
    models += [
        {
            "name": name,
            "state": "unloaded",
            "bytes": 0,
            "weights_bytes": 0,
            "last_used": None,
            "loads": 0,
            "evictions": 0,
            "pins": 0,
            "error": None,
            "measured_by": None,
        }
        for name in engine.repository.names()
        if name not in known
    ]
    for model in models:
        model["queue_depth"] = engine.queue_depth(model["name"])
    return JSONResponse(
        {
            "device": engine.device.name,
            "budget_bytes": stats.budget_bytes,
            "used_bytes": stats.used_bytes,
            "peak_used_bytes": stats.peak_used_bytes,
            "loads_total": stats.loads_total,
            "evictions_total": stats.evictions_total,
            "models": sorted(models, key=lambda m: m["name"]),
        }
    )


@router.post("/models/{name}/load")
async def load(name: str, request: Request) -> JSONResponse:
    engine = engine_of(request)
    spec = engine.repository.get(name)
    await engine.residency.ensure_loaded(spec)
    measured = engine.residency.measured(name)
    return JSONResponse(
        {"name": name, "state": "ready", "bytes": measured.total_bytes if measured else None}
    )


@router.post("/models/{name}/unload")
async def unload(name: str, request: Request) -> JSONResponse:
    engine = engine_of(request)
    engine.repository.get(name)
    unloaded = await engine.residency.unload(name)
    return JSONResponse({"name": name, "state": "unloaded", "was_loaded": unloaded})


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@router.get("/batches")
async def batches(request: Request) -> JSONResponse:
    """Recent batches per model: how many, their sizes and run times."""
    engine = engine_of(request)
    models = []
    for name, counters in sorted(engine.counters.items()):
        recent = list(counters.recent_batches)
        sizes = [float(size) for size, _ in recent]
        run_s = [seconds for _, seconds in recent]
        models.append(
            {
                "name": name,
                "num_batches": counters.num_batches,
                "num_requests": counters.num_requests,
                "num_items": counters.num_items,
                "num_dropped": engine.num_dropped(name),
                "num_failures": counters.num_failures,
                "window": len(recent),
                "mean_batch_size": sum(sizes) / len(sizes) if sizes else None,
                "max_batch_size": max(sizes, default=None),
                "run_s_p50": _quantile(run_s, 0.5),
                "run_s_p99": _quantile(run_s, 0.99),
            }
        )
    return JSONResponse({"models": models})
