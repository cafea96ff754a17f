"""The catalogue (``catalogue.py``): measured before estimated, the first
measurement kept, the total recomputed after each change."""

from __future__ import annotations

import pytest

from builders import make_spec
from tessera.footprint import Footprint
from tessera.repository import ModelSpec
from tessera.residency.catalogue import NO_ESTIMATE, Catalogue


def estimate(spec: ModelSpec) -> Footprint:
    if spec.options.get("broken"):
        raise OSError("weights unreadable")
    return Footprint(int(spec.options["own_bytes"]), dict(spec.options["shared"]))


def test_an_empty_catalogue_has_no_total_and_fits_nothing() -> None:
    catalogue = Catalogue(estimate)
    assert catalogue.total_bytes() is None
    assert not catalogue.all_fit(10**9)


def test_the_total_counts_a_shared_component_once() -> None:
    catalogue = Catalogue(estimate)
    catalogue.register(make_spec("a", 100, shared={"enc": 300}))
    catalogue.register(make_spec("b", 200, shared={"enc": 300}))
    assert catalogue.total_bytes() == 600
    assert catalogue.all_fit(600)
    assert not catalogue.all_fit(599)


def test_a_measurement_replaces_the_estimate_and_the_first_one_is_kept() -> None:
    catalogue = Catalogue(estimate)
    spec = make_spec("a", 100)
    catalogue.register(spec)
    assert catalogue.measured("a") is None
    assert catalogue.expected(spec) == Footprint(100)
    assert catalogue.measure("a", Footprint(150, method="rss")) == Footprint(150, method="rss")
    assert catalogue.measure("a", Footprint(999)) == Footprint(150, method="rss")
    assert catalogue.expected(spec) == Footprint(150, method="rss")
    assert catalogue.total_bytes() == 150  # not the stale 100


def test_forgetting_drops_the_model_and_its_measurement() -> None:
    catalogue = Catalogue(estimate)
    catalogue.register(make_spec("a", 100))
    catalogue.register(make_spec("b", 200))
    catalogue.measure("b", Footprint(250))
    assert catalogue.total_bytes() == 350
    catalogue.forget("b")
    assert catalogue.measured("b") is None
    assert catalogue.total_bytes() == 100
    catalogue.forget("a")
    assert catalogue.total_bytes() is None


def test_an_estimate_that_fails_counts_nothing() -> None:
    catalogue = Catalogue(estimate)
    broken = make_spec("bad", 100, broken=True)
    catalogue.register(broken)
    catalogue.register(make_spec("ok", 100))
    assert catalogue.expected(broken) is NO_ESTIMATE
    assert catalogue.total_bytes() == 100


def test_an_estimate_that_fails_says_why_in_the_debug_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    catalogue = Catalogue(estimate)
    with caplog.at_level("DEBUG", logger="tessera.residency"):
        catalogue.expected(make_spec("bad", 100, broken=True))
    assert [r.getMessage() for r in caplog.records] == [
        "no estimate for bad: OSError: weights unreadable"
    ]
