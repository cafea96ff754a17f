"""``ModelSpec``: a model's descriptor, parsed from its ``model.yaml``.

A model folder looks like Triton's::

    my-model/
      model.yaml          # name, task, runtime, adapter, source, limits...
      1/                  # version folders (Hugging Face or ONNX layouts)
      2/
        model.yaml        # optional: this version's changes to the model's card

A version folder's ``model.yaml`` overrides the model's keys (its ``options``
key by key), so a version that only changes an option is that one line.
``version_policy`` (Triton's) says which versions are served: ``{latest:
{num_versions: N}}`` (1 by default), ``{all: {}}`` or ``{specific: {versions:
[1, 3]}}``. A model without version folders has one version, reported as 1.

``source`` says where the weights are: ``{package: NAME, path: SUB}`` for
weights carried inside an installed Python package, ``{path: P}`` for a
folder or file (relative to the model folder), or nothing for the chosen
version folder.

What a model runs of an input is read from its ``options`` into
``ModelSpec.inputs`` (``tasks.InputLimits``), so that work units count it:
``max_length`` (the text window in tokens, 512 when not given: BERT's
position table, the largest of the text runtimes' defaults), ``truncate``
(false: refuse an over-window text with 413 instead of truncating it),
``max_tokens_limit`` (chat), rapidocr's resizes from ``rapidocr_params``,
and a vision-language model's image tokens from ``vision`` (``patch_size``,
``merge_size``, ``min_pixels``, ``max_pixels``: its processor's) with
``max_tokens_default`` (what an OCR page may generate when it does not say).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tessera.errors import ConfigError, ModelUnavailableError
from tessera.repository.schema import (
    BATCHING_KEYS,
    CARD_KEYS,
    MEMORY_KEYS,
    SOURCE_KEYS,
    check_keys,
    check_options,
)
from tessera.tasks.types import InputLimits, Task, VisionLimits
from tessera.units import parse_bytes

RUNTIMES = ("torch", "onnx", "native", "external")
# Engine processes of ``runtime: external`` (``runtimes/external.py``).
ENGINES = ("llamacpp", "vllm")
# Where a model runs: the server's process, or a worker process of its own.
ISOLATIONS = ("inline", "process")
TEXT_TASKS = (Task.EMBEDDING, Task.RERANK, Task.CLASSIFY)
DEFAULT_TEXT_WINDOW = 512
# Tasks whose answers are not texts: a smoke check cannot expect one of them.
_NO_TEXT_ANSWER = (Task.EMBEDDING, Task.RERANK, Task.TTS)


@dataclass(frozen=True, slots=True)
class BatchingSpec:
    """Limits of one batch: items, work units (tokens for text), and wait."""

    max_batch_size: int = 32
    max_batch_units: float = 8192.0
    max_wait_ms: float = 5.0
    # Batches of this model that may run at once; None: one per compute worker.
    # Models whose engine is not thread-safe set 1.
    max_concurrent_batches: int | None = None


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """Which of a model's versions are served (Triton's ``version_policy``):
    the ``latest`` N, or the ``specific`` ones; ``latest=None`` with no
    specific versions serves all."""

    latest: int | None = 1
    specific: tuple[int, ...] = ()

    def choose(self, versions: tuple[int, ...]) -> tuple[int, ...]:
        """The served versions among ``versions`` (ascending)."""
        if self.specific:
            return tuple(v for v in versions if v in self.specific)
        if self.latest is None:
            return versions
        return versions[-self.latest :]


@dataclass(frozen=True, slots=True)
class SourceSpec:
    package: str | None = None
    path: str | None = None


@dataclass(frozen=True)
class SmokeCheck:
    """One input a new version must answer before it serves (``smoke`` in
    model.yaml): a text (embedding, classify, translate, tts; the user's message
    for generate), ``{query, document}`` for rerank, an image file relative to
    the model folder for ocr; ``expect``: a text the answer must contain (the
    label, the translation, the generated or read text)."""

    input: Any
    expect: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Immutable description of one model version."""

    name: str
    task: Task
    runtime: str
    adapter: str
    folder: Path
    source: SourceSpec = field(default_factory=SourceSpec)
    version: int | None = None
    versions: tuple[int, ...] = ()
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    max_bytes: int | None = None
    preload: bool = False
    latency_target_ms: float | None = None
    max_inputs: int = 2048
    options: dict[str, Any] = field(default_factory=dict)
    inputs: InputLimits = field(default_factory=InputLimits)
    description: str = ""
    licence: str = ""
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    engine: str | None = None  # runtime external: the engine process's kind
    isolation: str = "inline"  # or "process": a worker process of its own
    mps_active_thread_percentage: int | None = None  # a process worker's MPS share (CUDA)
    # Threads of the model's own runtime pool: a number, "all" (the server's
    # thread budget), or None for one worker's share (``threads`` in model.yaml).
    threads: int | Literal["all"] | None = None
    # What a new version must answer before it takes over (``smoke`` in
    # model.yaml; none: the task's sample item, answered with a valid output).
    smoke: tuple[SmokeCheck, ...] = ()
    # Registered over the admin API, not read from the operator's repository:
    # it may not load pickle files (``repository/trust.py``).
    via_api: bool = False

    @property
    def version_label(self) -> str:
        """The version as requests and answers name it (1 without version folders)."""
        return str(self.version if self.version is not None else 1)

    @property
    def key(self) -> str:
        """What the engine serves this version as: the model's name, or
        ``name@version`` for a model with version folders (two versions of one
        model are served side by side during a rollout)."""
        return self.name if self.version is None else f"{self.name}@{self.version}"

    def resolve_source(self) -> Path:
        """The path of the weights (a folder or a file); raises if absent."""
        return resolve_path(self, self.source)

    def option_path(self, key: str) -> Path | None:
        """An option naming a path: a string (relative to the model folder)
        or ``{package, path}``."""
        raw = self.options.get(key)
        if raw is None:
            return None
        if isinstance(raw, str):
            return resolve_path(self, SourceSpec(path=raw))
        if isinstance(raw, dict):
            return resolve_path(self, SourceSpec(package=raw.get("package"), path=raw.get("path")))
        raise ConfigError(f"model {self.name!r}: option {key!r} must be a path")


