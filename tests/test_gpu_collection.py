"""The GPU box has no soundfile, librosa, gradio, plotly, ray, httpx, fastapi, tokenizers, openai or av:
``pytest -m gpu tests/`` must still collect cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MISSING_ON_GPU_BOX = ("soundfile", "librosa", "gradio", "gradio_client", "plotly", "ray", "httpx", "fastapi",
                      "starlette", "tokenizers", "openai", "av", "websockets", "selenium")

_SHIM = '''
import sys
class _Block:
    """Pretends these packages are not installed, like on the GPU box."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError("No module named " + repr(name), name=name)
        return None
sys.meta_path.insert(0, _Block())
'''


def _collect(extra_pythonpath: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "gpu", "tests/"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_gpu_tests_collect_without_audio_ui_packages(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SHIM.format(names=set(MISSING_ON_GPU_BOX)))
    blocked = _collect(str(tmp_path))
    assert blocked.returncode == 0, blocked.stdout[-3000:] + blocked.stderr[-3000:]
    assert "error" not in blocked.stdout.lower()
    gpu_ids = [ln for ln in blocked.stdout.splitlines() if "::" in ln]
    assert gpu_ids
    full = _collect(None)
    assert [ln for ln in full.stdout.splitlines() if "::" in ln] == gpu_ids  # none lost to the missing packages
