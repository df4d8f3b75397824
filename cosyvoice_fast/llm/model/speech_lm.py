"""The speech LM (CosyVoice2 ``Qwen2LM``, CosyVoice3 ``CosyVoice3LM``): Qwen2 over ``[sos, text, task, prompt
speech]`` predicting 25 Hz speech tokens.

The LM sees text through Qwen2's own token embeddings and speech through a separate ``speech_embedding``
table; two learned vectors frame the text: sos and task id.  Its head ``llm_decoder`` scores the speech tokens
and then the LM's own ids, every one of which ends generation.  The two families differ only in data that
:class:`~cosyvoice_fast.config.model.LLMConfig` derives from its ``family``, so one class serves both:
CosyVoice2 keeps sos / task in a 2-row ``llm_embedding`` and has ``speech_token_size + 3`` biased outputs;
CosyVoice3 takes them from ``speech_embedding`` rows, has ``speech_token_size + 200`` outputs without a bias,
and every prompt must hold the ``<|endofprompt|>`` text id.

What the prompt contributes depends on the mode (see ``cosyvoice.cli.frontend`` upstream):

- zero-shot: ``prompt_text`` = transcript of the prompt audio, ``prompt_speech_token`` = its tokens;
- cross-lingual: neither (the LM gets no prompt; the voice comes only through the flow stage);
- instruct2: ``prompt_text`` = the instruction text, no prompt speech tokens.

All three go through :meth:`Qwen2LM.build_lm_input` with empty tensors (or ``None``) for what is absent.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch import nn

from cosyvoice_fast.config.model import LLMConfig
from cosyvoice_fast.llm.model.kv_cache import KVCache
from cosyvoice_fast.llm.model.qwen2 import Qwen2Decoder, Qwen2WithHead
from cosyvoice_fast.llm.model.sampling import RasSampler, Sampler


class QwenBackbone(nn.Module):
    """Holds the Qwen2 model under ``.model`` so checkpoint keys read ``llm.model.model.*``."""

    def __init__(self, llm_cfg: LLMConfig):
        super().__init__()
        self.model = Qwen2WithHead(llm_cfg.qwen)

    @property
    def decoder(self) -> Qwen2Decoder:
        return self.model.model


def _as_ids(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """(1, T) int ids on ``device``, or None when absent/empty."""
    if t is None:
        return None
    t = t.reshape(1, -1) if t.dim() < 2 else t
    return t.to(device=device, dtype=torch.long) if t.shape[1] > 0 else None


class Qwen2LM(nn.Module):
    """Text + prompt -> speech tokens.  Pure math plus a generator that yields one token per ``next``."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        if not cfg.frame_in_speech_table:
            self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self.llm = QwenBackbone(cfg)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.vocab_out, bias=cfg.decoder_bias)
        self.speech_embedding = nn.Embedding(cfg.vocab_out, cfg.llm_input_size)

    # ------------------------------------------------------------------------------------------ inputs

    @property
    def decoder(self) -> Qwen2Decoder:
        return self.llm.decoder

    def _param(self) -> torch.Tensor:
        return self.speech_embedding.weight

    def frame_row(self, kind: str) -> torch.Tensor:
        """The (H,) input vector of ``sos`` or ``task``: a row of ``llm_embedding`` (CosyVoice2) or of
        ``speech_embedding`` (CosyVoice3), as the config says."""
        row = self.cfg.sos_id if kind == "sos" else self.cfg.task_id
        table = self.speech_embedding if self.cfg.frame_in_speech_table else self.llm_embedding
        return table.weight[row]

    def check_prompt(self, text: torch.Tensor | None, prompt_text: torch.Tensor | None = None) -> None:
        """Refuse a CosyVoice3 input whose prompt text and text lack ``<|endofprompt|>`` (the LM was trained
        only on prompts that hold it; upstream asserts the same).  No check when the config names no id."""
        eop = self.cfg.endofprompt_id
        if eop is None:
            return
        if not any(t is not None and bool((t == eop).any()) for t in (prompt_text, text)):
            raise ValueError(f"the prompt text holds no <|endofprompt|> (text id {eop}): a CosyVoice3 prompt must "
                             "end its system part with it, e.g. 'You are a helpful assistant.<|endofprompt|>' "
                             "followed by the transcript")

    def build_lm_input(self, text: torch.Tensor, prompt_text: torch.Tensor | None = None,
                       prompt_speech_token: torch.Tensor | None = None) -> torch.Tensor:
        """``[sos, embed_tokens(prompt_text ++ text), task_id, speech_embedding(prompt_speech_token)]`` -> (1, L, H).

        Pass ``prompt_text``/``prompt_speech_token`` empty or None for what the mode leaves out.  No speaker
        embedding enters the CosyVoice2 LM.
        """
        dev = self._param().device
        ids = [x for x in (_as_ids(prompt_text, dev), _as_ids(text, dev)) if x is not None]
        all_ids = torch.cat(ids, dim=1) if ids else None
        self.check_prompt(all_ids)
        parts = [self.frame_row("sos").reshape(1, 1, -1)]
        if all_ids is not None:
            parts.append(self.decoder.embed_tokens(all_ids))
        parts.append(self.frame_row("task").reshape(1, 1, -1))
        speech = _as_ids(prompt_speech_token, dev)
        if speech is not None:
            parts.append(self.speech_embedding(speech))
        return torch.cat(parts, dim=1)

    @staticmethod
    def lm_input_length(text: torch.Tensor | None, prompt_text: torch.Tensor | None = None,
                        prompt_speech_token: torch.Tensor | None = None) -> int:
        """Positions of :meth:`build_lm_input`'s result: sos, the text ids, task id, the speech ids."""
        return 2 + sum(int(t.numel()) for t in (text, prompt_text, prompt_speech_token) if t is not None)

    def lm_input_rows(self, ids: torch.Tensor, n_text: torch.Tensor) -> torch.Tensor:
        """:meth:`build_lm_input` of several prompts at once, from their ids, as fixed-shape math a CUDA graph can
        capture (the batched prefill's gather: no host work per prompt but copying its ids in).

        Row ``r`` of ``ids`` (R, N) is laid out as the result: position 0 becomes ``sos``, positions
        ``1 .. n_text[r]`` the text embeddings of their ids (prompt text then text), the next one ``task_id``, and
        every later position the speech embedding of its id.  ``n_text`` is (R,) or (R, 1).  The ids at
        position 0, at the task position and past the prompt's end are not read as such: those positions come
        out as fixed or arbitrary in-range rows, which causal attention keeps out of the prompt's own positions.
        -> (R, N, H), equal row for row to :meth:`build_lm_input` on each prompt's real positions."""
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)
        end = n_text.reshape(-1, 1)
        ids = ids.long()
        text = self.decoder.embed_tokens(ids.clamp(0, self.decoder.embed_tokens.num_embeddings - 1))
        speech = self.speech_embedding(ids.clamp(0, self.speech_embedding.num_embeddings - 1))
        frame = torch.where((pos == 0)[:, None], self.frame_row("sos"), self.frame_row("task"))  # (N, H)
        out = torch.where((pos > end + 1)[..., None], speech, frame)
        return torch.where(((pos >= 1) & (pos <= end))[..., None], text, out)

    def embed_segments(self, segments: Sequence[tuple[str, int, int]] | Sequence[Any], text_ids: Sequence[int],
                       prompt_speech: Sequence[int], out_tokens: Sequence[int]) -> torch.Tensor:
        """The LM input rows a bi-streaming step feeds, (1, rows, H), from its segment descriptions.

        Each segment is ``(kind, start, length)`` (or an object with those attributes, see
        :class:`~cosyvoice_fast.llm.model.bistream.Segment`): ``sos``/``task`` are ``llm_embedding`` rows, ``text``
        rows ``start ..`` of ``embed_tokens(text_ids)``, ``prompt_speech`` rows of
        ``speech_embedding(prompt_speech)``, ``speech`` the ``speech_embedding`` of ``out_tokens[start]``.
        Only the ids a segment names are embedded, so a step costs its own rows, not the whole stream's."""
        dev = self._param().device
        parts = []
        for seg in segments:
            kind, start, length = seg if isinstance(seg, tuple) else (seg.kind, seg.start, seg.length)
            if kind in ("sos", "task"):
                parts.append(self.frame_row(kind).reshape(1, 1, -1).expand(1, length, -1))
                continue
            source, table = {"text": (text_ids, self.decoder.embed_tokens),
                             "prompt_speech": (prompt_speech, self.speech_embedding),
                             "speech": (out_tokens, self.speech_embedding)}[kind]
            if start + length > len(source):
                raise ValueError(f"segment {kind} rows {start}..{start + length - 1} but only {len(source)} ids exist")
            ids = torch.as_tensor(list(source[start:start + length]), dtype=torch.long, device=dev)
            parts.append(table(ids)[None])
        return torch.cat(parts, dim=1)

    def length_limits(self, n_text_tokens: int, max_tokens: int | None = None,
                      ignore_eos: bool = False) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for ``n_text_tokens`` target-text tokens (prompt text not counted).

        ``max_tokens`` caps max_len; with ``ignore_eos`` it *is* max_len (and is then required)."""
        if ignore_eos and max_tokens is None:
            raise ValueError("ignore_eos needs max_tokens, otherwise generation would never end")
        min_len = int(n_text_tokens * self.cfg.min_token_text_ratio)
        max_len = int(n_text_tokens * self.cfg.max_token_text_ratio)
        if max_tokens is not None:
            max_len = int(max_tokens) if ignore_eos else min(max_len, int(max_tokens))
        return min_len, max_len

    # ------------------------------------------------------------------------------------------ math

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """A cache in this model's dtype and device with room for ``max_len`` positions."""
        w = self._param()
        return KVCache.for_config(self.cfg.qwen, max_len, batch, w.dtype, w.device)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Speech-token log-probabilities from decoder hidden states; the normalisation runs in fp32."""
        return self.llm_decoder(hidden).float().log_softmax(dim=-1)

    def step_log_probs(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                       kv_len: int | None = None) -> torch.Tensor:
        """One decode step of speech tokens ``tokens`` (B, 1) at ``pos`` over ``cache``: log-probs (B, V)."""
        hidden = self.decoder(self.speech_embedding(tokens), pos, cache, kv_len=kv_len)
        return self.log_probs(hidden[:, -1])

    def forward(self, lm_input: torch.Tensor) -> torch.Tensor:
        """One causal pass without a cache: log-probs for every position, (B, L, V)."""
        pos = torch.arange(lm_input.shape[1], device=lm_input.device)
        return self.log_probs(self.decoder(lm_input, pos))

    def prefill(self, lm_input: torch.Tensor, cache: KVCache, start: int = 0) -> torch.Tensor:
        """Write ``lm_input`` (B, T, H) into the cache at ``start..start+T-1``; log-probs after the last, (B, V)."""
        t = lm_input.shape[1]
        cache.check_room(start, t)
        pos = torch.arange(start, start + t, device=lm_input.device)
        hidden = self.decoder(lm_input, pos, cache, kv_len=start + t)
        return self.log_probs(hidden[:, -1])

    def embed_speech(self, token_id: int | torch.Tensor) -> torch.Tensor:
        """(1, 1, H) input embedding of one speech token."""
        tok = torch.as_tensor(token_id, device=self._param().device, dtype=torch.long).reshape(1, 1)
        return self.speech_embedding(tok)

    def decode_step(self, token_id: int | torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
        """Feed one speech token at position ``pos`` (= tokens already in the cache); log-probs (1, V)."""
        return self.prefill(self.embed_speech(token_id), cache, start=pos)

    # ------------------------------------------------------------------------------------------ generation

    def default_sampler(self) -> Sampler:
        c = self.cfg
        return RasSampler(top_p=c.top_p, top_k=c.top_k, win_size=c.win_size, tau_r=c.tau_r)

    def generate(self, text: torch.Tensor, prompt_text: torch.Tensor | None = None,
                 prompt_speech_token: torch.Tensor | None = None, *, generator: torch.Generator,
                 sampler: Sampler | None = None, max_tokens: int | None = None,
                 ignore_eos: bool = False) -> Iterator[int]:
        """Yield speech token ids one at a time (prefill runs on the first ``next``).

        Length rules follow upstream: with ``n`` target-text tokens, at most ``20 n`` tokens are produced and
        id ``speech_token_size`` (eos in CosyVoice2, sos in CosyVoice3) is masked out of the distribution for the
        first ``2 n`` draws.  Any id >= ``speech_token_size`` (the LM's own ids) ends generation and is never
        yielded.

        ``max_tokens`` caps the count; with ``ignore_eos`` every stop id is masked at every step and exactly
        ``max_tokens`` tokens are produced (used for comparable benchmarks).  Each step's math runs under
        ``torch.inference_mode`` that is entered and left within the step, so suspending between tokens
        leaves the caller's autograd state untouched.
        """
        n_text = int(text.shape[-1])
        min_len, max_len = self.length_limits(n_text, max_tokens, ignore_eos)
        sample = sampler if sampler is not None else self.default_sampler()
        stop = self.cfg.first_stop_id
        history: list[int] = []
        cache: KVCache | None = None
        pos = 0
        for step in range(max_len):
            with torch.inference_mode():
                if cache is None:
                    lm_input = self.build_lm_input(text, prompt_text, prompt_speech_token)
                    cache = self.new_cache(lm_input.shape[1] + max_len)
                    logp = self.prefill(lm_input, cache)[0]
                    pos = lm_input.shape[1]
                else:
                    logp = self.decode_step(history[-1], cache, pos)[0]
                    pos += 1
                if ignore_eos:
                    logp[stop:] = -float("inf")
                elif step < min_len:
                    logp[self.cfg.min_len_masked_id] = -float("inf")
                token = int(sample(logp, history, generator))
            if token >= stop:
                return
            history.append(token)
            yield token


def build_speech_lm(cfg: LLMConfig) -> Qwen2LM:
    """The speech LM of ``cfg``'s family, untrained (load ``llm.pt`` into it strictly).  One class serves both
    families: CosyVoice3's ``CosyVoice3LM`` differs from CosyVoice2's ``Qwen2LM`` only in data the config holds
    (no ``llm_embedding``, a 6761-row head without bias, sos/task rows in ``speech_embedding``)."""
    return Qwen2LM(cfg)