def package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(next(iter(found.submodule_search_locations)))


def resolve_path(spec: ModelSpec, source: SourceSpec) -> Path:
    try:
        if source.package is not None:
            base = package_dir(source.package)
            path = base / source.path if source.path else base
        elif source.path is not None:
            path = Path(source.path).expanduser()
            if not path.is_absolute():
                path = spec.folder / path
        elif spec.version is not None:
            path = spec.folder / str(spec.version)
            _holds_weights(path)
        else:
            raise FileNotFoundError("no source and no version folder")
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as e:
        raise ModelUnavailableError(spec.name, f"weights not found: {e}") from e
    if not path.exists():
        raise ModelUnavailableError(spec.name, f"weights not found at {path}")
    return path


def _holds_weights(version_dir: Path) -> None:
    """``FileNotFoundError`` where ``version_dir``, the weights of a card that
    gives no ``source``, holds nothing but its ``model.yaml`` (a version that
    only changes options): its loader would fail on a missing file instead."""
    if version_dir.is_dir() and all(p.name == "model.yaml" for p in version_dir.iterdir()):
        raise FileNotFoundError(
            f"the card gives no source and version folder {version_dir} holds no weights"
            " (only its model.yaml): give source: {path: ...} in the card, or put the"
            " weights in the version folder"
        )


def _int(raw: dict[str, Any], key: str, default: int, where: str) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _number(raw: dict[str, Any], key: str, default: float | None, where: str) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where}: {key} must be a non-negative number, got {value!r}")
    return float(value)


def _optional_int(options: dict[str, Any], key: str, where: str) -> int | None:
    """A positive integer option, or None when the card does not give it."""
    return None if options.get(key) is None else _int(options, key, 1, where)


def parse_inputs(task: Task, options: dict[str, Any], where: str) -> InputLimits:
    """What the model runs of an input, from its card's options."""
    truncate = options.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}: options: truncate must be true or false, got {truncate!r}")
    window = _optional_int(options, "max_length", f"{where}: options")
    limits = InputLimits(
        text_window=window or (DEFAULT_TEXT_WINDOW if task in TEXT_TASKS else None),
        truncate=truncate,
        max_new_tokens=_optional_int(options, "max_tokens_limit", f"{where}: options"),
        max_tokens_default=_int(options, "max_tokens_default", 1024, f"{where}: options"),
        vision=parse_vision(options.get("vision"), f"{where}: options: vision"),
    )
    params = options.get("rapidocr_params")
    if task is not Task.OCR or not isinstance(params, dict):
        return limits

    def side(key: str, default: int) -> int:
        value = _optional_int(params, key, f"{where}: options: rapidocr_params")
        return default if value is None else value

    return dataclasses.replace(
        limits,
        ocr_max_side=side("Global.max_side_len", limits.ocr_max_side),
        ocr_min_side=side("Global.min_side_len", limits.ocr_min_side),
        ocr_detection_side=side("Det.limit_side_len", limits.ocr_detection_side),
    )


