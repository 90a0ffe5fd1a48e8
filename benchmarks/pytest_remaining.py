"""Test ids a cut pytest run did not finish: collect the suite here, drop every id the log
reports as PASSED / FAILED / SKIPPED / ERROR / XFAIL / XPASS (pytest -v or -vv lines), print
the rest one a line (for a follow-up ``pytest $(python3 benchmarks/pytest_remaining.py LOG)``).

    python3 benchmarks/pytest_remaining.py LOG [PYTEST ARGS ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    log = Path(argv[0]).read_text(errors="replace")
    done = set(re.findall(r"(tests/\S+::\S+)\s*(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)",
                          log))
    done |= set(re.findall(r"(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(tests/\S+::\S+)",
                           log))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *argv[1:]],
                         capture_output=True, text=True).stdout
    ids = [ln.strip() for ln in out.splitlines() if "::" in ln]
    rest = [i for i in ids if i not in done]
    print(f"# {len(ids)} collected, {len(ids) - len(rest)} in the log, {len(rest)} left",
          file=sys.stderr)
    print("\n".join(rest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
