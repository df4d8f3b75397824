"""``python install.py``: keeps an installed torch, the CUDA build only with a GPU, a CPU build otherwise; and
requirements.txt alone never installs torch (PyPI's Linux torch is the CUDA build)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import install  # noqa: E402


def _args(way: list[list[str]]) -> list[list[str]]:
    return [cmd[cmd.index("install") + 1:] for cmd in way]


def test_installed_torch_is_kept():
    assert install.torch_attempts(has_torch=True, has_gpu=True, from_pypi=False) == []
    assert install.torch_attempts(has_torch=True, has_gpu=False, from_pypi=True) == []


def test_gpu_box_gets_pypi_cuda_build():
    assert [_args(w) for w in install.torch_attempts(False, True, False)] == [[["torch>=2.4"]]]


def test_cpu_box_gets_local_cpu_wheel_then_cpu_index_never_pypi():
    ways = [_args(w) for w in install.torch_attempts(False, False, False)]
    assert ways == [[["--no-index", "--no-deps", "torch>=2.4"], ["torch>=2.4"]],
                    [["torch>=2.4", "--index-url", "https://download.pytorch.org/whl/cpu"]]]
    assert [_args(w) for w in install.torch_attempts(False, False, True)] == [[["torch>=2.4"]]]


def test_requirements_never_name_torch():
    names = [ln.split("#")[0].strip() for ln in (REPO / "requirements.txt").read_text().splitlines()]
    assert not [n for n in names if n.lower().startswith("torch") and not n.lower().startswith("torchaudio")]
    assert "python install.py" in (REPO / "requirements.txt").read_text()


def test_dry_run_keeps_this_machines_torch():
    out = subprocess.run([sys.executable, "install.py", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["torch is already installed: keeping it",
                                       f"+ {sys.executable} -m pip install -r {REPO / 'requirements.txt'}"]


def test_unreachable_cpu_build_says_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(install.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(install.shutil, "which", lambda name: None)
    monkeypatch.setattr(install.subprocess, "call", lambda cmd: 1)
    assert install.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: No CPU build of torch is reachable from here")
    assert "python install.py --torch-from-pypi" in err


@pytest.mark.parametrize("script", [".ci/run"])
def test_ci_uses_the_readme_install_command(script):
    text = (REPO / script).read_text()
    assert "python install.py" in text and "torch==" not in text
    readme_head = "\n".join((REPO / "README.md").read_text().splitlines()[:25])
    for cmd in ("python install.py", "python app.py", "python -m pytest -q tests", "ffmpeg", "chromium-driver"):
        assert cmd in readme_head, cmd
