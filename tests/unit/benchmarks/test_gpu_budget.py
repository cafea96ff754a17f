"""The GPU check's budget that holds N models, from the all-resident run's
figures, when the models share bytes (their architecture's graphs) and when not."""

from __future__ import annotations

from gpu_check import own_and_shared, residency_part

MIB = 2**20


def test_shared_bytes_are_split_out_of_a_models_measured_bytes() -> None:
    # 100 models of 45 MiB each and 70 MiB of graphs they share: each measured
    # at 115 MiB (its own and the shared), 4,570 MiB used in all.
    resident = {
        "model_weights_bytes": 115 * MIB,
        "used_bytes": 4570 * MIB,
        "states": {"ready": 100},
    }
    assert own_and_shared(resident) == (45 * MIB, 70 * MIB)


def test_models_that_share_nothing_are_their_measured_bytes() -> None:
    resident = {"model_weights_bytes": 45 * MIB, "used_bytes": 4500 * MIB, "states": {"ready": 100}}
    assert own_and_shared(resident) == (45 * MIB, 0)


def test_without_two_resident_models_there_is_no_split() -> None:
    assert own_and_shared({"model_weights_bytes": 45 * MIB, "used_bytes": 45 * MIB}) is None
    assert own_and_shared({}) is None


def model(name: str, state: str, share: int, whole: int) -> dict[str, object]:
    return {"name": name, "state": state, "bytes": share, "weights_bytes": whole}


def test_the_split_reads_the_models_shared_bytes_whole_not_their_share() -> None:
    # As /admin/residency gives it: 70 MiB of graphs shared by 10 models of
    # 45 MiB, each model's share of the budget 52 MiB, its weights 115 MiB.
    models = [model(f"m{i}", "ready", 52 * MIB, 115 * MIB) for i in range(10)]
    models.append(model("gone", "unloaded", 0, 0))
    residency = {
        "models": models,
        "budget_bytes": 1000 * MIB,
        "used_bytes": 520 * MIB,
        "peak_used_bytes": 530 * MIB,
        "loads_total": 10,
        "evictions_total": 0,
    }
    part = residency_part(residency)
    assert part["states"] == {"ready": 10, "unloaded": 1}
    assert part["model_bytes"] == 52 * MIB
    assert own_and_shared(part) == (45 * MIB, 70 * MIB)
