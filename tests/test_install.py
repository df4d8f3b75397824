"""``python install.py``: keeps an installed torch, the CUDA build only with a GPU, a CPU build otherwise; and
requirements.txt alone never installs torch (PyPI's Linux torch is the CUDA build)."""

from __future__ import annotations

import json
import os
import re
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


def test_requirements_bring_every_package_the_features_and_tests_import():
    """The API's formats (PyAV), the HTTP API test (openai), the fused kernels' CPU tests (triton) and Ray Serve at
    the floor its deployment needs: a README install must not leave a feature broken or a test skipped."""
    lines = [ln.split("#")[0].strip() for ln in (REPO / "requirements.txt").read_text().splitlines()]
    names = {re.split(r"[<>=;\[ ]", ln, maxsplit=1)[0].lower(): ln for ln in lines if ln}
    for pkg in ("av", "openai", "triton", "httpx", "gradio", "soundfile", "selenium", "psutil", "onnx"):
        assert pkg in names, pkg
    assert 'platform_system == "Linux"' in names["triton"]  # PyPI has Linux wheels only
    assert names["ray"].startswith("ray[serve]>=2.60")


def test_ci_installs_nothing_beside_the_readme_install():
    text = (REPO / ".ci" / "run").read_text()
    assert "pip install" not in text.replace("python install.py", "")
    assert "python -m pytest -q -rfEs tests" in text and "tests/skip_check.py" in text


def _run_with_skip_report(tmp_path: Path, test_source: str) -> tuple[subprocess.CompletedProcess, list]:
    (tmp_path / "test_x.py").write_text(test_source)
    report = tmp_path / "skips.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "COSYVOICE_SKIP_REPORT": str(report)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "skip_check", "test_x.py"], cwd=tmp_path, env=env,
                   capture_output=True, text=True, timeout=120)
    checked = subprocess.run([sys.executable, str(REPO / "tests" / "skip_check.py"), str(report)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    return checked, json.loads(report.read_text())


def test_ci_skip_check_fails_on_a_missing_package_and_names_the_test(tmp_path):
    checked, skips = _run_with_skip_report(tmp_path, (
        "import pytest\n"
        "def test_gpu():\n    pytest.skip('needs a CUDA GPU')\n"
        "def test_pkg():\n    pytest.importorskip('no_such_package_here')\n"
        "def test_ok():\n    pass\n"))
    assert [s["nodeid"] for s in skips] == ["test_x.py::test_gpu", "test_x.py::test_pkg"]
    assert checked.returncode == 1
    assert "test_x.py::test_pkg: could not import 'no_such_package_here'" in checked.stderr
    assert "test_gpu" not in checked.stderr


def test_ci_skip_check_sees_a_whole_module_skipped_at_collection(tmp_path):
    checked, skips = _run_with_skip_report(tmp_path, "import pytest\npytest.importorskip('no_such_package_here')\n"
                                                     "def test_a():\n    pass\n")
    assert [s["nodeid"] for s in skips] == ["test_x.py"] and checked.returncode == 1


def test_ci_skip_check_passes_allowed_skips(tmp_path):
    checked, _ = _run_with_skip_report(tmp_path, "import pytest\ndef test_gpu():\n    pytest.skip('needs a CUDA GPU')\n")
    assert checked.returncode == 0, checked.stderr
    assert "1 skips, all for allowed reasons" in checked.stdout


def test_system_packages_as_root_need_no_sudo_and_a_user_gets_sudo():
    pkgs = ["ffmpeg", "chromium", "chromium-driver", "fonts-noto-cjk"]
    assert install.apt_commands(is_root=True, has_sudo=False) == [["apt-get", "update"],
                                                                  ["apt-get", "install", "-y", *pkgs]]
    assert install.apt_commands(is_root=False, has_sudo=True) == [["sudo", "apt-get", "update"],
                                                                  ["sudo", "apt-get", "install", "-y", *pkgs]]
    with pytest.raises(RuntimeError, match="needs root or sudo"):
        install.apt_commands(is_root=False, has_sudo=False)


def test_system_packages_dry_run_prints_apt_first():
    out = subprocess.run([sys.executable, "install.py", "--system-packages", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[:2]
    sudo = "" if os.geteuid() == 0 else "sudo "
    assert first == [f"+ {sudo}apt-get update",
                     f"+ {sudo}apt-get install -y ffmpeg chromium chromium-driver fonts-noto-cjk"]
