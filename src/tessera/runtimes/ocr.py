"""OCR with RapidOCR (PP-OCRv6 small, ONNX): pages and line crops.

A *page* runs detection, the optional 0/180-degree line classifier and
recognition; a *line crop* runs recognition alone, and the line crops of a
batch go through the recognizer together (padded ONNX batches of
``rec_batch_num``, the card's ``max_batch_size``).

An image that came as a file (``EncodedImage``) is decoded here, as its page
begins, and let go when the page is read: a batch of pages holds one page's
pixels at a time, inside the memory it reserved (its work units count the
decode, ``tasks/types.py``). Line crops are decoded and brought to the
recognizer's height one by one, before they go through it together.

A batch runs in steps with a step boundary between them
(``step.step_boundary``), where the batch may step aside while short batches
of other models run: each page's detection, its line classification, and each recognizer
batch. The stages are rapidocr's own (``detect_and_crop``,
``cls_and_rotate``, the recognizer, ``build_final_output``), called one by
one as ``RapidOCR.__call__`` calls them, and the recognizer's batches are the
ones it would form itself (crops sorted by aspect ratio, then cut in
``rec_batch_num``), so a page reads as one call reads it.

Only the models bundled in ``rapidocr/models/`` are offline: rapidocr fetches
any model it is not given a path for (``default_models.yaml`` lists URLs), so
the loader names all three files explicitly and refuses to start without them.
Threads and the CUDA provider are set through rapidocr's own
``EngineConfig.onnxruntime`` options, which build each ``InferenceSession``.
On the CPU the sessions load the three graphs as onnxruntime optimised them,
from the cache (``runtimes/ort_graphs.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.runtimes.base import LoadContext
from tessera.runtimes.memory import files_bytes
from tessera.runtimes.ort_graphs import cpu_only, optimized_graph
from tessera.step import step_boundary
from tessera.tasks.image import EncodedImage, pixels
from tessera.tasks.types import OcrInput, OcrLine, OcrOutput, work_units

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from tessera.device import Device
    from tessera.repository.spec import ModelSpec
    from tessera.tasks.types import ItemImage

_MODEL_OPTIONS = {
    "det_model": "PP-OCRv6_det_small.onnx",
    "rec_model": "PP-OCRv6_rec_small.onnx",
    "cls_model": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",
}
# Resident bytes per byte of ONNX weights after load and a warm-up page, as
# measured on CPU (onnxruntime's graph copies, the un-arena'd activations of a
# 736-pixel detection pass, the 18k-character recognizer dictionary).
_ESTIMATE_FACTOR = 6
_METHOD = "rss delta (load + warm-up)"


def _model_files(spec: ModelSpec) -> dict[str, Path]:
    """The det/rec/cls files: options name them relative to the source folder."""
    folder = spec.resolve_source()
    files: dict[str, Path] = {}
    for key, default in _MODEL_OPTIONS.items():
        path = folder / str(spec.options.get(key, default))
        if not path.is_file():
            raise ModelUnavailableError(spec.name, f"OCR model file not found: {path}")
        files[key] = path
    return files


def _engine_params(
    spec: ModelSpec, files: dict[str, Path], device: Device, threads: int
) -> dict[str, Any]:
    """rapidocr config overrides: bundled files, threads, provider, batch size."""
    ort = "EngineConfig.onnxruntime"
    params: dict[str, Any] = {
        "Global.log_level": "error",  # a blank page is a warning in rapidocr's log
        "Global.text_score": float(spec.options.get("text_score", 0.5)),
        "Det.model_path": str(files["det_model"]),
        "Rec.model_path": str(files["rec_model"]),
        "Cls.model_path": str(files["cls_model"]),
        # rapidocr ignores a thread count above the core count: clamp it ourselves.
        f"{ort}.intra_op_num_threads": max(1, min(threads, os.cpu_count() or 1)),
        f"{ort}.inter_op_num_threads": 1,
        f"{ort}.use_cuda": device.kind == "cuda",
        # One recognizer call per batch of line crops.
        "Rec.rec_batch_num": spec.batching.max_batch_size,
    }
    if device.kind == "cuda":
        for provider in device.onnx_providers(spec.max_bytes):
            if isinstance(provider, tuple) and provider[0] == "CUDAExecutionProvider":
                for key, value in provider[1].items():
                    params[f"{ort}.cuda_ep_cfg.{key}"] = value
        # Detection inputs change shape with every page; an exhaustive cuDNN
        # search would rerun for each new shape.
        params[f"{ort}.cuda_ep_cfg.cudnn_conv_algo_search"] = "HEURISTIC"
    extra = spec.options.get("rapidocr_params") or {}
    if not isinstance(extra, dict):
        raise ModelUnavailableError(spec.name, "option rapidocr_params must be a mapping")
    params.update(extra)
    return params


def _warm_up_image() -> npt.NDArray[np.uint8]:
    """A small synthetic page with a word on it, so every stage loads and runs.

    Square, because detection scales the short side up to 736 pixels: a wide
    strip would make the warm-up pass (and its measured peak) several times larger.
    """
    import cv2
    import numpy as np

    image = np.full((192, 192, 3), 255, dtype=np.uint8)
    cv2.putText(image, "tessera", (12, 108), cv2.FONT_HERSHEY_SIMPLEX, 1.2, (0, 0, 0), 3)
    return image


def _check_item(item: object) -> OcrInput:
    if not isinstance(item, OcrInput):
        raise InvalidInputError(f"OCR expects OcrInput items, got {type(item).__name__}")
    image = item.image
    shape: tuple[int, ...] = tuple(getattr(image, "shape", ()))
    uint8 = isinstance(image, EncodedImage) or getattr(image, "dtype", None) == "uint8"
    if not uint8 or len(shape) != 3 or shape[2] != 3:
        raise InvalidInputError("OCR image must be an H x W x 3 uint8 (BGR) array or an image file")
    if shape[0] < 1 or shape[1] < 1:
        raise InvalidInputError("OCR image is empty")
    if item.mode not in ("page", "line"):
        raise InvalidInputError(f"OCR mode must be 'page' or 'line', got {item.mode!r}")
    return item


def _whole_image_box(image: ItemImage) -> tuple[tuple[float, float], ...]:
    height, width = float(image.shape[0]), float(image.shape[1])
    return ((0.0, 0.0), (width, 0.0), (width, height), (0.0, height))


@dataclass
class RapidOcrModel:
    """A loaded RapidOCR engine; its det/cls/rec sessions were created at load."""

    engine: Any
    use_cls: bool
    own_bytes: int
    method: str

    def run(self, items: Sequence[Any]) -> list[Any]:
        checked = [_check_item(item) for item in items]
        steps = _Steps()
        outputs: list[OcrOutput | None] = [None] * len(checked)
        line_ids = [i for i, item in enumerate(checked) if item.mode == "line"]
        if line_ids:
            for i, output in zip(
                line_ids, self._recognize([checked[i].image for i in line_ids], steps), strict=True
            ):
                outputs[i] = output
        for i, item in enumerate(checked):
            if item.mode == "page":
                outputs[i] = self._page(item.image, steps)
        return outputs

    def _page(self, image: ItemImage, steps: _Steps) -> OcrOutput:
        """Detection, classification and recognition, each a step (see the module notes)."""
        from rapidocr.ch_ppocr_cls import TextClsOutput
        from rapidocr.main import RapidOCRError

        engine = self.engine
        original = engine.load_img(pixels(image))
        prepared, record = engine.preprocess_img(original)
        steps.next()
        try:
            crops, detected = engine.detect_and_crop(prepared, record)
            lines, classified = crops, TextClsOutput()
            if self.use_cls:
                steps.next()
                lines, classified = engine.cls_and_rotate(crops)
        except RapidOCRError:  # no text found (rapidocr logs it as a warning, and so reads nothing)
            return OcrOutput(lines=())
        recognized = self._recognizer_batches(lines, steps)
        result = engine.build_final_output(
            original, detected, classified, recognized, crops, record
        )
        txts = getattr(result, "txts", None)
        boxes = getattr(result, "boxes", None)
        if not txts or boxes is None:
            return OcrOutput(lines=())
        return OcrOutput(
            lines=tuple(
                OcrLine(
                    text=str(text),
                    score=float(score),
                    box=tuple((float(x), float(y)) for x, y in box),
                )
                for box, text, score in zip(boxes, txts, result.scores, strict=True)
            )
        )

    def _recognize(self, crops: list[ItemImage], steps: _Steps) -> list[OcrOutput]:
        """Recognition alone over line crops; the same pre-processing as
        ``engine(img, use_det=False)`` (bounds on the sides)."""
        engine = self.engine
        prepared = [engine.preprocess_img(engine.load_img(pixels(crop)))[0] for crop in crops]
        result = self._recognizer_batches(prepared, steps)
        outputs = []
        for crop, text, score in zip(crops, result.txts or (), result.scores, strict=True):
            if not str(text).strip():
                outputs.append(OcrOutput(lines=()))
                continue
            line = OcrLine(text=str(text), score=float(score), box=_whole_image_box(crop))
            outputs.append(OcrOutput(lines=(line,)))
        return outputs

    def _recognizer_batches(self, images: list[npt.NDArray[np.uint8]], steps: _Steps) -> Any:
        """The recognizer over ``images``, a step per batch of ``rec_batch_num``,
        formed as the recognizer forms them in one call (sorted by aspect
        ratio), so each text is the one that call gives; its ``TextRecOutput``."""
        import numpy as np
        from rapidocr.ch_ppocr_rec import TextRecInput, TextRecOutput

        recognizer = self.engine._load_rec_model()
        ratios = np.array([image.shape[1] / float(image.shape[0]) for image in images])
        order = [int(i) for i in np.argsort(ratios)]
        txts: list[str] = [""] * len(images)
        scores: list[float] = [0.0] * len(images)
        size = int(recognizer.rec_batch_num)
        for begin in range(0, len(order), size):
            steps.next()
            batch = order[begin : begin + size]
            result = recognizer(TextRecInput(img=[images[i] for i in batch]))
            for i, text, score in zip(batch, result.txts, result.scores, strict=True):
                txts[i], scores[i] = text, score
        output: Any = TextRecOutput  # its annotations say 1-tuples; it takes any length
        return output(
            imgs=images,
            txts=tuple(txts),
            scores=scores,
            word_results=tuple(None for _ in images),
        )

    def memory(self) -> Footprint:
        return Footprint(own_bytes=self.own_bytes, method=self.method)

    def unload(self) -> None:
        self.engine = None


class _Steps:
    """A batch's steps: a step boundary before each but the first."""

    __slots__ = ("_begun",)

    def __init__(self) -> None:
        self._begun = False

    def next(self) -> None:
        if self._begun:
            step_boundary()
        self._begun = True


