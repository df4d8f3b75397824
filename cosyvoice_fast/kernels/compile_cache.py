"""A persistent compile cache: Triton's compiled kernels (and the previous start-up's phase times) kept on disk
per GPU, driver, library versions and model dims, so the second start on a box skips compilation.

Triton compiles every kernel specialisation on first use (seconds each; on a fresh machine that was most of a
five-minute start-up) and keeps the result under ``TRITON_CACHE_DIR``.  Its default (``~/.triton``) is neither
where an operator looks nor keyed by anything but the kernel source, so a container rebuilt on another driver
or GPU reused nothing it could trust and ``python -m cosyvoice_fast warmup`` had nowhere known to fill.  Here:

- the root is ``--cache-dir``, default ``$XDG_CACHE_HOME/cosyvoice_fast`` (``~/.cache/cosyvoice_fast``);
- each :func:`cache_key` (GPU name, driver, CUDA, torch, Triton, model dims) gets its own subdirectory, so a
  changed key compiles into another directory and never loads a kernel built for something else;
- :func:`open_compile_cache` checks the directory's ``key.json`` and every Triton entry (its group file parses,
  the files it names exist and are not empty); a corrupt one is removed with a warning and Triton rebuilds it;
- a cache root that cannot be written falls back to a temporary directory, said in one log line;
- :meth:`CompileCache.activate` sets ``TRITON_CACHE_DIR``; call it before the first kernel compiles (the stage
  builds).  The package has no autotuned kernels (tile choices are computed, not measured), so Triton's own
  cache is everything there is to keep; :meth:`CompileCache.read_record` / ``write_record`` keep small JSON
  records (the start-up phase times behind ``/health``'s estimate) beside it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

#: the environment variable Triton reads for its cache directory (read when a kernel compiles)
TRITON_ENV = "TRITON_CACHE_DIR"
KEY_FILE = "key.json"


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/cosyvoice_fast``, else ``~/.cache/cosyvoice_fast``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cosyvoice_fast"


def driver_version() -> str:
    """The CUDA driver's version (``cuDriverGetVersion``), or ``none`` without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return "none"


def key_fields(device: Any, model_dims: Mapping[str, Any]) -> dict[str, Any]:
    """What a compiled kernel depends on: the GPU, driver, CUDA runtime, torch and Triton versions, and the
    model's dimensions (kernels specialise on them)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "driver": driver_version() if gpu != "cpu" else "none",
            "cuda": str(torch.version.cuda), "torch": torch.__version__, "triton": triton_version,
            "model": dict(sorted(model_dims.items()))}


def cache_key(fields: Mapping[str, Any]) -> str:
    """A directory name for ``fields``: the GPU's name (readable) and a hash of everything."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    gpu = "".join(c if c.isalnum() else "-" for c in str(fields.get("gpu", "any"))).strip("-").lower()
    return f"{gpu[:40] or 'any'}-{hashlib.sha256(blob).hexdigest()[:16]}"


