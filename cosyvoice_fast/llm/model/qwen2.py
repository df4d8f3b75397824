"""A compact Qwen2 decoder (HF ``Qwen2ForCausalLM`` numerics) driven by input embeddings and a static KV cache.

CosyVoice2's speech LM never feeds token ids into Qwen2: it feeds embeddings it assembled itself (text
embeddings, learned sos/task vectors, speech-token embeddings) and reads the last hidden state.  So the
decoder here takes ``inputs_embeds`` and returns final-norm hidden states; ``lm_head`` exists only so the
checkpoint's ``llm.model.lm_head.weight`` loads strictly.

The KV cache (:mod:`.kv_cache`) is written at a *position tensor*, so a CUDA-graph backend can capture one
decode step with static tensors (embedding, position, cache) and replay it; the eager path additionally passes
``kv_len`` to attend only over the filled prefix, which is cheaper but shape-changing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_fast.config.model import QwenConfig
from cosyvoice_fast.llm.model.kv_cache import KVCache


class RMSNorm(nn.Module):
    """Qwen2 RMSNorm: normalise in fp32, cast back, then scale (the order matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # One fused kernel instead of eight: GPU decode is kernel-count bound (49 norms per token).  Same
            # fp32 maths; in bf16/fp16 it rounds once where the reference order rounds twice (before and after
            # the weight), a difference below one bf16 ulp.  The CPU path keeps the reference order exactly.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, always computed in fp32 whatever dtype the model is cast to."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._make_inv_freq(), persistent=False)

    def _make_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.theta ** exponents)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # ``model.half()`` / ``.to(bf16)`` would round the frequencies; rebuild them in fp32 on the new device.
        super()._apply(fn, recurse)
        self.inv_freq = self._make_inv_freq().to(self.inv_freq.device)
        return self

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rows(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for per-row positions ``pos`` (B, T), shaped (B, 1, T, D) to broadcast over heads.

        Element for element the same fp32 products as :meth:`forward`, so a row at position ``p`` rotates
        exactly as a batch-1 call at ``p`` does.
        """
        freqs = pos.float()[:, :, None] * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary position embedding with the half-split (not interleaved) pairing Qwen2 uses."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention with biased q/k/v projections and an unbiased output projection."""

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, S, D) -> (B, H, S, D): each kv head serves ``H/Hkv`` consecutive query heads."""
        rep = self.n_heads // self.n_kv
        if rep == 1:
            return t
        b, hk, s, d = t.shape
        return t[:, :, None].expand(b, hk, rep, s, d).reshape(b, hk * rep, s, d)

    def fuse(self) -> None:
        """Put q/k/v weights (and biases) in one tensor and make the three projections views of it, so a step
        runs one GEMM instead of three.  Same values, same state dict (the fused tensors are non-persistent
        buffers; the parameters keep their names and now share storage with them); idempotent."""
        if self._fused():
            return
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight.detach() for p in projs])
        bias = torch.cat([p.bias.detach() for p in projs])
        start = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight.data = weight[start:start + n]
            p.bias.data = bias[start:start + n]
            start += n
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)

    def _fused(self) -> bool:
        """Whether the fused tensor is live: the projections must still be views of it.  A deep copy or a
        ``.to(dtype)`` gives the parameters their own storage, and a later ``load_state_dict`` would then update
        them alone; the fused path is only taken while it cannot be stale (``fuse()`` re-establishes it)."""
        w = getattr(self, "qkv_weight", None)
        return w is not None and self.q_proj.weight.data_ptr() == w.data_ptr()

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q (B, H, T, D) and k (B, Hkv, T, D), and v (B, Hkv, T, D)."""
        b, t, _ = x.shape
        if not self._fused():
            q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            return _rotate(q, cos, sin), _rotate(k, cos, sin), v
        heads = F.linear(x, self.qkv_weight, self.qkv_bias).view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        heads = heads.transpose(1, 2)
        qk = _rotate(heads[:, :self.n_heads + self.n_kv], cos, sin)  # q and k heads are adjacent: one pass
        return qk[:, :self.n_heads], qk[:, self.n_heads:], heads[:, self.n_heads + self.n_kv:]

    def group_mask(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Boolean (T, S) or (B, 1, T, S) attention permission -> the additive mask :meth:`forward` takes with a
        cache: rows repeated once per query head sharing a kv head, ``0`` / ``-inf`` in ``dtype``.

        Built once per decoder call, not once per layer (the bool-to-bias conversion and the repeat would
        otherwise be 2 kernels x 24 layers per decode step, which is kernel-count bound on a GPU)."""
        rep = self.n_heads // self.n_kv
        m = allowed if allowed.dim() == 4 else allowed[None, None]
        b, _, t, s = m.shape
        m = m[:, :, None].expand(b, 1, rep, t, s).reshape(b, 1, rep * t, s)
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                layer: int, cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, self._expand_kv(k), self._expand_kv(v), is_causal=t > 1)
        else:
            assert mask is not None
            kb, vb = cache.update(layer, pos, k, v)
            s = mask.shape[-1]
            # Grouped-query attention without copying K/V per head: the ``rep`` query heads that share a kv
            # head become ``rep * t`` query rows of that head (mask rows repeated alike, see group_mask).
            qg = q.reshape(b, self.n_kv, (self.n_heads // self.n_kv) * t, self.head_dim)
            out = F.scaled_dot_product_attention(qg, kb[:, :, :s], vb[:, :, :s], attn_mask=mask)
            out = out.reshape(b, self.n_heads, t, self.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def fuse(self) -> None:
        """One GEMM for gate and up (see :meth:`Attention.fuse`); same values and state dict; idempotent."""
        if self._fused():
            return
        weight = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
        n = self.gate_proj.weight.shape[0]
        self.gate_proj.weight.data, self.up_proj.weight.data = weight[:n], weight[n:]
        self.register_buffer("gate_up_weight", weight, persistent=False)

    def _fused(self) -> bool:
        """As :meth:`Attention._fused`: the fused tensor is used only while the projections are views of it."""
        w = getattr(self, "gate_up_weight", None)
        return w is not None and self.gate_proj.weight.data_ptr() == w.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused():
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: QwenConfig, index: int):
        super().__init__()
        self.index = index
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, self.index, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Decoder(nn.Module):
    """Embeddings in, final-norm hidden states out.

    Keys match HF ``Qwen2Model`` (``embed_tokens``, ``layers``, ``norm``); the rotary table has no weights.
    """

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, inputs_embeds: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
                kv_len: int | None = None) -> torch.Tensor:
        """Run ``inputs_embeds`` (B, T, H) at absolute positions ``pos`` (T,, int64, shared by the batch).

        - ``cache=None``: one causal pass over the T inputs alone (positions still come from ``pos``).
        - with a cache: keys/values are written at ``pos`` and each query attends to every cached position
          ``<=`` its own; ``kv_len`` (host int, > max(pos)) limits attention to the filled prefix, ``None``
          attends over the whole buffer (static shapes for graph capture).
        Prefill (T > 1) and one-step decode (T == 1) are the same call.

        ``pos`` may also be (B, T): per-row positions, for decoding independent requests in one batch (see
        :meth:`forward_rows`).
        """
        if pos.dim() == 2:
            return self.forward_rows(inputs_embeds, pos, cache, kv_len)
        cos, sin = self.rotary(pos, inputs_embeds.dtype)
        mask = None
        if cache is not None:
            s = cache.max_len if kv_len is None else kv_len
            # (T, S): causal by absolute position; also hides stale slots beyond the written prefix.
            mask = torch.arange(s, device=pos.device)[None, :] <= pos[:, None]
            mask = self.layers[0].self_attn.group_mask(mask, inputs_embeds.dtype) if len(self.layers) else mask
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, pos, cache, mask)
        return self.norm(x)

    def fuse_projections(self) -> "Qwen2Decoder":
        """Fuse q/k/v and gate/up into single GEMMs in every layer (GPU decode is kernel-count bound); the
        parameters become views of the fused tensors, so values, memory and the state dict are unchanged."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def forward_rows(self, inputs_embeds: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
                     kv_len: int | None = None) -> torch.Tensor:
        """Like :meth:`forward`, but row ``b`` of ``inputs_embeds`` (B, T, H) sits at its own positions ``pos[b]``.

        Every row is an independent sequence: with a cache (whose batch must be B) row ``b`` writes its keys and
        values into its own cache row at ``pos[b]`` and attends to its own cached positions ``<= pos[b, t]``
        (mask (B, 1, T, S)).  Nothing mixes rows: the projections are row-wise matmuls, attention is per batch
        row, so a row's result equals running it alone up to the rounding of the batched matmul kernels (on CPU
        fp32 the tests see ~1e-7).  ``kv_len`` must exceed every row's largest position.
        """
        if pos.shape != inputs_embeds.shape[:2]:
            raise ValueError(f"per-row positions {tuple(pos.shape)} do not match inputs {tuple(inputs_embeds.shape)}")
        cos, sin = self.rotary.rows(pos, inputs_embeds.dtype)
        mask = None
        if cache is not None:
            s = cache.max_len if kv_len is None else kv_len
            mask = torch.arange(s, device=pos.device)[None, None, None, :] <= pos[:, None, :, None]
            mask = self.layers[0].self_attn.group_mask(mask, inputs_embeds.dtype) if len(self.layers) else mask
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, pos, cache, mask)
        return self.norm(x)


class Qwen2WithHead(nn.Module):
    """``model`` (the decoder) + ``lm_head``: the HF ``Qwen2ForCausalLM`` key layout.

    TTS never uses the text head; with tied embeddings it shares ``embed_tokens``' storage so it costs no memory.
    """

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.model = Qwen2Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
