"""The documentation site builds with every link checked, and says what the code does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
MAX_PAGE_LINES = 600
# Words of how the docs were written, not of what the product does.
HISTORY = re.compile(
    r"\b(this|last|next|earlier|that) session\b|\bthis round\b|\byesterday\b|\b[Ii]ssue #?\d",
)


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    built = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert built.returncode == 0, built.stderr[-4000:]


def test_the_configuration_page_is_what_the_code_says() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    page = config_reference.render()  # raises where a key is not described
    assert (DOCS / "configuration.md").read_text(encoding="utf-8") == page, (
        "docs/configuration.md is stale: run scripts/config_reference.py"
    )
    for key in config_reference.config_keys():
        assert f"| `{key}` |" in page


def test_no_page_is_too_long_or_tells_its_history() -> None:
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        assert text.count("\n") <= MAX_PAGE_LINES, f"{page.name}: over {MAX_PAGE_LINES} lines"
        found = HISTORY.search(text)
        assert found is None, f"{page.relative_to(ROOT)}: {found.group(0) if found else ''!r}"


def test_the_benchmark_reports_kept_are_the_ones_cited() -> None:
    cited: set[str] = set()
    for page in _pages():
        pattern = r"benchmarks/results/([A-Za-z0-9._-]+\.(?:md|txt|json))"
        cited |= set(re.findall(pattern, page.read_text(encoding="utf-8")))
    kept = {p.name for p in RESULTS.iterdir()}
    assert cited <= kept, f"cited but missing: {sorted(cited - kept)}"
    twins = {name.rsplit(".", 1)[0] + ".json" for name in cited if name.endswith((".md", ".txt"))}
    assert kept <= cited | twins, f"kept but not cited: {sorted(kept - cited - twins)}"
    assert sum(p.stat().st_size for p in RESULTS.iterdir()) < 2 * 2**20
