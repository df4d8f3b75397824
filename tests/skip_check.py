"""CI refuses skipped tests except for the reasons in ``tests/allowed_skips.txt``.

Two halves: pytest hooks (imported by ``tests/conftest.py``) that write every skip — a test's, or a whole file's at
collection (``importorskip``) — as JSON to ``$COSYVOICE_SKIP_REPORT`` when that is set, and a check,
``python tests/skip_check.py REPORT``, that ``.ci/run`` runs after pytest: it exits 1 listing the test ids whose
reason matches no allowed pattern.  A missing package then fails CI instead of hiding its tests.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

ALLOWED_FILE = Path(__file__).resolve().parent / "allowed_skips.txt"
REPORT_ENV = "COSYVOICE_SKIP_REPORT"
_skips: list[dict[str, str]] = []


def skip_reason(report: Any) -> str:
    """The message of a skipped report, without pytest's ``Skipped: `` prefix."""
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def record(report: Any) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append({"nodeid": report.nodeid, "reason": skip_reason(report)})


pytest_runtest_logreport = record  # a test skipped (tests/conftest.py calls ``record`` from its own hook)


def pytest_collectreport(report: Any) -> None:  # a whole module skipped (importorskip at import time)
    record(report)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(_skips, indent=1))


def load_allowed(path: Path = ALLOWED_FILE) -> list[re.Pattern]:
    lines = (ln.strip() for ln in path.read_text().splitlines())
    return [re.compile(ln) for ln in lines if ln and not ln.startswith("#")]


def disallowed(skips: list[dict[str, str]], allowed: list[re.Pattern]) -> list[str]:
    """``nodeid: reason`` of every skip whose reason matches no allowed pattern."""
    return [f"{s['nodeid']}: {s['reason']}" for s in skips if not any(p.match(s["reason"]) for p in allowed)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/skip_check.py SKIP_REPORT.json", file=sys.stderr)
        return 2
    report = Path(argv[0])
    if not report.is_file():
        print(f"skip check: no skip report at {report} (did pytest run with {REPORT_ENV} set?)", file=sys.stderr)
        return 1
    skips = json.loads(report.read_text())
    bad = disallowed(skips, load_allowed())
    if bad:
        print(f"skip check: {len(bad)} tests skipped for a reason not in tests/allowed_skips.txt (install what "
              "requirements.txt lists, or fix the test):", file=sys.stderr)
        for line in bad:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"skip check: {len(skips)} skips, all for allowed reasons")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
