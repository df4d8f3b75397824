"""The fused flow encoder (``kernels/encoder_fused.py``) and its relative-position attention kernel
(``kernels/encoder_attention.py``).

CPU (Triton interpreter): the attention kernel equals the eager relative-position attention module on every row
(full and chunk-causal, ragged key lengths, more than one key tile); the fused encoder equals the model's own
``encode_padded`` on right-padded rows of different lengths (a small random model, and the parity fixture's
flow); the encoder graphs capture the fused function when given it; bad inputs are refused with messages.
GPU (marked ``gpu``; full CosyVoice2 encoder sizes, seeded random weights): fp32 within 1e-4 of eager, bf16 no
worse than eager bf16 (both against fp32), and the kernel count of one call.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.config.model import DecoderConfig, EncoderConfig, FlowConfig  # noqa: E402
from cosyvoice_fast.flow.kernels.encoder_attention import relpos_attention  # noqa: E402
from cosyvoice_fast.flow.kernels.encoder_fused import FusedEncoder  # noqa: E402
from cosyvoice_fast.flow.model.flow import CausalMaskedDiffWithXvec  # noqa: E402
from cosyvoice_fast.flow.model.encoder import attention_mask  # noqa: E402
from cosyvoice_fast.flow.model.encoder_layers import RelPositionSelfAttention, relative_position_table  # noqa: E402

TOL = 1e-4


def _randomise_biases(model: torch.nn.Module, seed: int) -> None:
    """The position biases u, v start at zero; random ones make the test see both score terms."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, RelPositionSelfAttention):
            with torch.no_grad():
                m.pos_bias_u.copy_(torch.randn(m.pos_bias_u.shape, generator=g))
                m.pos_bias_v.copy_(torch.randn(m.pos_bias_v.shape, generator=g))


def _small_flow(heads: int = 4, d_model: int = 64, seed: int = 0) -> CausalMaskedDiffWithXvec:
    """A flow model whose encoder is small enough for the interpreter (the estimator is never run here)."""
    torch.manual_seed(seed)
    enc = EncoderConfig(input_size=48, output_size=d_model, attention_heads=heads, linear_units=96, num_blocks=2,
                        num_up_blocks=2, static_chunk_size=8, pre_lookahead_len=3, upsample_stride=2)
    dec = DecoderConfig(channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2)
    flow = CausalMaskedDiffWithXvec(FlowConfig(input_size=48, spk_embed_dim=16, vocab_size=40, encoder=enc,
                                               decoder=dec)).eval()
    _randomise_biases(flow, seed)
    return flow


def _padded(flow: torch.nn.Module, spec: list[tuple[int, int]], seed: int = 3):
    """``(tokens, look-ahead tokens)`` per row -> right-padded ids, full and body lengths, embeddings."""
    g = torch.Generator().manual_seed(seed)
    width = max(n for n, _ in spec) + 5
    ids = torch.randint(0, flow.cfg.vocab_size, (len(spec), width), generator=g)
    full = torch.tensor([n for n, _ in spec])
    body = torch.tensor([n - c for n, c in spec])
    emb = torch.randn(len(spec), flow.cfg.spk_embed_dim, generator=g)
    return ids, full, body, emb


def _max_valid_error(out, ref, body: torch.Tensor, stride: int) -> float:
    return max((out.mu[i, :, :stride * int(n)] - ref.mu[i, :, :stride * int(n)]).abs().max().item()
               for i, n in enumerate(body))


