"""Operator endpoints: residency, loading or unloading a model by hand, and
the model lifecycle (registering a model or its new versions, retiring one).

Registration reads only the server's model repositories and never lets a
card choose a command, an environment or a pickle to load
(``repository/trust.py``); each change is audited (``gateway/context.py``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import yaml
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tessera.errors import ConfigError, InvalidInputError, PermissionDeniedError
from tessera.gateway.common import engine_of
from tessera.gateway.errors import error_body
from tessera.repository import read_versions
from tessera.repository.trust import within_roots

router = APIRouter(prefix="/admin")


RESIDENCY_FIELDS = (
    "name",
    "model",
    "version",
    "current",
    "state",
    "bytes",
    "weights_bytes",
    "last_used",
    "loads",
    "evictions",
    "pins",
    "error",
    "engine_metrics",
    "measured_by",
    "load_s",
    "miss_s",
    "uses",
    "eviction_score",
    "host_tier",
    "host_bytes",
    "files_load_s",
    "host_load_s",
    "host_loads",
    "queue_depth",
)


@router.get("/residency")
async def residency(request: Request) -> JSONResponse:
    stats = engine_of(request).snapshot()
    return JSONResponse(
        {
            "device": stats.device_name,
            "budget_bytes": stats.budget_bytes,
            "used_bytes": stats.used_bytes,
            "peak_used_bytes": stats.peak_used_bytes,
            "loads_total": stats.loads_total,
            "evictions_total": stats.evictions_total,
            "host_budget_bytes": stats.host_budget_bytes,
            "host_used_bytes": stats.host_used_bytes,
            "host_loads_total": stats.host_loads_total,
            "host_drops_total": stats.host_drops_total,
            "host_copies_out_total": stats.host_copies_out_total,
            "host_copies_kept_total": stats.host_copies_kept_total,
            "stacked_rounds_total": stats.stacked_rounds_total,
            "stacked_batches_total": stats.stacked_batches_total,
            "encoder_batches_total": stats.encoder_batches_total,
            "encoder_rows_total": stats.encoder_rows_total,
            "models": [{f: getattr(m, f) for f in RESIDENCY_FIELDS} for m in stats.models],
            "rollouts": [dataclasses.asdict(r) for r in stats.rollouts],
        }
    )


@router.get("/cluster")
async def cluster(request: Request) -> JSONResponse:
    """The engine actors this gateway routes to, as their last reports say,
    and what this gateway routed (404 for a gateway that serves its own models)."""
    engines = request.app.state.cluster
    if engines is None:
        message = "this gateway serves its own models: it routes to no cluster"
        return JSONResponse(error_body(404, message, "not_found"), status_code=404)
    return JSONResponse(engines.stats())


class AddModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # a model folder on the server: model.yaml and its version folders
    model_yaml: str | None = None  # or a model.yaml's text, with weights: the path of its weights
    weights: str | None = None


def _in_roots(path: str, what: str, request: Request) -> Path:
    """``path`` resolved, once it lies in a model repository root of the
    server's (symlinks followed); the refusal says nothing of whether it exists."""
    if not os.path.isabs(path):
        raise InvalidInputError(f"{what} must be absolute (a path on the server): {path!r}")
    roots: tuple[Path, ...] = request.app.state.model_roots
    resolved = within_roots(Path(path), roots)
    if resolved is None:
        raise PermissionDeniedError(
            f"{what} {path!r} is refused: models are registered only from the model"
            " repositories the server's configuration names (model_repositories)"
        )
    return resolved


def _card_folder(model_yaml: str, weights: Path) -> Path:
    """A folder of its own for a ``model.yaml`` sent as text, its ``source`` the
    weights' path (which must exist); the card must name the model. The caller
    removes the folder once the model is registered or refused."""
    if not weights.exists():
        raise ConfigError(f"weights not found at {weights}")
    try:
        card = yaml.safe_load(model_yaml)
    except yaml.YAMLError as e:
        raise ConfigError(f"model_yaml: invalid YAML: {e}") from e
    if not isinstance(card, dict) or "name" not in card:
        raise ConfigError("model_yaml must be a mapping that gives the model's name")
    folder = Path(tempfile.mkdtemp(prefix="tessera-model-"))
    card["source"] = {"path": str(weights)}
    (folder / "model.yaml").write_text(yaml.safe_dump(card), encoding="utf-8")
    return folder


@router.post("/models")
async def add_model(body: AddModelRequest, request: Request) -> JSONResponse:
    """Register the model in a folder (or of a ``model.yaml`` sent with the path
    of its weights), or roll out its new versions, while serving: each new
    version is loaded, checked and switched to (422 if it was rolled back).
    Folders and weights come from the server's model repositories alone, and
    the card may not choose what a process runs (``repository/trust.py``): 403."""
    sent_card = body.model_yaml is not None
    if body.path is not None and not sent_card and body.weights is None:
        folder = _in_roots(body.path, "path", request)
    elif body.path is None and body.model_yaml is not None and body.weights is not None:
        weights = _in_roots(body.weights, "weights", request)
        folder = _card_folder(body.model_yaml, weights)
    else:
        raise InvalidInputError("give either path, or model_yaml and weights")
    try:
        engine = engine_of(request)
        rollouts = await engine.add_model(folder, via_api=True)
        # Nothing new to roll out: the folder's model, as it serves already.
        name = rollouts[-1].model if rollouts else read_versions(folder)[0].name
    finally:
        if sent_card:  # the served specs hold all they need of it
            shutil.rmtree(folder, ignore_errors=True)
    request.state.audit.model = name
    served = [v.version_label for v in engine.versions(name)]
    return JSONResponse(
        {
            "name": name,
            "versions": served,
            "rollouts": [dataclasses.asdict(r) for r in rollouts],
        },
        status_code=201 if rollouts else 200,
    )


@router.delete("/models/{name}")
async def remove_model(name: str, request: Request) -> JSONResponse:
    """Retire a model: its requests in flight are answered, then every version
    is unloaded and forgotten; returns the bytes of the budget it gave back."""
    engine = engine_of(request)
    freed = await engine.remove_model(name)
    return JSONResponse(
        {
            "name": name,
            "state": "removed",
            "freed_bytes": freed,
            "used_bytes": engine.snapshot().used_bytes,
        }
    )


@router.post("/models/{name}/load")
async def load(name: str, request: Request) -> JSONResponse:
    model = await engine_of(request).load(name)
    return JSONResponse({"name": name, "state": "ready", "bytes": model.measured_bytes})


@router.post("/models/{name}/unload")
async def unload(name: str, request: Request) -> JSONResponse:
    unloaded = await engine_of(request).unload(name)
    return JSONResponse({"name": name, "state": "unloaded", "was_loaded": unloaded})


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@router.get("/batches")
async def batches(request: Request) -> JSONResponse:
    """Recent batches per model: how many, their sizes and run times."""
    models = []
    for model in engine_of(request).snapshot().models:
        recent = model.recent_batches
        sizes = [float(size) for size, _ in recent]
        run_s = [seconds for _, seconds in recent]
        models.append(
            {
                "name": model.name,
                "num_batches": model.num_batches,
                "num_requests": model.num_requests,
                "num_items": model.num_items,
                "num_dropped": model.num_dropped,
                "num_failures": model.num_failures,
                "window": len(recent),
                "mean_batch_size": sum(sizes) / len(sizes) if sizes else None,
                "max_batch_size": max(sizes, default=None),
                "run_s_p50": _quantile(run_s, 0.5),
                "run_s_p99": _quantile(run_s, 0.99),
            }
        )
    return JSONResponse({"models": models})
