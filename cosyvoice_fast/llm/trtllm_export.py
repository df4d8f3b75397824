"""Export the speech LM as a plain Qwen2 checkpoint that TensorRT-LLM's Qwen converter accepts.

TensorRT-LLM builds engines from Hugging Face style Qwen2 checkpoints whose inputs are token ids.  The speech
LM's input is a sequence of *embeddings* from three tables (text ``embed_tokens``, ``speech_embedding`` and the
2-row ``llm_embedding`` for sos / task-id), and its head is ``llm_decoder`` (6564 speech outputs, with bias).
Since every LM-input row is a table lookup, one extended vocabulary makes the input plain ids:

    [0, V_text)                       text tokens          -> embed_tokens rows
    [V_text, V_text + 6564)           speech tokens 0..6563 -> speech_embedding rows
    V_text + 6564, V_text + 6565      sos, task-id         -> llm_embedding rows 0, 1

``lm_head`` has the extended vocabulary too: speech rows carry ``llm_decoder.weight``, all other rows are zero.
Qwen2's head has no bias, so ``llm_decoder.bias`` is written beside the checkpoint (``speech_head.safetensors``)
and applied by the runner's logits processor, which also masks every non-speech id.  Hence
``log_softmax(logits[V_text:V_text+6564] + bias)`` equals the original model's log-probs (tested on CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from cosyvoice_fast.config.model import LLMConfig


@dataclass(frozen=True, slots=True)
class ExtendedVocab:
    """Id layout of the exported checkpoint."""

    text_vocab: int
    speech_rows: int

    @property
    def speech_offset(self) -> int:
        return self.text_vocab

    @property
    def sos_id(self) -> int:
        return self.text_vocab + self.speech_rows

    @property
    def task_id(self) -> int:
        return self.text_vocab + self.speech_rows + 1

    @property
    def size(self) -> int:
        return self.text_vocab + self.speech_rows + 2

    def lm_input_ids(self, text: torch.Tensor, prompt_text: torch.Tensor | None,
                     prompt_speech: torch.Tensor | None) -> list[int]:
        """The id sequence whose embeddings equal ``Qwen2LM.build_lm_input`` (zero-shot layout)."""
        ids = [self.sos_id]
        if prompt_text is not None:
            ids += prompt_text.reshape(-1).tolist()
        ids += text.reshape(-1).tolist()
        ids.append(self.task_id)
        if prompt_speech is not None:
            ids += [self.speech_offset + int(t) for t in prompt_speech.reshape(-1).tolist()]
        return ids


def export_qwen2_checkpoint(llm: torch.nn.Module, cfg: LLMConfig, out_dir: str | Path,
                            dtype: torch.dtype = torch.float16) -> ExtendedVocab:
    """Write ``config.json``, ``model.safetensors`` and ``speech_head.safetensors`` to ``out_dir``."""
    if cfg.family != "cosyvoice2":
        raise ValueError(f"the TensorRT-LLM export handles CosyVoice2's LM layout only, not {cfg.family}'s "
                         "(no llm_embedding, a head without bias); use the fused or cudagraph LLM backend")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q = cfg.qwen
    sd = {k: v.detach().to("cpu") for k, v in llm.state_dict().items()}
    vocab = ExtendedVocab(text_vocab=q.vocab_size, speech_rows=cfg.vocab_out)
    text_emb = sd["llm.model.model.embed_tokens.weight"]
    embed = torch.cat([text_emb, sd["speech_embedding.weight"], sd["llm_embedding.weight"]], dim=0)
    head = torch.zeros(vocab.size, q.hidden_size, dtype=embed.dtype)
    head[vocab.speech_offset:vocab.speech_offset + vocab.speech_rows] = sd["llm_decoder.weight"]
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    prefix = "llm.model.model."
    for k, v in sd.items():
        if k.startswith(prefix) and not k.endswith("embed_tokens.weight"):
            tensors["model." + k[len(prefix):]] = v
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    save_file({"bias": sd["llm_decoder.bias"].float().contiguous(),
               "speech_offset": torch.tensor([vocab.speech_offset]),
               "speech_rows": torch.tensor([vocab.speech_rows])}, str(out / "speech_head.safetensors"))
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": q.hidden_size, "intermediate_size": q.intermediate_size,
        "num_hidden_layers": q.num_hidden_layers, "num_attention_heads": q.num_attention_heads,
        "num_key_value_heads": q.num_key_value_heads, "rms_norm_eps": q.rms_norm_eps, "rope_theta": q.rope_theta,
        "vocab_size": vocab.size, "tie_word_embeddings": False, "max_position_embeddings": 32768,
        "use_sliding_window": False, "torch_dtype": str(dtype).replace("torch.", ""),
        "bos_token_id": vocab.sos_id, "eos_token_id": vocab.speech_offset + cfg.eos_token,
        "cosyvoice_fast": {"speech_offset": vocab.speech_offset, "speech_rows": vocab.speech_rows,
                           "sos_id": vocab.sos_id, "task_id": vocab.task_id,
                           "speech_token_size": cfg.speech_token_size},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return vocab
