"""The side-by-side benches' sources and rerun commands (``harness.trees``)."""

from __future__ import annotations

from pathlib import Path

from harness.trees import rerun_command, tree_sources


def test_this_checkout_comes_first_then_each_tree_resolved(tmp_path: Path) -> None:
    assert tree_sources([]) == [("this checkout", None)]
    other = tmp_path / "a" / ".." / "b"
    assert tree_sources([other]) == [("this checkout", None), (str(other), other.resolve())]


def test_the_rerun_command_names_the_script_and_its_trees() -> None:
    script = "/anywhere/benchmarks/host_pool_bench.py"
    assert rerun_command(script, []) == "benchmarks/host_pool_bench.py"
    trees = [Path("/tmp/a/src"), Path("/tmp/b/src")]
    assert rerun_command(script, trees) == (
        "benchmarks/host_pool_bench.py --against /tmp/a/src /tmp/b/src"
    )
