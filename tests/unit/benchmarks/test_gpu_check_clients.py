"""The GPU check's client processes: where each one's list of the models starts."""

from __future__ import annotations

from gpu_check import LoadPlan, client_offset


def test_round_robin_clients_start_spread_over_the_models() -> None:
    plan = LoadPlan("rr", concurrency=64, processes=4, duration_s=10)
    assert [client_offset(plan, i, 100) for i in range(4)] == [0, 25, 50, 75]


def test_zipf_clients_share_one_ranking_of_the_models() -> None:
    plan = LoadPlan("zipf", concurrency=64, processes=4, duration_s=10, zipf=1.1)
    assert [client_offset(plan, i, 100) for i in range(4)] == [0, 0, 0, 0]
