"""The ``rapidocr`` adapter makes rapidocr's three sessions at load through its
private ``_load_det_model``, ``_load_cls_model`` and ``_load_rec_model`` (rapidocr
makes them lazily, and no public call makes one without running it), and runs
the recognizer's batches itself. It holds to rapidocr's exact version, pinned in
pyproject.toml: these fail when the installed rapidocr is another, or when those
methods no longer make each session once and keep it."""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from tessera.device import CpuDevice
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.ocr import _engine_params, _model_files

rapidocr = pytest.importorskip("rapidocr")  # the models extra

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_the_installed_rapidocr_is_the_pinned_one() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    pins = [d for deps in extras.values() for d in deps if d.startswith("rapidocr")]
    assert pins == [f"rapidocr=={version('rapidocr')}"]


@pytest.mark.parametrize(
    ("method", "attribute", "kind"),
    [
        ("_load_det_model", "text_det", "TextDetector"),
        ("_load_cls_model", "text_cls", "TextClassifier"),
        ("_load_rec_model", "text_rec", "TextRecognizer"),
    ],
)
def test_each_private_loader_makes_its_session_once(method: str, attribute: str, kind: str) -> None:
    assert list(inspect.signature(getattr(rapidocr.RapidOCR, method)).parameters) == ["self"]
    spec = read_spec(default_repository_path() / "pp-ocrv6")
    engine = rapidocr.RapidOCR(params=_engine_params(spec, _model_files(spec), CpuDevice(), 1))
    assert getattr(engine, attribute) is None  # lazily made
    made = getattr(engine, method)()
    assert type(made).__name__ == kind
    assert getattr(engine, attribute) is made
    assert getattr(engine, method)() is made
    if kind == "TextRecognizer":  # the adapter forms the recognizer's batches itself
        assert made.rec_batch_num == spec.batching.max_batch_size