class RapidOcrLoader:
    """Adapter ``rapidocr``: PP-OCRv6 det + rec (+ cls) through rapidocr's onnxruntime engine."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return _ESTIMATE_FACTOR * sum(p.stat().st_size for p in _model_files(spec).values())

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def alone_units(self, spec: ModelSpec, item: object) -> float | None:
        """Pages run one after another (line crops go through the recognizer together)."""
        if isinstance(item, OcrInput) and item.mode == "page":
            return work_units(item, spec.inputs)
        return None

    def load(self, spec: ModelSpec, ctx: LoadContext) -> RapidOcrModel:
        files = _model_files(spec)
        graphs = files
        if cpu_only(ctx.device.onnx_providers(spec.max_bytes)):  # made once, before the measurement
            graphs = {k: optimized_graph(p, ctx.cache_dir, spec.name) for k, p in files.items()}
        params = _engine_params(spec, graphs, ctx.device, ctx.threads)
        use_cls = bool(spec.options.get("use_cls", True))
        try:
            from rapidocr import RapidOCR
        except ImportError as e:
            raise ModelUnavailableError(
                spec.name, "rapidocr is not installed: pip install 'tessera[models]'"
            ) from e

        def build() -> Any:
            engine: Any = RapidOCR(params=params)
            # rapidocr creates sessions lazily on first use: create all three now,
            # inside the measurement, then run one page and one crop through them.
            # Its private loaders: no public call makes a session without running
            # it; held to by the exact pin of rapidocr in pyproject.toml.
            engine._load_det_model()
            engine._load_rec_model()
            if use_cls:
                engine._load_cls_model()
            if ctx.warm_up:
                image = _warm_up_image()
                engine(image, use_det=True, use_cls=use_cls, use_rec=True)
                engine(image, use_det=False, use_cls=False, use_rec=True)
            return engine

        try:
            measured = ctx.measure(build)
        except Exception as e:
            raise ModelUnavailableError(spec.name, f"rapidocr failed to load: {e}") from e
        weights = sum(files_bytes(p) for p in files.values())
        own, method = measured.rss_delta_bytes, _METHOD
        if own < weights:
            own, method = weights, f"{_METHOD}; below the weight files, so their size"
        return RapidOcrModel(engine=measured.value, use_cls=use_cls, own_bytes=own, method=method)
