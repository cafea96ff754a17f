"""The GPU check's budget that holds N models, from the all-resident run's
figures, when the models share bytes (their architecture's graphs) and when not."""

from __future__ import annotations

from gpu_check import own_and_shared

MIB = 2**20


def test_shared_bytes_are_split_out_of_a_models_measured_bytes() -> None:
    # 100 models of 45 MiB each and 70 MiB of graphs they share: each measured
    # at 115 MiB (its own and the shared), 4,570 MiB used in all.
    resident = {"model_bytes": 115 * MIB, "used_bytes": 4570 * MIB, "states": {"ready": 100}}
    assert own_and_shared(resident) == (45 * MIB, 70 * MIB)


def test_models_that_share_nothing_are_their_measured_bytes() -> None:
    resident = {"model_bytes": 45 * MIB, "used_bytes": 4500 * MIB, "states": {"ready": 100}}
    assert own_and_shared(resident) == (45 * MIB, 0)


def test_without_two_resident_models_there_is_no_split() -> None:
    assert own_and_shared({"model_bytes": 45 * MIB, "used_bytes": 45 * MIB}) is None
    assert own_and_shared({}) is None
