"""Install cosyvoice_fast's dependencies with the right torch for this machine: ``python install.py``.

Why a script and not just ``pip install -r requirements.txt``: PyPI's Linux torch is the CUDA build (a large wheel
plus gigabytes of CUDA libraries), and a requirements file cannot choose a build per machine.  So torch is left out
of requirements.txt and chosen here:

1. torch already installed (a GPU box's CUDA build, or a CPU build you chose): kept as it is.
2. an NVIDIA GPU (``nvidia-smi`` on PATH): PyPI's torch, i.e. the CUDA build.
3. no GPU: a CPU wheel pip can already see without an index (``PIP_FIND_LINKS`` / ``find-links`` in pip.conf, e.g.
   a wheelhouse), else the PyTorch CPU index (download.pytorch.org/whl/cpu).  When neither can be reached the
   script stops and says what to do; ``--torch-from-pypi`` accepts PyPI's CUDA build instead (it runs on CPU too).

Then ``requirements.txt`` (which never touches torch).  ``--dry-run`` prints the commands without running them.

``--system-packages`` first installs the Debian/Ubuntu packages the app uses (ffmpeg for gradio_client's streamed
audio, chromium + chromedriver for the browser test, fonts-noto-cjk so Chinese text renders in that browser) with
``apt-get install -y``: directly as root (Docker, Autodl: no sudo there), through ``sudo`` otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCH = "torch>=2.4"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
NO_CPU_TORCH = (
    "No CPU build of torch is reachable from here: no wheel in pip's find-links and the PyTorch CPU index "
    f"({CPU_INDEX}) did not answer. Either fetch a CPU wheel on another machine and run "
    "`pip install torch-<version>+cpu-<tags>.whl`, then `python install.py` again; or accept PyPI's CUDA build "
    "(gigabytes, works on CPU too): `python install.py --torch-from-pypi`."
)


SYSTEM_PACKAGES = ("ffmpeg", "chromium", "chromium-driver", "fonts-noto-cjk")


def apt_commands(is_root: bool, has_sudo: bool) -> list[list[str]]:
    """``apt-get update`` + ``install -y`` of :data:`SYSTEM_PACKAGES`; prefixed by sudo only for a non-root user.
    Raises ``RuntimeError`` (with what to do) for a non-root user without sudo."""
    if not is_root and not has_sudo:
        raise RuntimeError("--system-packages needs root or sudo: run as root `apt-get install -y "
                           + " ".join(SYSTEM_PACKAGES) + "`, then `python install.py`")
    pre = [] if is_root else ["sudo"]
    return [pre + ["apt-get", "update"], pre + ["apt-get", "install", "-y", *SYSTEM_PACKAGES]]


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "install", *args]


def torch_attempts(has_torch: bool, has_gpu: bool, from_pypi: bool) -> list[list[list[str]]]:
    """Ways to install torch, in order; each is a list of pip commands and the first way whose commands all
    succeed wins.  Empty when the installed torch stays.

    A local CPU wheel goes in with ``--no-index --no-deps`` (a plain ``pip install torch`` would prefer PyPI's newer
    CUDA build over it); the second command then fetches only its small pure-Python dependencies, the installed
    torch already satisfying the requirement."""
    if has_torch:
        return []
    if has_gpu or from_pypi:
        return [[pip(TORCH)]]
    return [[pip("--no-index", "--no-deps", TORCH), pip(TORCH)], [pip(TORCH, "--index-url", CPU_INDEX)]]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python install.py", description=__doc__.splitlines()[0])
    ap.add_argument("--torch-from-pypi", action="store_true",
                    help="on a machine without a GPU, install PyPI's (CUDA) torch when no CPU build is reachable")
    ap.add_argument("--system-packages", action="store_true",
                    help="first apt-get install " + ", ".join(SYSTEM_PACKAGES) + " (as root directly, else via sudo)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.system_packages:
        try:
            apt = apt_commands(os.geteuid() == 0, shutil.which("sudo") is not None)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for cmd in apt:
            print("+", " ".join(cmd), flush=True)
            if not a.dry_run and subprocess.call(cmd) != 0:
                print("error: installing the system packages failed (see apt-get's message above)", file=sys.stderr)
                return 1
    has_torch = importlib.util.find_spec("torch") is not None
    has_gpu = shutil.which("nvidia-smi") is not None
    attempts = torch_attempts(has_torch, has_gpu, a.torch_from_pypi)
    if has_torch:
        print("torch is already installed: keeping it", flush=True)
    else:
        print(f"installing torch: {'CUDA build (NVIDIA GPU found)' if has_gpu else 'CPU build (no NVIDIA GPU)'}"
              if not a.torch_from_pypi else "installing torch from PyPI", flush=True)
    ok = not attempts
    for way in attempts:
        for cmd in way:
            print("+", " ".join(cmd), flush=True)
            if not a.dry_run and subprocess.call(cmd) != 0:
                break
        else:
            ok = True
            break
    if not ok:
        print(f"error: {NO_CPU_TORCH}", file=sys.stderr)
        return 1
    cmd = pip("-r", str(REQUIREMENTS))
    print("+", " ".join(cmd), flush=True)
    if not a.dry_run and subprocess.call(cmd) != 0:
        print("error: installing requirements.txt failed (see pip's message above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
