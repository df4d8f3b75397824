"""Checks that keep the package's shape: no import cycle, layers that point one way, short modules, and benchmark
scripts that answer ``--help``.

The checkers are plain functions over a source tree (``scan`` reads every module's imports from its AST, lazy
imports inside functions included, since a lazy import is still a dependency), so the tests at the bottom run
them on tiny synthetic trees first: each check is shown to FAIL on a violation and cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "cosyvoice_fast"
MAX_LINES = 400

# rank of each top-level subpackage: a module may import modules of its own rank or lower (see the README's layout)
RANKS = {"config": 0, "telemetry": 0, "kernels": 1, "llm": 2, "flow": 2, "vocoder": 2, "frontend": 2, "modeldir": 2,
         "engine": 3, "serving": 4, "app": 5, "cli": 5, "bench": 5}
MODEL_RANK = 1  # any ``*.model.*`` module: pure math
MODEL_MAY_IMPORT = ("config",)  # model modules import only these top-level packages and other model modules
ROOT_RANKS = {"__init__": 0, "__main__": 5}  # the package itself: a docstring, and ``python -m`` = the CLI


# ------------------------------------------------------------------------------------------------ reading a tree
def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/package`` (``a/__init__.py`` is ``a``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the tree (``pkg.mod.func`` -> ``pkg.mod``), else None."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tree's modules that module ``name`` imports anywhere in its body (absolute and relative imports, at top
    level or inside functions); ``from pkg import mod`` counts as importing ``pkg.mod`` when that is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
            # ``from pkg import name``: the submodule when ``name`` is one, else the package itself
            targets = [t for t in targets[:-1] if t in modules] or [base]
        for t in targets:
            hit = _resolve(t, modules)
            if hit is not None and hit != name:
                found.add(hit)
    return found


def scan(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Import graph of the tree: module -> the tree's modules it imports."""
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


# ------------------------------------------------------------------------------------------------ the checks
def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; empty when acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # iterative would be longer; the package is far below the recursion limit
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _is_model(name: str) -> bool:
    """A module of a stage's ``model/`` package (``llm.model.qwen2``); ``config.model`` is configuration."""
    parts = name.split(".")[1:]
    return bool(parts) and parts[0] not in ("config", "telemetry") and "model" in parts[1:]


