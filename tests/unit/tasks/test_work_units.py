"""OCR's work unit follows the detection pass, which its activations scale with."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.tasks.types import OcrInput, work_units


def image(height: int, width: int) -> np.ndarray:
    return np.zeros((height, width, 3), dtype=np.uint8)


def test_a_small_page_costs_one_detection_page() -> None:
    assert work_units(OcrInput(image(192, 192))) == pytest.approx(1.0)
    assert work_units(OcrInput(image(736, 736))) == pytest.approx(1.0)


def test_a_tall_receipt_costs_its_aspect_and_a_large_scan_its_pixels() -> None:
    assert work_units(OcrInput(image(1200, 400))) == pytest.approx(3.0)
    assert work_units(OcrInput(image(1472, 1472))) == pytest.approx(4.0)


def test_a_line_crop_costs_its_own_pixels() -> None:
    assert work_units(OcrInput(image(32, 368), mode="line")) == pytest.approx(32 * 368 / 736**2)
