"""The fused Qwen2 decode kernels against the eager PyTorch math, at tiny sizes.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set here before they are imported),
which is slow: shapes are tiny and each test compares one kernel or a couple of steps.  Inputs are fresh random
numbers; outputs and unread cache positions start as NaN, so a value the kernel failed to write, or a cache
position it read that it should not have, shows up.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cosyvoice_fast.config.model import QwenConfig  # noqa: E402
from cosyvoice_fast.llm.kernels import qwen2_attention as attn_k  # noqa: E402
from cosyvoice_fast.llm.kernels import qwen2_gemv as gemv_k  # noqa: E402
from cosyvoice_fast.llm.kernels import qwen2_head as head_k  # noqa: E402
from cosyvoice_fast.llm.kernels import qwen2_proj as proj_k  # noqa: E402
from cosyvoice_fast.llm.kernels.qwen2_decode import FusedDecoder, decode_step, kernels_per_step, step_logits  # noqa: E402
from cosyvoice_fast.llm.model.kv_cache import KVCache  # noqa: E402
from cosyvoice_fast.llm.model.qwen2 import Qwen2Decoder  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5
_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
CFG = QwenConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=50)


def _decoder(seed: int) -> Qwen2Decoder:
    """A tiny decoder with every parameter random (norm weights and biases too, so a skipped term shows)."""
    torch.manual_seed(seed)
    dec = Qwen2Decoder(CFG).to(DEV).eval().requires_grad_(False)
    for p in dec.parameters():
        p.normal_(0.0, 0.3).add_(1.0 if p.dim() == 1 else 0.0)
    return dec


def _nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEV)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's scale (fp32 rounding grows with the magnitude)."""
    return (a.float() - b.float()).abs().max().item() / max(1.0, b.abs().max().item())


def _positions(rows: int, max_len: int) -> torch.Tensor:
    return torch.randperm(max_len, device=DEV)[:rows].sort().values


@torch.inference_mode()
@pytest.mark.parametrize("kernels,rows", [(proj_k, 3), (gemv_k, 1)])
def test_qkv_rope_writes_q_and_the_cache_at_each_rows_position(kernels, rows):
    dec = _decoder(1).fuse_projections()
    layer, max_len = dec.layers[0], 24
    a = layer.self_attn
    x = torch.randn(rows, CFG.hidden_size, device=DEV)
    pos = _positions(rows, max_len)
    cache = KVCache.for_config(CFG, max_len, rows, device=DEV)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    q = _nan(rows, CFG.num_attention_heads, CFG.head_dim)
    kernels.qkv_rope(x, layer.input_layernorm.weight, a.qkv_weight, a.qkv_bias, dec.rotary.inv_freq, pos, q,
                     cache.k[0], cache.v[0], layer.input_layernorm.eps, a.n_heads, a.n_kv, a.head_dim)
    cos, sin = dec.rotary.rows(pos[:, None], x.dtype)
    q_ref, k_ref, v_ref = a._qkv(layer.input_layernorm(x[:, None]), cos, sin)
    assert _err(q, q_ref[:, :, 0]) <= TOL
    for b in range(rows):
        assert _err(cache.k[0][b, :, pos[b]], k_ref[b, :, 0]) <= TOL
        assert _err(cache.v[0][b, :, pos[b]], v_ref[b, :, 0]) <= TOL
    written = rows * 2 * CFG.num_key_value_heads * CFG.head_dim  # k and v of one position per row
    assert int((~cache.k[0].isnan()).sum() + (~cache.v[0].isnan()).sum()) == written
    assert cache.k[1].isnan().all() and cache.v[1].isnan().all()  # another layer's buffers untouched


