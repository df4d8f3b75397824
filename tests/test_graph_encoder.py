"""The flow encoder over right-padded rows (``encode_padded``) and its graph runner (``GraphEncoder``).

CPU (fp32, tiny fixture): each padded row equals the model's own ``encode`` of that call alone, whatever the
prompt length, token count, look-ahead and attention mode; what sits in the padding never reaches a valid
frame; the runner serves mixed calls with one replay per token bucket (fake graphs stand in for CUDA graphs),
splits a call of more rows than it captured, and after ``capture_all`` never captures again.
GPU: ``python -m pytest -m gpu tests/test_graph_encoder.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cosyvoice_fast.flow.eager import flow_chunk_mel, flow_chunk_mel_batch
from cosyvoice_fast.flow.graph_encoder import GraphEncoder, token_buckets
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.schedule import plan

from test_flow_batch import TOL, _inputs


@pytest.fixture(scope="module")
def case(load_case) -> dict:
    return load_case("case_flow_stream")


@pytest.fixture(scope="module")
def flow(tiny_models):
    return tiny_models.flow


def _padded_rows(flow, case: dict, spec: list[tuple[int, int, int]]):
    """``(prompt tokens, new tokens, look-ahead)`` per row -> padded ids, full and body lengths, embeddings."""
    g = torch.Generator().manual_seed(5)
    vocab = flow.cfg.vocab_size
    width = max(p + n for p, n, _ in spec) + 9  # some padding after the longest row too
    ids = torch.zeros(len(spec), width, dtype=torch.long)
    for i, (p, n, _) in enumerate(spec):
        ids[i, :p] = case["prompt_token"][0, :p]
        ids[i, p:p + n] = torch.randint(0, vocab, (n,), generator=g)
    full = torch.tensor([p + n for p, n, _ in spec])
    body = torch.tensor([p + n - c for p, n, c in spec])
    emb = case["embedding"] + 0.05 * torch.randn(len(spec), case["embedding"].shape[1], generator=g)
    return ids, full, body, emb


SPEC = [(5, 20, 3), (12, 33, 0), (1, 7, 2), (0, 41, 3), (9, 50, 1)]


@pytest.mark.parametrize("streaming", [True, False])
def test_padded_rows_equal_their_own_encode(flow, case, streaming):
    la = flow.encoder.cfg.pre_lookahead_len
    spec = [(p, n, min(c, la)) for p, n, c in SPEC]
    ids, full, body, emb = _padded_rows(flow, case, spec)
    with torch.inference_mode():
        out = flow.encode_padded(ids, full, body, emb, streaming=streaming)
        for i, (p, n, c) in enumerate(spec):
            ptok, tok = ids[i:i + 1, :p], ids[i:i + 1, p:p + n]
            ref = flow.encode(tok, torch.tensor([n]), ptok, torch.tensor([p]), emb[i:i + 1], streaming=streaming,
                              finalize=c == 0, n_lookahead=c)
            frames = ref.mu.shape[2]
            assert frames == flow.encoder.cfg.upsample_stride * (p + n - c)
            assert (out.mu[i:i + 1, :, :frames] - ref.mu).abs().max().item() <= TOL, (i, p, n, c)
            assert torch.allclose(out.spks[i:i + 1], ref.spks, atol=1e-6)


def test_what_sits_in_the_padding_never_reaches_a_valid_frame(flow, case):
    ids, full, body, emb = _padded_rows(flow, case, SPEC)
    noisy = ids.clone()
    for i, n in enumerate(full.tolist()):
        noisy[i, n:] = torch.randint(0, flow.cfg.vocab_size, (ids.shape[1] - n,))
    stride = flow.encoder.cfg.upsample_stride
    with torch.inference_mode():
        a = flow.encode_padded(ids, full, body, emb, streaming=True).mu
        b = flow.encode_padded(noisy, full, body, emb, streaming=True).mu
        # the look-ahead context is NOT padding: changing it changes the last frames
        ctx = ids.clone()
        ctx[0, int(body[0])] = (ctx[0, int(body[0])] + 1) % flow.cfg.vocab_size
        c = flow.encode_padded(ctx, full, body, emb, streaming=True).mu
    for i, m in enumerate(body.tolist()):
        assert torch.equal(a[i, :, :stride * m], b[i, :, :stride * m]), i
    assert (a[0, :, :stride * int(body[0])] - c[0, :, :stride * int(body[0])]).abs().max().item() > 1e-3


def test_token_buckets():
    assert token_buckets((50, 100, 150, 1500), 2, 25, 999) == (25, 50, 75, 750)
    assert token_buckets(None, 2, 25, 100) == (25, 50, 75, 100)


def _calls(case: dict):
    """First and later streaming calls of voices with different prompt lengths, and two final calls."""
    out = []
    for i, (n_prompt, k) in enumerate([(8, 0), (14, 1), (20, 0), (11, 1), (17, -1), (9, -1)]):
        calls = plan(n_prompt, case["token"].shape[1], StreamParams())
        call = calls[min(k, len(calls) - 2)] if k >= 0 else calls[k]  # streaming calls, then final ones
        out.append((None, _inputs(case, n_prompt, i), case["token"][:, :call.n_tokens], call))
    return out


def test_mixed_calls_share_one_replay_per_bucket_and_equal_their_solo_chunks(flow, case, fake_graphs):
    items = _calls(case)
    enc = GraphEncoder(flow, torch.device("cpu"), buckets=(50, 100, 150, 200, 300), rows=(1, 2, 4))
    ref = [flow_chunk_mel(flow, inp, tok, call) for _, inp, tok, call in items]
    out = flow_chunk_mel_batch(flow, items, encode=enc)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL
    # one replay per (attention mode, token bucket) group of calls, split at 4 rows
    groups: dict[tuple[bool, int], int] = {}
    for _, inp, tok, call in items:
        key = (not call.finalize, enc.bucket(inp.flow_prompt_speech_token.shape[1] + tok.shape[1]))
        groups[key] = groups.get(key, 0) + 1
    assert enc.replays == sum(-(-n // 4) for n in groups.values()) < len(items)
    assert enc.eager_calls == 0 and enc.batched_calls >= 1
    keys = {k for c in enc.caches.values() for k in c.graphs}
    assert all(k[0] in enc.buckets and k[1] in (1, 2, 4) for k in keys)


def test_capture_all_then_nothing_more_is_captured(flow, case, fake_graphs):
    enc = GraphEncoder(flow, torch.device("cpu"), buckets=(50, 100), rows=(1, 2))
    n = enc.capture_all(torch.float32, progress=False)
    assert n == enc.captures == len(enc.jobs()) == 2 * 2 * 2  # 25 / 50 tokens x 1 / 2 rows x 2 modes
    items = _calls(case)
    ref = [flow_chunk_mel(flow, inp, tok, call) for _, inp, tok, call in items]
    out = flow_chunk_mel_batch(flow, items, encode=enc)
    assert enc.captures == n  # frozen: calls longer than 50 tokens ran the eager encoder instead
    longer = sum(inp.flow_prompt_speech_token.shape[1] + tok.shape[1] > 50 for _, inp, tok, _ in items)
    assert longer > 0 and enc.eager_calls == longer
    for a, b in zip(out, ref):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL


def test_encode_signature_serves_rows_of_one_shape(flow, case, fake_graphs):
    """The ``flow.encode`` signature (single calls, the incremental runner's re-encoding) goes the padded way."""
    enc = GraphEncoder(flow, torch.device("cpu"), buckets=(100, 200), rows=(1, 2, 4))
    ptok = case["prompt_token"][:, :14].repeat(3, 1)
    tok = case["token"][:, :30].repeat(3, 1)
    g = torch.Generator().manual_seed(1)
    emb = case["embedding"] + 0.05 * torch.randn(3, case["embedding"].shape[1], generator=g)
    kw = dict(streaming=True, finalize=False, n_lookahead=2)
    args = (tok, torch.full((3,), 30), ptok, torch.full((3,), 14), emb)
    with torch.inference_mode():
        got = enc(*args, **kw)
        ref = flow.encode(*args, **kw)
    assert got.mu.shape == ref.mu.shape and (got.mu - ref.mu).abs().max().item() <= TOL
    assert enc.replays == 1 and enc.batched_calls == 1


def test_a_replay_is_staged_as_prompt_ids_then_folded_host_ids_then_lengths(flow, case, fake_graphs):
    """A chunk call's graph input row: the prompt's ids (copied on the device), the chunk's token ids from the
    host folded into the flow's vocabulary, zeros up to the bucket, then the row's length and body length; the
    speaker embedding in its own input.  Its encoding equals the model's own ``encode`` of the call."""
    enc = GraphEncoder(flow, torch.device("cpu"), buckets=(200,), rows=(1,))  # frames: a 100-token bucket
    _, inp, tok, call = _calls(case)[0]
    vocab = flow.cfg.vocab_size
    tok = tok.clone()
    tok[0, :2] += vocab  # ids past the flow's table (the tiny fixture's smaller flow vocabulary): folded
    p, n = inp.flow_prompt_speech_token.shape[1], tok.shape[1]
    with torch.inference_mode():
        (got,) = enc.encode_calls([(inp, tok, call)], not call.finalize)
    ((key, g),) = enc.caches[not call.finalize].graphs.items()
    stage, emb = g.inputs
    assert key == (100, 1, inp.embedding.dtype) and stage.shape == (1, 102)
    want = torch.cat((inp.flow_prompt_speech_token[0].long(), torch.remainder(tok[0].long(), vocab),
                      torch.zeros(100 - p - n, dtype=torch.long),
                      torch.tensor([p + n, p + n - (0 if call.finalize else call.lookahead)])))
    assert torch.equal(stage[0], want) and torch.equal(emb, inp.embedding)
    ptok = inp.flow_prompt_speech_token
    with torch.inference_mode():
        ref = flow.encode(torch.remainder(tok, vocab), torch.tensor([n]), ptok, torch.tensor([p]), inp.embedding,
                          streaming=not call.finalize, finalize=call.finalize, n_lookahead=call.lookahead)
    assert got.mu.shape == ref.mu.shape and (got.mu - ref.mu).abs().max().item() <= TOL


def test_too_much_look_ahead_is_refused_with_a_message(flow, case, fake_graphs):
    enc = GraphEncoder(flow, torch.device("cpu"), buckets=(100,))
    _, inp, tok, call = _calls(case)[0]
    la = flow.encoder.cfg.pre_lookahead_len
    bad = dataclasses.replace(call, lookahead=la + 1)
    with pytest.raises(ValueError, match=f"{la + 1} look-ahead tokens asked, the flow model uses at most {la}"):
        enc.encode_calls([(inp, tok, bad)], True)


@pytest.mark.gpu
def test_gpu_graph_encoder_equals_eager_encode_fp32(flow, case, no_tf32):
    import copy

    fl = copy.deepcopy(flow).cuda().eval()
    items = [(None, _inputs(case, inp.flow_prompt_speech_token.shape[1], i, "cuda"), tok, call)
             for i, (_, inp, tok, call) in enumerate(_calls(case))]
    enc = GraphEncoder(fl, torch.device("cuda"), buckets=(50, 100, 150, 200, 300), rows=(1, 2, 4))
    captured = enc.capture_all(torch.float32, progress=False)
    ref = [flow_chunk_mel(fl, inp, tok, call) for _, inp, tok, call in items]
    for _ in range(2):
        out = flow_chunk_mel_batch(fl, items, encode=enc)
        for a, b in zip(out, ref):
            assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4
    assert enc.captures == captured and enc.eager_calls == 0 and enc.batched_calls >= 2
