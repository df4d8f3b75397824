"""Weights load with one copy: modules built without their random init, checkpoints memory-mapped, their tensors
assigned as the parameters.  The loaded networks must be exactly what the old build-init-copy path gave: every
parameter equal to the file's, tied weights still tied, the constructor-computed buffers untouched, dtypes the
module's own."""

from __future__ import annotations

import threading

import torch

from cosyvoice_fast.modeldir.files import (
    SkipInit, _shared_parameters, build_modules, load_models, load_state_dict_file, load_strict, read_config,
    validate_model_dir,
)


def _reference(fixture_dir):  # noqa: ANN001 - the old path: a normally built module, weights copied in
    files = validate_model_dir(fixture_dir)
    mods = build_modules(read_config(files))
    from cosyvoice_fast.vocoder.model.weightnorm import convert_legacy_weight_norm

    for name, m, fix in zip(("llm.pt", "flow.pt", "hift.pt"), mods, (None, None, convert_legacy_weight_norm)):
        sd = load_state_dict_file(files.path(name))
        m.load_state_dict(fix(sd) if fix else sd, strict=True)
    return mods


def test_loaded_networks_equal_the_copy_path_exactly_tied_weights_included(fixture_dir):
    loaded = load_models(fixture_dir, progress=False)
    for ref, got in zip(_reference(fixture_dir), (loaded.llm, loaded.flow, loaded.hift)):
        want = dict(ref.named_parameters(remove_duplicate=False)) | dict(ref.named_buffers(remove_duplicate=False))
        have = dict(got.named_parameters(remove_duplicate=False)) | dict(got.named_buffers(remove_duplicate=False))
        assert want.keys() == have.keys()
        for k in want:  # non-persistent buffers too (rotary frequencies, the fixed CFM noise, the STFT window)
            assert have[k].dtype == want[k].dtype and torch.equal(have[k], want[k]), k
        ties = _shared_parameters(ref)
        assert [(a, b) for a, b in _shared_parameters(got)] == ties
        for first, others in ties:
            assert all(got.get_parameter(o) is got.get_parameter(first) for o in others)
        assert not any(p.requires_grad for p in got.parameters())
    assert _shared_parameters(loaded.llm), "the fixture's LM ties its embeddings: the tie must survive loading"


def test_a_half_precision_checkpoint_loads_into_the_modules_own_dtype(fixture_dir):
    ref = _reference(fixture_dir)[2]  # HiFT: kept in fp32 whatever the file holds
    files = validate_model_dir(fixture_dir)
    with SkipInit():
        hift = build_modules(read_config(files))[2]
    sd = {k: v.half() if v.is_floating_point() else v for k, v in ref.state_dict().items()}
    load_strict(hift, sd, "hift.pt", "", assign=True)
    for k, v in hift.state_dict().items():
        assert v.dtype == ref.state_dict()[k].dtype
        assert torch.equal(v, sd[k].to(v.dtype)), k


def test_skip_init_acts_on_its_own_thread_only():
    def linear() -> torch.Tensor:
        g = torch.random.fork_rng(devices=[])
        with g:
            torch.manual_seed(7)
            return torch.nn.Linear(8, 8).weight.detach().clone()

    want = linear()
    other: list[torch.Tensor] = []
    inside = threading.Event()
    leave = threading.Event()

    def build_inside() -> None:
        with SkipInit():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=build_inside)
    t.start()
    assert inside.wait(10)
    other.append(linear())  # built on this thread while another holds SkipInit: initialised as always
    leave.set()
    t.join(10)
    assert torch.equal(other[0], want)
    # inside it no init runs: building a layer draws nothing from the random generator
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        with SkipInit():
            torch.nn.Linear(8, 8)
            torch.nn.Embedding(10, 8)
        after = torch.rand(4)
        torch.manual_seed(7)
        assert torch.equal(after, torch.rand(4))
        torch.manual_seed(7)
        torch.nn.Linear(8, 8)
        assert not torch.equal(after, torch.rand(4))  # (a normal build does draw)