def _attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: list[int]) -> torch.Tensor:
    """(B, Hq*D) softmax attention of each row over its first ``n_keys[b]`` cached positions (GQA)."""
    rep = q.shape[1] // k.shape[1]
    out = []
    for b, n in enumerate(n_keys):
        kb = k[b, :, :n].repeat_interleave(rep, dim=0)
        vb = v[b, :, :n].repeat_interleave(rep, dim=0)
        w = (q[b, :, None] @ kb.transpose(1, 2) * q.shape[-1] ** -0.5).softmax(-1)
        out.append((w @ vb).reshape(-1))
    return torch.stack(out)


@torch.inference_mode()
# (1, 16): one split walks two 16-key tiles, the row's own newest key in the second (the first is read before
# the kernel's PDL wait, without that key)
@pytest.mark.parametrize("splits,keys", [(1, 32), (4, 32), (1, 16)])
def test_split_attention_merges_to_softmax_attention(splits, keys):
    tiles = proj_k.Tiles(attn_keys=keys)
    rows, max_len, kv_len = 3, 40, 32
    hq, hkv, d = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
    # row 0 early, row 1 mid-way, row 2 an idle row parked past kv_len (attends over the first kv_len keys)
    pos = torch.tensor([int(torch.randint(0, 4, ())), int(torch.randint(10, 30, ())), max_len - 1], device=DEV)
    n_keys = [min(int(p) + 1, kv_len) for p in pos]
    k = torch.randn(rows, hkv, max_len, d, device=DEV)
    v = torch.randn(rows, hkv, max_len, d, device=DEV)
    for b, n in enumerate(n_keys):  # what the kernel must never read
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    q = torch.randn(rows, hq, d, device=DEV)
    out = _nan(rows, hq, d)
    o_part, m_part, l_part = _nan(rows, hq, splits, d), _nan(rows, hq, splits), _nan(rows, hq, splits)
    counters = torch.zeros(rows, hkv, dtype=torch.int32, device=DEV)
    ref = _attention_ref(q, k, v, n_keys)
    for _ in range(2):  # the counters are back at zero, so the same scratch serves the next layer
        attn_k.decode_attention(q, k, v, pos, kv_len, out, o_part, m_part, l_part, counters, tiles)
        assert _err(out.reshape(rows, -1), ref) <= TOL
        assert counters.eq(0).all()
        out.fill_(float("nan"))