@dataclass
class CompileCache:
    """One opened cache directory: ``path`` (``root/key``, or a temporary directory when ``root`` could not be
    written: ``fallback``), its ``fields`` and what the checks removed (``rebuilt``)."""

    root: Path
    key: str
    path: Path
    fields: dict[str, Any]
    fallback: bool = False
    rebuilt: list[str] = field(default_factory=list)

    @property
    def triton_dir(self) -> Path:
        return self.path / "triton"

    def activate(self) -> None:
        """Point Triton at this cache (before anything compiles)."""
        self.triton_dir.mkdir(parents=True, exist_ok=True)
        os.environ[TRITON_ENV] = str(self.triton_dir)
        log.info("compile cache: %s%s (%d kernels cached)", self.path, " (temporary)" if self.fallback else "",
                 self.entries())

    def entries(self) -> int:
        """Triton kernels cached here (entry directories)."""
        d = self.triton_dir
        return sum(1 for p in d.iterdir() if p.is_dir() and not p.name.startswith("tmp.")) if d.is_dir() else 0

    def read_record(self, name: str) -> dict[str, Any] | None:
        """The JSON record ``name`` (None when missing; a corrupt one is removed with a warning)."""
        p = self.path / f"{name}.json"
        if not p.exists():
            return None
        try:
            data = json.loads(p.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except (OSError, ValueError) as e:
            log.warning("compile cache: record %s is corrupt (%s); removed, it will be rewritten", p, e)
            p.unlink(missing_ok=True)
            return None

    def write_record(self, name: str, data: Mapping[str, Any]) -> None:
        """Write the JSON record ``name`` atomically (a failure is logged, never raised)."""
        p = self.path / f"{name}.json"
        try:
            tmp = p.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(p)
        except OSError as e:
            log.warning("compile cache: could not write %s (%s)", p, e)


def _writable(path: Path) -> bool:
    """Whether files can be created in ``path`` (made if missing): a real write, since permission bits say
    nothing for root or read-only mounts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe"):
            pass
        return True
    except OSError:
        return False


def _entry_problem(entry: Path) -> str | None:
    """Why a Triton cache entry directory is unusable, or None.  An entry holds a kernel's files and group files
    (``__grp__*.json``, naming the files of one compile); Triton trusts a group whose files exist, so a
    truncated or emptied file would be loaded as is."""
    files = [p for p in entry.iterdir() if p.is_file()]
    for p in files:
        if p.name == "lock":
            continue
        if p.stat().st_size == 0:
            return f"empty file {p.name}"
        if p.name.startswith("__grp__"):
            try:
                children = json.loads(p.read_text()).get("child_paths")
            except (OSError, ValueError, AttributeError) as e:
                return f"unreadable group file {p.name} ({e})"
            if not isinstance(children, dict):
                return f"group file {p.name} names no files"
            for child in children.values():
                c = Path(child)
                if not c.exists() or c.stat().st_size == 0:
                    return f"group file {p.name} names a missing or empty file {c.name}"
    return None


def check_entries(cache: CompileCache) -> list[str]:
    """Remove every corrupt Triton entry (and left-over temporary directories of interrupted writes); one
    warning names them.  Returns the names removed."""
    d = cache.triton_dir
    if not d.is_dir():
        return []
    removed, why = [], []
    for entry in sorted(d.iterdir()):
        if not entry.is_dir():
            continue
        problem = _entry_problem(entry)
        if problem is not None:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
            why.append(f"{entry.name[:12]}…: {problem}")
    if removed:
        log.warning("compile cache: %d corrupt kernel entr%s removed, rebuilt on first use (%s)", len(removed),
                    "y" if len(removed) == 1 else "ies", "; ".join(why[:3]) + ("; …" if len(why) > 3 else ""))
    return removed


def _check_key(path: Path, fields: Mapping[str, Any]) -> bool:
    """Whether ``path/key.json`` holds ``fields``; missing is fine (new directory).  A corrupt or different one
    means the directory cannot be trusted: it is emptied (with a warning) and rebuilt."""
    p = path / KEY_FILE
    if not p.exists():
        return True
    try:
        ok = json.loads(p.read_text()) == json.loads(json.dumps(fields, default=str))
        problem = "it belongs to another key"
    except (OSError, ValueError) as e:
        ok, problem = False, f"unreadable ({e})"
    if not ok:
        log.warning("compile cache: %s is corrupt: %s; emptied, its kernels will be rebuilt", p, problem)
        for child in path.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
    return ok


def open_compile_cache(root: str | Path | None, fields: Mapping[str, Any]) -> CompileCache:
    """The cache directory for ``fields`` under ``root`` (None: :func:`default_cache_root`), checked (see the
    module docstring).  Does not activate it."""
    root = Path(root).expanduser() if root else default_cache_root()
    key = cache_key(fields)
    path, fallback = root / key, False
    if not _writable(path):
        tmp = Path(tempfile.mkdtemp(prefix="cosyvoice_fast-cache-"))
        log.warning("compile cache: %s cannot be written; using the temporary %s (kernels compiled now are lost "
                    "at exit; pass a writable --cache-dir to keep them)", root, tmp)
        path, fallback = tmp / key, True
        path.mkdir(parents=True, exist_ok=True)
    cache = CompileCache(root=root, key=key, path=path, fields=json.loads(json.dumps(fields, default=str)),
                         fallback=fallback)
    if not _check_key(path, cache.fields):
        cache.rebuilt.append(KEY_FILE)
    if not (path / KEY_FILE).exists():  # written once, atomically: replicas starting together read it meanwhile
        cache.write_record(KEY_FILE.removesuffix(".json"), cache.fields)
    cache.rebuilt += check_entries(cache)
    return cache


def model_dims(model_config: Any) -> dict[str, Any]:
    """The model dimensions compiled kernels specialise on, from a ``ModelConfig`` (family, LM, flow, HiFT)."""
    q = model_config.llm.qwen
    flow, hift = model_config.flow, model_config.hift
    dims: dict[str, Any] = {"family": getattr(model_config, "family", "cosyvoice2"),
                            "qwen": [q.hidden_size, q.num_hidden_layers, q.num_attention_heads,
                                     q.num_key_value_heads, q.intermediate_size],
                            "speech_tokens": model_config.llm.speech_token_size}
    for name, part in (("flow", flow), ("hift", hift)):
        dims[name] = json.loads(json.dumps(dataclasses.asdict(part) if dataclasses.is_dataclass(part)
                                           else repr(part), default=repr))
    return dims


def open_for_model(root: str | Path | None, device: Any, model_config: Any) -> CompileCache:
    """:func:`open_compile_cache` keyed by ``device`` and ``model_config``; activated (``TRITON_CACHE_DIR``)."""
    cache = open_compile_cache(root, key_fields(device, model_dims(model_config)))
    cache.activate()
    return cache
