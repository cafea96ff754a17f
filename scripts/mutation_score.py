"""Print the mutation score of `make mutation` per module and package, and every
survivor, from `mutmut results --all true` (run in the repository root)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

DETECTED = {"killed", "timeout", "caught by type check"}


def main() -> int:
    mutmut = Path(sys.executable).with_name("mutmut")
    out = subprocess.run(
        [str(mutmut), "results", "--all", "true"], capture_output=True, text=True, check=True
    ).stdout
    by_module: dict[str, Counter[str]] = defaultdict(Counter)
    survivors: list[str] = []
    for line in out.splitlines():
        match = re.match(r"\s*(tessera\.(\w+)\.(\w+)\.\S+): (.+)$", line)
        if match is None:
            continue
        name, package, module, status = match.groups()
        by_module[f"{package}.{module}"][status] += 1
        if status in ("survived", "no tests"):
            survivors.append(f"{name}: {status}")
    by_package: dict[str, Counter[str]] = defaultdict(Counter)
    for module, counts in by_module.items():
        by_package[module.split(".")[0]].update(counts)
    for title, table in (("module", by_module), ("package", by_package)):
        print(f"{title:24} detected/checked  score  (not checked)")
        for key, counts in sorted(table.items()):
            detected = sum(counts[s] for s in DETECTED)
            checked = detected + counts["survived"] + counts["no tests"]
            score = f"{100 * detected / checked:5.1f}%" if checked else "    -"
            print(f"{key:24} {detected:5}/{checked:<5}      {score}  ({counts['not checked']})")
        print()
    print("survivors:")
    print("\n".join(survivors) or "(none)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