@torch.inference_mode()
@pytest.mark.parametrize("split", [1, 3])
def test_projection_adds_into_the_residual_whole_or_from_k_split_partials(split):
    rows, k_dim, n = 5, 80, 48  # K not a multiple of the K tile or of the split
    a = torch.randn(rows, k_dim, device=DEV)
    w = torch.randn(n, k_dim, device=DEV)
    resid = torch.randn(rows, n, device=DEV)
    ref = resid + a @ w.t()
    parts = _nan(split, rows, n) if split > 1 else None
    counters = torch.zeros(n // 16, dtype=torch.int32, device=DEV)
    proj_k.proj_residual(a, w, resid, parts, counters)
    assert _err(resid, ref) <= TOL
    assert counters.eq(0).all()  # the last split reset its tile's counter for the next layer
    sums = _nan(n // 16, rows)  # and each column block's sums of squares of the finished residual
    proj_k.proj_residual(a, w, resid, parts, counters, sums=sums)  # so the same scratch serves again
    assert _err(resid, ref + a @ w.t()) <= TOL
    assert _err(sums, resid.view(rows, n // 16, 16).square().sum(-1).t()) <= TOL
    with pytest.raises(ValueError, match=r"proj_residual: a 3-way K split needs float32 parts \(3, 5, 48\) and 3 "
                                         r"counters, got \(3, 4, 48\) torch.float32 and 3"):
        proj_k.proj_residual(a, w, resid, _nan(3, 4, n), counters)
    with pytest.raises(ValueError, match=r"proj_residual: sums of squares need a float32 \(3, 5\) buffer, got "
                                         r"\(5, 3\) torch.float32"):
        proj_k.proj_residual(a, w, resid, parts, counters, sums=_nan(rows, 3))


def _mlp_through(kernels, layer, rows: int, tiles: proj_k.Tiles = proj_k.TILES) -> tuple[torch.Tensor, ...]:
    """``kernels``' gate/up and down projection (+ residual) over ``rows`` random rows, checked against the
    layer's modules; returns (h, its reference, the residual after the kernel, its reference)."""
    x = torch.randn(rows, CFG.hidden_size, device=DEV)
    h = _nan(rows, CFG.intermediate_size)
    kernels.gate_up(x, layer.post_attention_layernorm.weight, layer.mlp.gate_up_weight, h,
                    layer.post_attention_layernorm.eps, tiles=tiles)
    xn = layer.post_attention_layernorm(x)
    h_ref = F.silu(layer.mlp.gate_proj(xn)) * layer.mlp.up_proj(xn)
    assert _err(h, h_ref) <= TOL
    resid = torch.randn(rows, CFG.hidden_size, device=DEV)
    ref = resid + layer.mlp.down_proj(h_ref)
    kernels.proj_residual(h, layer.mlp.down_proj.weight, resid, tiles=tiles)  # all of K in one piece
    assert _err(resid, ref) <= TOL
    return h, h_ref, resid, ref


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_projections_equal_the_math_with_and_without_k_pieces(rows):
    dec = _decoder(6).fuse_projections()
    layer = dec.layers[0]
    h, h_ref, resid, ref = _mlp_through(gemv_k, layer, rows, proj_k.Tiles(gemv_rows=4))
    tiles = proj_k.Tiles(down_chunk=32, gemv_rows=4)
    split = gemv_k.split_count(CFG.intermediate_size, tiles)
    assert split == 3  # 96 = 3 pieces of 32
    parts, counters = _nan(split, rows, CFG.hidden_size), torch.zeros(CFG.hidden_size, dtype=torch.int32, device=DEV)
    gemv_k.proj_residual(h, layer.mlp.down_proj.weight, resid, parts, counters, tiles=tiles)
    assert _err(resid, ref + layer.mlp.down_proj(h_ref)) <= TOL
    assert counters.eq(0).all()
    with pytest.raises(ValueError, match=r"the GEMV decode kernels take 1 to 4 rows \(Tiles.gemv_rows\), got 5; "
                                         "steps of more rows use"):
        gemv_k.gate_up(torch.randn(5, CFG.hidden_size, device=DEV), layer.post_attention_layernorm.weight,
                       layer.mlp.gate_up_weight, _nan(5, CFG.intermediate_size), 1e-6, tiles=tiles)


@torch.inference_mode()
# 64 fp32 columns of K in 16-column tiles: 2 splits of 32, or 3 of which the last is empty (it adds zeros);
# 3 rows, or 67 (two row blocks, so the split counters are per column block and row block)
@pytest.mark.parametrize("split,rows", [(2, 3), (3, 3), (2, proj_k.MAX_ROW_BLOCK + 3)])
def test_looped_qkv_split_over_k_and_gate_up_equal_the_math(split, rows):
    tiles = proj_k.Tiles(k_bytes=64)
    dec = _decoder(8).fuse_projections()
    layer, max_len = dec.layers[1], 80
    a = layer.self_attn
    x = torch.randn(rows, CFG.hidden_size, device=DEV)
    pos = torch.arange(rows, device=DEV)
    cache = KVCache.for_config(CFG, max_len, rows, device=DEV)
    q = _nan(rows, CFG.num_attention_heads, CFG.head_dim)
    n_qkv = a.qkv_weight.shape[0]
    counters = torch.zeros(proj_k.qkv_tiles(rows, a.n_heads, a.n_kv, a.head_dim, tiles), dtype=torch.int32,
                           device=DEV)
    proj_k.qkv_rope(x, layer.input_layernorm.weight, a.qkv_weight, a.qkv_bias, dec.rotary.inv_freq, pos, q,
                    cache.k[1], cache.v[1], layer.input_layernorm.eps, a.n_heads, a.n_kv, a.head_dim,
                    _nan(split, rows, n_qkv), counters, tiles=tiles)
    cos, sin = dec.rotary.rows(pos[:, None], x.dtype)
    q_ref, k_ref, v_ref = a._qkv(layer.input_layernorm(x[:, None]), cos, sin)
    assert _err(q, q_ref[:, :, 0]) <= TOL
    assert _err(cache.k[1][torch.arange(rows), :, pos], k_ref[:, :, 0]) <= TOL
    assert _err(cache.v[1][torch.arange(rows), :, pos], v_ref[:, :, 0]) <= TOL
    assert counters.eq(0).all()  # put back for the next layer
    with pytest.raises(ValueError, match=rf"qkv_rope: a {split}-way K split needs float32 parts \({split}, {rows}, "
                                         rf"{n_qkv}\) and {counters.numel()} counters, got \({split}, {rows}, 1\) "
                                         rf"torch.float32 and 1"):
        proj_k.qkv_rope(x, layer.input_layernorm.weight, a.qkv_weight, a.qkv_bias, dec.rotary.inv_freq, pos, q,
                        cache.k[1], cache.v[1], layer.input_layernorm.eps, a.n_heads, a.n_kv, a.head_dim,
                        _nan(split, rows, 1), counters[:1], tiles=tiles)
    n = CFG.intermediate_size
    h = _nan(rows, n)
    proj_k.gate_up(x, layer.post_attention_layernorm.weight, layer.mlp.gate_up_weight, h,
                   layer.post_attention_layernorm.eps, tiles=tiles)
    xn = layer.post_attention_layernorm(x)
    assert _err(h, F.silu(layer.mlp.gate_proj(xn)) * layer.mlp.up_proj(xn)) <= TOL
    with pytest.raises(ValueError, match=rf"norm sums: a float32 \(tiles, {rows}\) buffer expected, got "
                                         rf"\(4, {rows + 1}\) torch.float32"):
        proj_k.gate_up(x, layer.post_attention_layernorm.weight, layer.mlp.gate_up_weight, h,
                       layer.post_attention_layernorm.eps, sums=_nan(4, rows + 1), tiles=tiles)


@torch.inference_mode()
def test_gate_up_silu_and_projection_over_more_than_one_row_block():
    dec = _decoder(2).fuse_projections()
    _mlp_through(proj_k, dec.layers[1], proj_k.MAX_ROW_BLOCK + 3)  # two row blocks: the second mostly masked


@torch.inference_mode()
def test_final_rmsnorm_matches_the_module():
    dec = _decoder(3)
    x = torch.randn(5, CFG.hidden_size, device=DEV) * 3
    out = _nan(5, CFG.hidden_size)
    head_k.rmsnorm(x, dec.norm.weight, out, dec.norm.eps)
    assert _err(out, dec.norm(x)) <= TOL


@torch.inference_mode()
# the 3-row steps looped (the 1-row step GEMV), or GEMV for all three rows (a 4-row block with one padding
# row) with one q/k/v and o-projection column per program
# ... or all three rows on cuBLAS GEMMs with the Triton glue (cublas_rows=2, .qwen2_hybrid.decode_rows)
# ... or looped with q/k/v split over K (its counters after the down projection's) in smaller K tiles
@pytest.mark.parametrize("small,gemv_rows,cublas_rows,extra", [
    (4, 1, 0, {}), (1, 4, 0, {}), (4, 1, 2, {}), (4, 1, 0, {"qkv_split": 2, "k_bytes": 64})])
def test_decode_steps_equal_the_decoder_per_row_and_shared_positions(small, gemv_rows, cublas_rows, extra):
    tiles = proj_k.Tiles(down_split=2, down_chunk=64, gemv_small_cols=small, gemv_rows=gemv_rows,
                         cublas_rows=cublas_rows, **extra)
    dec = _decoder(4)
    rows, max_len = 3, 24
    caches = [KVCache.for_config(CFG, max_len, rows, device=DEV) for _ in range(2)]
    for ref_t, fused_t in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        fused_t.copy_(ref_t.normal_())
    pos = torch.tensor([[3], [11], [max_len - 1]], device=DEV)  # the last row idles past the kv bucket
    for _ in range(2):
        x = torch.randn(rows, 1, CFG.hidden_size, device=DEV)
        ref = dec(x, pos, caches[0], kv_len=16)
        got = decode_step(dec, x, pos, caches[1], kv_len=16, splits=2, tiles=tiles)  # few splits: the interpreter is slow
        assert got.shape == ref.shape and _err(got, ref) <= 1e-4
        pos = pos + torch.tensor([[1], [1], [0]], device=DEV)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert _err(a, b) <= 1e-5
    one = [c.row(1) for c in caches]  # a batch-1 view with a shared (1,) position, as per-slot graphs call it
    x = torch.randn(1, 1, CFG.hidden_size, device=DEV)
    p = torch.tensor([13], device=DEV)
    assert _err(FusedDecoder(dec, splits=2, tiles=tiles)(x, p, one[1], kv_len=16), dec(x, p, one[0], kv_len=16)) \
        <= 1e-4


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_step_logits_equal_embedding_step_and_head(rows):
    """A step from token ids to logits (the gather: one kernel for 1-2 rows, torch ops for 3; the layers; one
    norm-and-head kernel: the GEMV head for 1-2 rows, the looped one for 3) equals the embedding, the decoder
    and the head as modules, in fp32; K/V land in the cache.  cuBLAS steps and heads without a bias return
    None."""
    tiles = proj_k.Tiles(down_chunk=64, head=16)  # 29 logits: a partial column block
    dec = _decoder(5)
    torch.manual_seed(6)
    table = torch.randn(37, CFG.hidden_size, device=DEV)
    head = torch.nn.Linear(CFG.hidden_size, 29).to(DEV)
    max_len = 16
    caches = [KVCache.for_config(CFG, max_len, rows, device=DEV) for _ in range(2)]
    for ref_t, fused_t in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        fused_t.copy_(ref_t.normal_())
    tokens = torch.tensor([[36], [4], [17]], device=DEV)[:rows]
    pos = torch.tensor([[5], [9], [2]], device=DEV)[:rows]
    want = head(dec(table[tokens[:, 0]][:, None], pos, caches[0], kv_len=12)[:, -1])
    got = step_logits(dec, table, head, tokens, pos, caches[1], kv_len=12, splits=2, tiles=tiles)
    assert got.dtype == torch.float32 and got.shape == (rows, 29) and _err(got, want) <= 1e-4
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert _err(a, b) <= 1e-5
    assert step_logits(dec, table, head, tokens, pos, caches[1], tiles=proj_k.Tiles(cublas_rows=rows)) is None
    assert step_logits(dec, table, torch.nn.Linear(CFG.hidden_size, 29, bias=False).to(DEV), tokens, pos,
                       caches[1]) is None


@torch.inference_mode()
def test_looped_head_equals_the_gemv_head_over_row_blocks():
    """The looped steps' head over 70 rows (two 64-row blocks, the second mostly padding) gives the GEMV head's
    values row by row, in fp32: the same norm, bias and rounding, only the summation order differs."""
    tiles = proj_k.Tiles(head=16)
    dec = _decoder(9)
    torch.manual_seed(10)
    x = torch.randn(70, CFG.hidden_size, device=DEV) * 2
    lin = torch.nn.Linear(CFG.hidden_size, 21).to(DEV)
    got, want = _nan(70, 21), _nan(70, 21)
    head_k.head(x, dec.norm.weight, lin.weight, lin.bias, got, dec.norm.eps, tiles=tiles)
    for r in range(0, 70, 2):
        gemv_k.head(x[r:r + 2], dec.norm.weight, lin.weight, lin.bias, want[r:r + 2], dec.norm.eps, tiles=tiles)
    assert _err(got, want) <= TOL and _err(got, lin(dec.norm(x))) <= TOL
    with pytest.raises(ValueError, match=r"head: weight \(21, 64\), bias \(21,\) and a \(70, 21\) float32"):
        head_k.head(x, dec.norm.weight, lin.weight, lin.bias, got.double(), dec.norm.eps)


@torch.inference_mode()
def test_embed_gathers_fp32_rows_and_zeroes_every_counter():
    """The step's first kernel writes each row's embedding (bf16 table) as fp32 and zeroes every counter, from
    program 0 only; bad shapes are refused with the expected form."""
    torch.manual_seed(7)
    table = torch.randn(11, CFG.hidden_size, device=DEV).to(torch.bfloat16)
    resid, counters = _nan(2, CFG.hidden_size), torch.full((70,), 5, dtype=torch.int32, device=DEV)
    gemv_k.embed(torch.tensor([10, 3], device=DEV), table, resid, counters)
    assert torch.equal(resid, table[[10, 3]].float()) and not counters.any()
    with pytest.raises(ValueError, match=r"embed: 2 token ids, a \(V, 64\) table and int32 counters expected"):
        gemv_k.embed(torch.tensor([1, 2], device=DEV), table, resid, counters.long())


@_gpu
@torch.inference_mode()
@pytest.mark.parametrize("rows", [2, 16])
def test_gpu_head_rounds_once_to_the_weight_dtype(rows):
    """In bf16 (the interpreter cannot do bf16 arithmetic, so on CUDA) the head's logits (GEMV for 2 rows,
    looped for 16) are the final norm kernel's output through the linear layer, bias added before the one
    rounding, as fp32: within one bf16 step of cuBLAS's accumulation order."""
    torch.manual_seed(7)
    dec = _decoder(8).to(torch.bfloat16)
    x = torch.randn(rows, CFG.hidden_size, device=DEV) * 2
    lin = torch.nn.Linear(CFG.hidden_size, 6564).to(DEV).to(torch.bfloat16)
    out = _nan(rows, 6564)
    kernels = gemv_k if rows <= proj_k.TILES.gemv_rows else head_k
    kernels.head(x, dec.norm.weight, lin.weight, lin.bias, out, dec.norm.eps)
    hidden = torch.empty(rows, CFG.hidden_size, dtype=torch.bfloat16, device=DEV)
    head_k.rmsnorm(x, dec.norm.weight, hidden, dec.norm.eps)  # the step's final norm before, then the module
    want = lin(hidden).float()
    assert torch.equal(out, out.to(torch.bfloat16).float())  # values of the weight dtype
    assert ((out - want).abs() <= torch.maximum(out.abs(), want.abs()) * 2 ** -7 + 1e-6).all()  # one rounding flip
    with pytest.raises(ValueError, match=rf"head: weight \(6564, 64\), bias \(6564,\) and a \({rows}, 6564\) float32"):
        kernels.head(x, dec.norm.weight, lin.weight, lin.bias, out.double(), dec.norm.eps)


@pytest.mark.parametrize("field,value,message", [
    ("down", 8, "Tiles.down must be a power of two >= 16, got 8"),
    ("down_split", 0, "Tiles.down_split must be 1..16, got 0"),
    ("qkv_split", 17, "Tiles.qkv_split must be 1..16, got 17"),
    ("norm_warps", 6, "Tiles.norm_warps must be 2, 4, 8 or 16, got 6"),
    ("gemv_cols", 12, "Tiles.gemv_cols must be a power of two in 1..64, got 12"),
    ("gemv_small_cols", 0, "Tiles.gemv_small_cols must be a power of two in 1..64, got 0"),
    ("gemv_rows", 17, "Tiles.gemv_rows must be 1..16, got 17"),
    ("head", 24, "Tiles.head must be a power of two >= 16, got 24"),
    ("down_chunk", 100, "Tiles.down_chunk must be a power of two >= 16, got 100"),
    ("cublas_rows", -1, "Tiles.cublas_rows must be an int in 0..1024 (0: never), got -1"),
])
def test_tiles_are_validated_by_field(field, value, message):
    with pytest.raises(ValueError) as err:
        proj_k.Tiles(**{field: value})
    assert str(err.value) == message


def test_attention_splits_fill_the_gpu_for_few_rows_and_stay_powers_of_two():
    got = {rows: attn_k.attention_splits(rows, 2) for rows in (1, 2, 3, 4, 16, 32, 48, 64, 256)}
    assert got == {1: 16, 2: 16, 3: 16, 4: 16, 16: 16, 32: 8, 48: 4, 64: 4, 256: 1}


@torch.inference_mode()
def test_fused_decoder_passes_prefill_through_and_rejects_bad_calls(monkeypatch):
    dec = _decoder(5)
    fused = FusedDecoder(dec)
    assert fused.layers is dec.layers and kernels_per_step(CFG.num_hidden_layers) == 13
    x = torch.randn(1, 4, CFG.hidden_size, device=DEV)
    pos = torch.arange(4, device=DEV)
    caches = [KVCache.for_config(CFG, 8, 1, device=DEV) for _ in range(2)]
    assert torch.equal(fused(x, pos, caches[0], kv_len=4), dec(x, pos, caches[1], kv_len=4))
    with pytest.raises(ValueError, match=r"one position per row; got positions of shape \(2,\)"):
        decode_step(dec, x[:, :1], torch.tensor([1, 2], device=DEV), caches[0])
    with pytest.raises(ValueError, match="power of two"):
        decode_step(dec, x[:, :1], pos[:1], caches[0], splits=3)
    if DEV == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="need CUDA tensors.*TRITON_INTERPRET=1"):
            decode_step(dec, x[:, :1], pos[:1], caches[0])


@torch.inference_mode()
def test_prefill_rows_equal_the_decoder_per_prompt_and_fill_only_their_slot_rows():
    """Two prompts of 20 positions through the fused prefill (small attention tiles, so queries span several
    blocks and keys several tiles; 16 rows per program, so the RoPE and SiLU kernels have a ragged last block)
    against the decoder's own cached prefill of each prompt alone."""
    from cosyvoice_fast.llm.kernels import qwen2_hybrid

    dec = _decoder(6).fuse_projections()
    length, max_len = 20, 24
    pool = KVCache.for_config(CFG, max_len, 4, device=DEV)
    for t in pool.k + pool.v:
        t.fill_(float("nan"))
    slots = torch.tensor([3, 1], device=DEV)
    last = torch.tensor([length - 1, 12], device=DEV)
    x = torch.randn(2, length, CFG.hidden_size, device=DEV)
    got = qwen2_hybrid.prefill_rows(dec, x, slots, last, pool, blocks=(16, 16))
    assert got.shape == (2, CFG.hidden_size)
    for r in range(2):
        ref_cache = KVCache.for_config(CFG, max_len, 1, device=DEV)
        ref = dec(x[r:r + 1], torch.arange(length, device=DEV), ref_cache, kv_len=length)
        assert _err(got[r], ref[0, int(last[r])]) <= 1e-4
        for a, b in zip(pool.k + pool.v, ref_cache.k + ref_cache.v):
            assert _err(a[int(slots[r]), :, :length], b[0, :, :length]) <= 1e-5
            assert a[int(slots[r]), :, length:].isnan().all()  # nothing past the prompt
    for t in pool.k + pool.v:  # rows no prompt owns are untouched
        assert t[0].isnan().all() and t[2].isnan().all()
    with pytest.raises(ValueError, match=r"needs slots and last of shape \(2,\), got \(3,\) and \(2,\)"):
        qwen2_hybrid.prefill_rows(dec, x, torch.tensor([0, 1, 2], device=DEV), last, pool)
    with pytest.raises(ValueError, match="a prefill of 30 positions does not fit a cache of 24"):
        qwen2_hybrid.prefill_rows(dec, torch.randn(2, 30, CFG.hidden_size, device=DEV), slots, last, pool)