def rank_of(name: str) -> int | None:
    """The layer of a module (None for a top-level package that has no rank yet: give it one in ``RANKS``)."""
    parts = name.split(".")[1:]
    if not parts:
        return ROOT_RANKS["__init__"]
    if _is_model(name):
        return MODEL_RANK
    if len(parts) == 1 and parts[0] in ROOT_RANKS:
        return ROOT_RANKS[parts[0]]
    return RANKS.get(parts[0])


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up a layer, every model module importing beyond config and model modules, and
    every module without a rank; one line each."""
    out = []
    for mod in sorted(graph):
        r = rank_of(mod)
        if r is None:
            out.append(f"{mod}: its package has no rank in RANKS")
            continue
        for dep in sorted(graph[mod]):
            d = rank_of(dep)
            if d is None:
                continue  # reported as its own line
            if _is_model(mod) and not (_is_model(dep) or dep.split(".")[1:2][0] in MODEL_MAY_IMPORT):
                out.append(f"{mod} (model) imports {dep}: model modules import only config and model modules")
            elif d > r:
                out.append(f"{mod} (rank {r}) imports {dep} (rank {d})")
    return out


def long_modules(root: Path, package: str = PACKAGE, limit: int = MAX_LINES) -> list[str]:
    """``module: N lines`` for every module longer than ``limit`` lines."""
    out = []
    for name, path in module_files(root, package).items():
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{name}: {n} lines")
    return out


def scripts_failing_help(scripts: list[Path], cwd: Path, timeout: float = 120.0) -> list[str]:
    """``script: why`` for every script whose ``--help`` does not exit 0 within ``timeout`` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])}

    def run(script: Path) -> str | None:
        try:
            p = subprocess.run([sys.executable, str(script), "--help"], cwd=cwd, env=env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"{script.name}: --help took more than {timeout:.0f} s"
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [""]
            return f"{script.name}: --help exited {p.returncode}: {tail[0]}"
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        return [r for r in pool.map(run, scripts) if r is not None]


def benchmark_scripts(root: Path = REPO) -> list[Path]:
    return sorted(p for p in (root / "benchmarks").glob("*.py") if p.name != "__init__.py")


# ------------------------------------------------------------------------------------------------ the real tree
def test_the_package_has_no_import_cycle():
    cycles = import_cycles(scan(REPO))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_layers_point_one_way():
    bad = layer_violations(scan(REPO))
    assert not bad, "imports against the layers (config,telemetry < kernels,*/model < stages < engine < serving " \
                    "< app,cli,bench):\n" + "\n".join(bad)


def test_no_module_is_longer_than_the_limit():
    bad = long_modules(REPO)
    assert not bad, f"modules over {MAX_LINES} lines:\n" + "\n".join(bad)


def test_every_benchmark_script_answers_help():
    scripts = benchmark_scripts()
    assert scripts, "no benchmarks/*.py found"
    bad = scripts_failing_help(scripts, REPO)
    assert not bad, "benchmark scripts whose --help fails:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------------ the checkers fail
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / PACKAGE / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in [tmp_path / PACKAGE, *(p for p in (tmp_path / PACKAGE).rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return tmp_path


def test_a_two_module_cycle_is_found_through_a_lazy_relative_import(tmp_path):
    root = _tree(tmp_path, {
        "engine/a.py": "from cosyvoice_fast.engine.b import f\n",
        "engine/b.py": "def f():\n    from .a import g  # lazy, relative\n    return g\n",
        "engine/c.py": "from cosyvoice_fast.engine import a\n",  # imports into the cycle, not part of it
    })
    graph = scan(root)
    assert graph[f"{PACKAGE}.engine.b"] == {f"{PACKAGE}.engine.a"}
    assert graph[f"{PACKAGE}.engine.c"] == {f"{PACKAGE}.engine.a"}  # ``from pkg import mod`` is the module
    assert import_cycles(graph) == [[f"{PACKAGE}.engine.a", f"{PACKAGE}.engine.b"]]


def test_an_acyclic_tree_has_no_cycle(tmp_path):
    root = _tree(tmp_path, {"engine/a.py": "import cosyvoice_fast.engine.b\n", "engine/b.py": "x = 1\n"})
    assert import_cycles(scan(root)) == []


def test_parent_relative_imports_resolve(tmp_path):
    root = _tree(tmp_path, {"llm/model/m.py": "from ...config.c import X\nfrom .. import runner\n",
                            "llm/runner.py": "", "config/c.py": "X = 1\n"})
    assert scan(root)[f"{PACKAGE}.llm.model.m"] == {f"{PACKAGE}.config.c", f"{PACKAGE}.llm.runner"}


def test_an_upward_import_is_a_violation(tmp_path):
    root = _tree(tmp_path, {
        "serving/http.py": "def f():\n    from cosyvoice_fast.app.queue import q\n",  # serving (4) -> app (5)
        "app/queue.py": "from cosyvoice_fast.serving.http import f\n",  # app (5) -> serving (4): fine
        "config/c.py": "from cosyvoice_fast.engine import e\n",  # config (0) -> engine (3)
        "engine/e.py": "from cosyvoice_fast.llm.model import m\n",  # engine -> a model: fine
        "llm/model/m.py": "from cosyvoice_fast.llm.kernels import k\nfrom cosyvoice_fast.config import c\n",
        "llm/kernels/k.py": "from cosyvoice_fast.llm.model.m import X\n",  # a stage's kernels -> model: fine
        "flow/model/f.py": "from cosyvoice_fast.llm.model.m import X\n",  # model -> another model: fine
        "config/model.py": "from cosyvoice_fast.config.c import X\n",  # configuration, not a model module
        "config/d.py": "from cosyvoice_fast.config.model import Y\n",
        "newpkg/x.py": "",
    })
    bad = layer_violations(scan(root))
    assert bad == [
        f"{PACKAGE}.config.c (rank 0) imports {PACKAGE}.engine.e (rank 3)",
        f"{PACKAGE}.llm.model.m (model) imports {PACKAGE}.llm.kernels.k: model modules import only config and "
        "model modules",
        f"{PACKAGE}.newpkg: its package has no rank in RANKS",
        f"{PACKAGE}.newpkg.x: its package has no rank in RANKS",
        f"{PACKAGE}.serving.http (rank 4) imports {PACKAGE}.app.queue (rank 5)",
    ]


def test_a_401_line_module_is_too_long_and_400_is_not(tmp_path):
    root = _tree(tmp_path, {"engine/long.py": "x = 1\n" * 401, "engine/ok.py": "x = 1\n" * 400})
    assert long_modules(root) == [f"{PACKAGE}.engine.long: 401 lines"]


def test_a_script_whose_help_fails_is_listed(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    assert scripts_failing_help([good, broken], tmp_path, timeout=60) == [
        "broken.py: --help exited 1: ModuleNotFoundError: No module named 'no_such_module_here'"]


def test_paths_to_the_repository_name_real_files():
    """Modules find ``assets/`` from their own file: a move between folders must move the path with it."""
    from cosyvoice_fast.app import bistream as app_bistream, page
    from cosyvoice_fast.cli import bistream as cli_bistream, main
    from cosyvoice_fast.serving import voices

    assert voices.ASSETS == page.ASSETS == REPO / "assets"
    for prompt in (app_bistream.DEFAULT_PROMPT, cli_bistream.DEFAULT_PROMPT, main.DEFAULT_PROMPT):
        assert prompt.is_file(), prompt
    assert "cross_lingual_prompt" in voices.bundled_voices()
    ray_serve = pytest.importorskip("cosyvoice_fast.serving.ray_serve", reason="ray[serve] is not installed here")
    assert ray_serve.REPO_ROOT == REPO