@pytest.mark.parametrize("batch,frames,chunk,d", [(2, 37, 0, 64), (3, 45, 8, 64), (1, 70, 25, 64), (2, 37, 8, 48)])
def test_relpos_attention_equals_the_eager_module(batch, frames, chunk, d):
    """Every row, padded queries included (they attend the valid keys, as eagerly), over 2-3 key tiles; a model
    width of 48 gives heads of 12 (padded to 16 lanes)."""
    torch.manual_seed(batch * 100 + frames)
    heads = 4
    attn = RelPositionSelfAttention(d, heads).eval()
    _randomise_biases(attn, frames)
    x = torch.randn(batch, frames, d)
    lens = torch.randint(1, frames + 1, (batch,))
    lens[0] = frames
    table = relative_position_table(frames, frames, d)
    with torch.no_grad():
        ref = attn(x, table, attention_mask(lens, frames, chunk, x.device))
        qkv = torch.cat([attn.linear_q(x), attn.linear_k(x), attn.linear_v(x)], -1).reshape(batch * frames, 3 * d)
        o = relpos_attention(qkv.contiguous(), attn.linear_pos(table)[0], attn.pos_bias_u, attn.pos_bias_v, lens,
                             batch, heads, d // heads, chunk)
        out = attn.linear_out(o).view(batch, frames, d)
    assert (out - ref).abs().max().item() <= 1e-5


def test_relpos_attention_counts_keys_in_scaled_lengths():
    """``len_scale``: lengths given in tokens cover ``len_scale`` frames each (the upsampled stage)."""
    torch.manual_seed(1)
    d, heads, frames = 32, 2, 24
    attn = RelPositionSelfAttention(d, heads).eval()
    _randomise_biases(attn, 2)
    x = torch.randn(2, frames, d)
    tokens = torch.tensor([12, 5])
    table = relative_position_table(frames, frames, d)
    with torch.no_grad():
        ref = attn(x, table, attention_mask(tokens * 2, frames, 4, x.device))
        qkv = torch.cat([attn.linear_q(x), attn.linear_k(x), attn.linear_v(x)], -1).reshape(2 * frames, 3 * d)
        o = relpos_attention(qkv.contiguous(), attn.linear_pos(table)[0], attn.pos_bias_u, attn.pos_bias_v, tokens,
                             2, heads, d // heads, 4, len_scale=2)
    assert (attn.linear_out(o).view(2, frames, d) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("streaming", [True, False])
def test_fused_encoder_equals_encode_padded(streaming):
    """Rows of different lengths and look-aheads (a final row among them), padding after every row."""
    flow = _small_flow()
    ids, full, body, emb = _padded(flow, [(30, 3), (17, 0), (9, 2)])
    with torch.no_grad():
        ref = flow.encode_padded(ids, full, body, emb, streaming=streaming)
        out = FusedEncoder(flow).encode_padded(ids, full, body, emb, streaming=streaming)
    assert out.mu.shape == ref.mu.shape and out.mu.is_contiguous()
    assert _max_valid_error(out, ref, body, 2) <= TOL
    assert torch.equal(out.spks, ref.spks)


def test_fused_encoder_equals_encode_padded_on_the_fixture(tiny_models, load_case):
    """The parity fixture's flow (its sizes, read from its files), one streamed call of prompt + new tokens."""
    flow = tiny_models.flow
    case = load_case("case_flow_stream")
    la = flow.encoder.cfg.pre_lookahead_len
    ptok = case["prompt_token"][:, :12]
    ids = torch.cat([ptok, case["token"][:, :14]], dim=1)
    full = torch.tensor([ids.shape[1]])
    body = full - la
    with torch.no_grad():
        ref = flow.encode_padded(ids, full, body, case["embedding"], streaming=True)
        out = FusedEncoder(flow).encode_padded(ids, full, body, case["embedding"], streaming=True)
    assert _max_valid_error(out, ref, body, flow.encoder.cfg.upsample_stride) <= TOL


def test_the_encoder_graphs_capture_the_function_they_are_given(fake_graphs):
    from cosyvoice_fast.flow.graph_encoder import GraphEncoder

    flow = _small_flow(seed=4)
    fused = FusedEncoder(flow)
    calls = []

    def encode(*args, **kw):
        calls.append(kw["streaming"])
        return fused.encode_padded(*args, **kw)

    enc = GraphEncoder(flow, torch.device("cpu"), buckets=(40,), rows=(1, 2), encode=encode)
    ids, full, body, emb = _padded(flow, [(25, 3), (14, 3)], seed=9)
    rows = [(ids[i:i + 1, :int(full[i])], int(body[i]), emb[i:i + 1]) for i in range(2)]
    with torch.inference_mode():
        got = enc.encode_rows(rows, streaming=True)
        ref = flow.encode_padded(ids, full, body, emb, streaming=True)
    assert calls and all(calls) and enc.replays == 1
    for i, e in enumerate(got):
        n = 2 * int(body[i])
        assert e.mu.shape[2] == n and (e.mu[0] - ref.mu[i, :, :n]).abs().max().item() <= TOL
    assert GraphEncoder(flow, torch.device("cpu"), buckets=(40,)).encode == flow.encode_padded


@pytest.mark.parametrize("streaming", [True, False])
def test_fused_encoder_takes_a_head_size_that_is_not_a_power_of_two(streaming):
    """Head size 24 (CosyVoice3's): the relative-position attention pads it to 32 masked lanes."""
    flow = _small_flow(heads=2, d_model=48, seed=2)
    ids, full, body, emb = _padded(flow, [(21, 3), (12, 0)], seed=6)
    with torch.no_grad():
        ref = flow.encode_padded(ids, full, body, emb, streaming=streaming)
        out = FusedEncoder(flow).encode_padded(ids, full, body, emb, streaming=streaming)
    assert _max_valid_error(out, ref, body, 2) <= TOL


def test_bad_attention_inputs_are_refused():
    qkv, pos = torch.zeros(20, 3 * 32), torch.zeros(19, 32)
    u, lens = torch.zeros(2, 16), torch.tensor([10, 10])
    with pytest.raises(ValueError, match=r"qkv must be contiguous \(B\*T, 96\), got \(20, 64\)"):
        relpos_attention(qkv[:, :64], pos, u, u, lens, 2, 2, 16, 0)
    with pytest.raises(ValueError, match=r"pos must be \(19, 32\) with unit column stride, got \(20, 32\)"):
        relpos_attention(qkv, torch.zeros(20, 32), u, u, lens, 2, 2, 16, 0)
    with pytest.raises(ValueError, match=r"lengths must be \(2,\) integers"):
        relpos_attention(qkv, pos, u, u, lens.float(), 2, 2, 16, 0)
    with pytest.raises(ValueError, match="21 rows do not split into 2 batch rows"):
        relpos_attention(torch.zeros(21, 96), pos, u, u, lens, 2, 2, 16, 0)


# ------------------------------------------------------------------------------------------------ GPU


def _full_size_flow(dtype: torch.dtype) -> CausalMaskedDiffWithXvec:
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec(FlowConfig()).eval()
    _randomise_biases(flow, 0)
    return flow.cuda().to(dtype)


@pytest.mark.gpu
def test_gpu_fused_encoder_full_size(no_tf32):
    """Full CosyVoice2 encoder sizes, a first chunk's 103 tokens and two shorter padded rows: fp32 within 1e-4 of
    eager; in bf16 the fused encoder is no further from eager fp32 than eager bf16 is (x1.5 slack)."""
    flow32 = _full_size_flow(torch.float32)
    ids, full, body, emb = _padded(flow32, [(103, 3), (60, 0), (41, 2)], seed=11)
    ids, full, body, emb = ids.cuda(), full.cuda(), body.cuda(), emb.cuda()
    with torch.inference_mode():
        ref = flow32.encode_padded(ids, full, body, emb, streaming=True)
        out = FusedEncoder(flow32).encode_padded(ids, full, body, emb, streaming=True)
        assert _max_valid_error(out, ref, body, 2) <= TOL
        flow16 = _full_size_flow(torch.bfloat16)
        e16 = flow16.encode_padded(ids, full, body, emb.bfloat16(), streaming=True)
        f16 = FusedEncoder(flow16).encode_padded(ids, full, body, emb.bfloat16(), streaming=True)
    eager_err = _max_valid_error(e16, ref, body, 2)
    fused_err = _max_valid_error(f16, ref, body, 2)
    assert fused_err <= 1.5 * eager_err, (fused_err, eager_err)


@pytest.mark.gpu
def test_gpu_fused_encoder_kernel_count():
    """One bf16 call at one row (after a first call: the position tables are built once per length): 5 kernels
    per Conformer block, the two position projections, the output GEMM and the embedding and resampling glue;
    eagerly more than 2.5x as many."""
    from cosyvoice_fast.bench.estimator_profile import count_kernels

    flow = _full_size_flow(torch.bfloat16)
    ids, full, body, emb = (z.cuda() for z in _padded(flow, [(103, 3)], seed=2))
    emb = emb.bfloat16()
    fused = FusedEncoder(flow)
    with torch.inference_mode():
        fused.encode_padded(ids, full, body, emb, streaming=True)
        n_fused = count_kernels(lambda: fused.encode_padded(ids, full, body, emb, streaming=True))
        n_eager = count_kernels(lambda: flow.encode_padded(ids, full, body, emb, streaming=True))
    blocks = flow.encoder.cfg.num_blocks + flow.encoder.cfg.num_up_blocks
    assert 5 * blocks + 3 < n_fused <= 5 * blocks + 60, n_fused
    assert n_eager >= 2.5 * n_fused, (n_eager, n_fused)
