"""The persistent compile cache: keyed directories, corrupt entries rebuilt, a read-only root falls back."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cosyvoice_fast.kernels import compile_cache as cc
from cosyvoice_fast.kernels.compile_cache import (
    TRITON_ENV, cache_key, default_cache_root, key_fields, model_dims, open_compile_cache,
)

FIELDS = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.65", "cuda": "13.0", "torch": "2.11.0", "triton": "3.6.0",
          "model": {"family": "cosyvoice2", "qwen": [896, 24, 14, 2, 4864]}}


def _entry(root: Path, name: str, files: dict[str, bytes], group: dict[str, str] | None = None) -> Path:
    """A Triton cache entry: its files and a group file naming them (absolute paths, as Triton writes them)."""
    d = root / name
    d.mkdir(parents=True)
    for f, data in files.items():
        (d / f).write_bytes(data)
    children = {f: str(d / f) for f in files} if group is None else group
    (d / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
    return d


def test_the_key_changes_with_every_field_and_names_the_gpu():
    base = cache_key(FIELDS)
    assert base.startswith("nvidia-h100-80gb-hbm3-") and len(base.rsplit("-", 1)[1]) == 16
    assert cache_key(dict(FIELDS)) == base  # stable
    for name, value in (("gpu", "NVIDIA H200"), ("driver", "575.1"), ("cuda", "12.8"), ("torch", "2.12.0"),
                        ("triton", "3.7.0"), ("model", {"family": "cosyvoice2", "qwen": [896, 24, 14, 2, 4865]})):
        assert cache_key({**FIELDS, name: value}) != base, name


def test_a_changed_key_uses_another_directory_and_the_same_key_reuses_it(tmp_path):
    a = open_compile_cache(tmp_path, FIELDS)
    (a.triton_dir).mkdir()
    _entry(a.triton_dir, "k1", {"kernel.cubin": b"\x7fELF"})
    again = open_compile_cache(tmp_path, FIELDS)
    assert again.path == a.path == tmp_path / a.key and again.entries() == 1 and again.rebuilt == []
    other = open_compile_cache(tmp_path, {**FIELDS, "driver": "575.1"})
    assert other.path != a.path and other.path.parent == tmp_path and other.entries() == 0
    assert json.loads((other.path / "key.json").read_text())["driver"] == "575.1"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.key, other.key])


def test_corrupt_kernel_entries_are_removed_with_one_warning_and_good_ones_kept(tmp_path, caplog):
    first = open_compile_cache(tmp_path, FIELDS)
    t = first.triton_dir
    t.mkdir()
    good = _entry(t, "good", {"k.cubin": b"\x7fELF", "k.json": b"{}"})
    _entry(t, "emptied", {"k.cubin": b"", "k.json": b"{}"})
    _entry(t, "dangling", {"k.json": b"{}"}, group={"k.cubin": str(t / "dangling" / "k.cubin")})
    bad_group = _entry(t, "badgroup", {"k.cubin": b"\x7fELF"})
    (bad_group / "__grp__k.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=cc.__name__):
        again = open_compile_cache(tmp_path, FIELDS)
    assert sorted(again.rebuilt) == ["badgroup", "dangling", "emptied"]
    assert sorted(p.name for p in t.iterdir()) == ["good"] and good.is_dir() and again.entries() == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("compile cache: 3 corrupt kernel entries removed, rebuilt on first use (")
    assert "empty file k.cubin" in warnings[0] and "unreadable group file __grp__k.json" in warnings[0]


def test_a_corrupt_key_file_empties_the_directory_with_a_warning(tmp_path, caplog):
    first = open_compile_cache(tmp_path, FIELDS)
    first.triton_dir.mkdir()
    _entry(first.triton_dir, "k1", {"kernel.cubin": b"\x7fELF"})
    (first.path / "key.json").write_text('{"gpu": "trunc')
    with caplog.at_level(logging.WARNING, logger=cc.__name__):
        again = open_compile_cache(tmp_path, FIELDS)
    assert again.rebuilt == ["key.json"] and again.entries() == 0
    assert json.loads((again.path / "key.json").read_text()) == FIELDS
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and msgs[0].startswith(f"compile cache: {again.path / 'key.json'} is corrupt: unreadable")


def test_a_root_that_cannot_be_written_falls_back_to_a_temporary_dir_with_one_log_line(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache root should be")
    root = blocker / "cache"
    with caplog.at_level(logging.DEBUG, logger=cc.__name__):
        cache = open_compile_cache(root, FIELDS)
    assert cache.fallback and cache.root == root and cache.path.name == cache.key
    assert not str(cache.path).startswith(str(tmp_path)) and cache.path.is_dir()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"compile cache: {root} cannot be written; using the temporary ")
    assert (cache.path / "key.json").exists()


def test_activate_points_triton_at_the_keyed_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(TRITON_ENV, raising=False)
    cache = open_compile_cache(tmp_path, FIELDS)
    cache.activate()
    import os

    assert os.environ[TRITON_ENV] == str(tmp_path / cache.key / "triton") and cache.triton_dir.is_dir()
    import triton.knobs

    assert triton.knobs.cache.dir == str(cache.triton_dir)  # what Triton reads when a kernel compiles


def test_the_default_root_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "cosyvoice_fast"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "cosyvoice_fast"
    cache = open_compile_cache(None, FIELDS)
    assert cache.path == tmp_path / "home" / ".cache" / "cosyvoice_fast" / cache.key


def test_records_round_trip_and_a_corrupt_one_is_dropped_with_a_warning(tmp_path, caplog):
    cache = open_compile_cache(tmp_path, FIELDS)
    assert cache.read_record("startup") is None
    cache.write_record("startup", {"total_s": 41.5})
    assert cache.read_record("startup") == {"total_s": 41.5}
    (cache.path / "startup.json").write_text("[1, 2")
    with caplog.at_level(logging.WARNING, logger=cc.__name__):
        assert cache.read_record("startup") is None
    assert not (cache.path / "startup.json").exists()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"compile cache: record {cache.path / 'startup.json'} is corrupt"]


def test_key_fields_of_a_model_hold_its_dims_and_the_library_versions(tiny_models):
    import torch
    import triton

    fields = key_fields("cpu", model_dims(tiny_models.config))
    assert fields["gpu"] == "cpu" and fields["torch"] == torch.__version__ and fields["triton"] == triton.__version__
    q = tiny_models.config.llm.qwen
    assert fields["model"]["qwen"] == [q.hidden_size, q.num_hidden_layers, q.num_attention_heads,
                                       q.num_key_value_heads, q.intermediate_size]
    assert fields["model"]["hift"]["base_channels"] == tiny_models.config.hift.base_channels
    assert cache_key(fields) == cache_key(json.loads(json.dumps(fields)))


@pytest.mark.parametrize("bad", ["", "x"])
def test_an_entry_with_a_group_naming_no_files_is_corrupt(tmp_path, bad):
    d = tmp_path / "e"
    d.mkdir()
    (d / "__grp__k.json").write_text(json.dumps({"child_paths": bad}) if bad else json.dumps({}))
    assert cc._entry_problem(d) == "group file __grp__k.json names no files"
