"""Without the parity fixtures a clone runs clean (skips naming COSYVOICE_FIXTURE_DIR); CI's switch makes it fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    missing = tmp_path / "no-fixtures"
    full_env = {k: v for k, v in os.environ.items() if k != "COSYVOICE_REQUIRE_FIXTURES"}
    full_env.update(COSYVOICE_FIXTURE_DIR=str(missing), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_parity_audio.py", "-k", "prompt_mel_accepts or whisper"],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("switch", [None, "0"])
def test_missing_fixtures_skip_with_reason(tmp_path, switch):
    out = _run(tmp_path, **({} if switch is None else {"COSYVOICE_REQUIRE_FIXTURES": switch}))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 skipped" in out.stdout and "error" not in out.stdout.lower()
    expected = (f"2 tests skipped: parity fixtures not found at {(tmp_path / 'no-fixtures').resolve()}: put "
                "../shared/fixtures/cosyvoice2-tiny beside the checkout or set "
                "COSYVOICE_FIXTURE_DIR=/path/to/cosyvoice2-tiny")
    assert expected in out.stdout


def test_ci_switch_makes_missing_fixtures_fail(tmp_path):
    out = _run(tmp_path, COSYVOICE_REQUIRE_FIXTURES="1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 errors" in out.stdout  # the fixture fails, so pytest counts errors; either way CI exits 1
    assert "COSYVOICE_REQUIRE_FIXTURES=1: the fixtures are required here" in out.stdout


def test_ci_script_sets_the_switch():
    script = (REPO / ".ci" / "run").read_text()
    assert "export COSYVOICE_REQUIRE_FIXTURES=1" in script
    assert script.index("COSYVOICE_REQUIRE_FIXTURES=1") < script.index("python -m pytest")