def parse_vision(raw: Any, where: str) -> VisionLimits | None:
    """A vision-language model's image processing (``vision`` options), or None."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping")
    check_keys(raw, ("patch_size", "merge_size", "min_pixels", "max_pixels"), where)
    default = VisionLimits()
    vision = VisionLimits(
        patch_size=_int(raw, "patch_size", default.patch_size, where),
        merge_size=_int(raw, "merge_size", default.merge_size, where),
        min_pixels=_int(raw, "min_pixels", default.min_pixels, where),
        max_pixels=_int(raw, "max_pixels", default.max_pixels, where),
    )
    if vision.min_pixels > vision.max_pixels:
        raise ConfigError(f"{where}: min_pixels is over max_pixels")
    return vision


def parse_spec(raw: dict[str, Any], folder: Path, where: str | None = None) -> ModelSpec:
    """Build a ``ModelSpec`` from a parsed ``model.yaml`` in ``folder``
    (``where``: the card's files, for errors). Every key, at every level,
    is one the card may give (``repository/schema.py``)."""
    where = where or str(folder / "model.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    check_keys(raw, CARD_KEYS, where)
    name = raw.get("name", folder.name)
    if not isinstance(name, str) or not name or "@" in name or "/" in name:
        raise ConfigError(f"{where}: name must be a non-empty string without '@' or '/'")
    try:
        task = Task(raw["task"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{where}: task must be one of {[t.value for t in Task]}") from e
    runtime = raw.get("runtime")
    if runtime not in RUNTIMES:
        raise ConfigError(f"{where}: runtime must be one of {RUNTIMES}")
    engine = raw.get("engine")
    if runtime == "external" and engine not in ENGINES:
        raise ConfigError(f"{where}: runtime external needs engine: one of {ENGINES}")
    if runtime != "external" and engine is not None:
        raise ConfigError(f"{where}: engine is for runtime external only")
    adapter = raw.get("adapter", "external" if runtime == "external" else None)
    if not isinstance(adapter, str):
        raise ConfigError(f"{where}: adapter must be a string")

    source_raw = raw.get("source") or {}
    if not isinstance(source_raw, dict):
        raise ConfigError(f"{where}: source must be a mapping")
    check_keys(source_raw, SOURCE_KEYS, f"{where}: source")
    source = SourceSpec(package=source_raw.get("package"), path=source_raw.get("path"))

    versions = tuple(
        sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
    )
    version = raw.get("version", versions[-1] if versions else None)
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise ConfigError(f"{where}: version must be an integer, got {version!r}")

    batching_raw = raw.get("batching") or {}
    if not isinstance(batching_raw, dict):
        raise ConfigError(f"{where}: batching must be a mapping")
    check_keys(batching_raw, BATCHING_KEYS, f"{where}: batching")
    max_batch_size = _int(batching_raw, "max_batch_size", 32, where)
    units = batching_raw.get("max_batch_units", batching_raw.get("max_batch_tokens", 8192))
    batching = BatchingSpec(
        max_batch_size=max_batch_size,
        max_batch_units=_number({"u": units}, "u", 8192, where) or 8192.0,
        max_wait_ms=_number(batching_raw, "max_wait_ms", 5.0, where) or 0.0,
        max_concurrent_batches=(
            _int(batching_raw, "max_concurrent_batches", 1, where)
            if "max_concurrent_batches" in batching_raw
            else None
        ),
    )
    memory_raw = raw.get("memory") or {}
    if not isinstance(memory_raw, dict):
        raise ConfigError(f"{where}: memory must be a mapping")
    check_keys(memory_raw, MEMORY_KEYS, f"{where}: memory")
    max_bytes = memory_raw.get("max_bytes")
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: options must be a mapping")
    check_options(options, adapter, engine, f"{where}: options")
    isolation = parse_isolation(raw, task, runtime, adapter, where)
    mps = raw.get("mps_active_thread_percentage")
    if mps is not None:
        if isolation != "process":
            raise ConfigError(f"{where}: mps_active_thread_percentage needs isolation: process")
        if not isinstance(mps, int) or isinstance(mps, bool) or not 1 <= mps <= 100:
            raise ConfigError(
                f"{where}: mps_active_thread_percentage must be an integer 1..100, got {mps!r}"
            )
    threads = raw.get("threads")
    if threads not in (None, "all") and (
        not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
    ):
        raise ConfigError(f"{where}: threads must be a positive integer or all, got {threads!r}")
    return ModelSpec(
        name=name,
        task=task,
        runtime=runtime,
        adapter=adapter,
        folder=folder,
        source=source,
        version=version,
        versions=versions,
        batching=batching,
        max_bytes=parse_bytes(max_bytes) if max_bytes is not None else None,
        preload=bool(raw.get("preload", False)),
        latency_target_ms=_number(raw, "latency_target_ms", None, where),
        max_inputs=_int(raw, "max_inputs", 2048, where),
        options=options,
        inputs=parse_inputs(task, options, where),
        description=str(raw.get("description", "")).strip(),
        licence=str(raw.get("licence", "")).strip(),
        version_policy=parse_version_policy(raw.get("version_policy"), where),
        engine=engine,
        isolation=isolation,
        mps_active_thread_percentage=mps,
        threads=threads,
        smoke=parse_smoke(raw.get("smoke"), task, folder, where),
    )


def parse_smoke(raw: Any, task: Task, folder: Path, where: str) -> tuple[SmokeCheck, ...]:
    """``smoke``: one check or a list of them, each ``{input, expect}`` (see
    ``SmokeCheck``); an image input must name a file in the model folder."""
    if raw is None:
        return ()
    where = f"{where}: smoke"
    checks = []
    for entry in raw if isinstance(raw, list) else [raw]:
        if not isinstance(entry, dict) or "input" not in entry or set(entry) - {"input", "expect"}:
            raise ConfigError(f"{where}: each check is a mapping of input and (optional) expect")
        value, expect = entry["input"], entry.get("expect")
        if expect is not None and (not isinstance(expect, str) or task in _NO_TEXT_ANSWER):
            raise ConfigError(f"{where}: expect is a text, for tasks that answer with text")
        if task is Task.RERANK:
            if not isinstance(value, dict) or set(value) != {"query", "document"}:
                raise ConfigError(f"{where}: a rerank input is {{query, document}}")
            if not all(isinstance(v, str) for v in value.values()):
                raise ConfigError(f"{where}: query and document are texts")
        elif not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}: input must be a text (an image file's path for ocr)")
        elif task is Task.OCR and not (folder / value).is_file():
            raise ConfigError(f"{where}: no image file {value!r} in the model folder")
        checks.append(SmokeCheck(value, expect))
    if not checks:
        raise ConfigError(f"{where}: give at least one check, or leave smoke out")
    return tuple(checks)


def parse_isolation(raw: dict[str, Any], task: Task, runtime: str, adapter: str, where: str) -> str:
    """``isolation``: ``inline`` (the default: in the server's process) or
    ``process`` (a worker process of its own, ``runtimes/isolated.py``)."""
    isolation = raw.get("isolation", "inline")
    if isolation not in ISOLATIONS:
        raise ConfigError(f"{where}: isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "process" and runtime == "external":
        raise ConfigError(f"{where}: runtime external runs in a process of its own already")
    if isolation == "process" and (task is Task.GENERATE or adapter == "hf-vision-ocr"):
        # Their items carry the server's callbacks (streamed text, stop flags).
        raise ConfigError(f"{where}: isolation: process is not for generating models")
    return str(isolation)


# Each kind of version_policy, and the keys its body may give.
_POLICY_KEYS = {"latest": ("num_versions",), "all": (), "specific": ("versions",)}


def parse_version_policy(raw: Any, where: str) -> VersionPolicy:
    """Triton's ``version_policy``: ``{latest: {num_versions: N}}``, ``{all: {}}``
    or ``{specific: {versions: [...]}}``; latest 1 when absent."""
    if raw is None:
        return VersionPolicy()
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ConfigError(f"{where}: version_policy must be one of latest, all, specific")
    ((kind, body),) = raw.items()
    body = body or {}
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: version_policy: {kind} must be a mapping")
    check_keys([kind], _POLICY_KEYS, f"{where}: version_policy")
    check_keys(body, _POLICY_KEYS[kind], f"{where}: version_policy: {kind}")
    if kind == "latest":
        return VersionPolicy(latest=_int(body, "num_versions", 1, f"{where}: version_policy"))
    if kind == "all":
        return VersionPolicy(latest=None)
    versions = body.get("versions")
    if kind != "specific" or not isinstance(versions, list) or not versions:
        raise ConfigError(f"{where}: version_policy must be one of latest, all, specific")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
        raise ConfigError(f"{where}: version_policy: specific versions must be integers")
    return VersionPolicy(latest=None, specific=tuple(sorted(versions)))
