"""Frontend files for synthetic model directories: a byte-level Qwen2 BPE vocabulary and two tiny ONNX models.

They have the real files' names, formats and tensor interfaces (``speech_tokenizer_v2.onnx``, or ``_v3.onnx`` for
CosyVoice3: 128-bin log-mel
(1, 128, T) + length -> (1, T/4) speech token ids; ``campplus.onnx``: fbank (1, T, 80) -> (1, 192)), so the
whole prompt-voice path runs for demos and tests; their outputs are meaningless (random projections).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cosyvoice_fast.config.model import ModelConfig


def _byte_alphabet() -> list[str]:
    """The byte-level BPE alphabet Qwen2 uses (printable Latin-1 bytes as themselves, others shifted to 256+)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


#: the real Qwen2 vocabulary's size before its added tokens (``<|endoftext|>`` is 151643, ``<|endofprompt|>`` 151646)
QWEN2_BASE_VOCAB = 151643


def write_bpe_files(blank_en: Path, base_size: int = 256) -> int:
    """vocab.json (256 byte tokens, no merges; padded with never-matched filler tokens up to ``base_size`` so that
    the added tokens get the real tokenizer's ids), merges.txt, tokenizer_config.json; returns the base size."""
    vocab = {t: i for i, t in enumerate(_byte_alphabet())}
    vocab.update({f"<|synthetic_filler_{i}|>": i for i in range(len(vocab), base_size)})
    (blank_en / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (blank_en / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    n = len(vocab)
    special = {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False, "special": True}
    cfg = {"added_tokens_decoder": {str(n): special}, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "unk_token": None, "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 32768,
           "split_special_tokens": False, "clean_up_tokenization_spaces": False, "errors": "replace"}
    (blank_en / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return n


def _save(graph, path: Path) -> None:  # noqa: ANN001 - onnx.GraphProto
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="cosyvoice_fast")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_speech_tokenizer(path: Path, n_tokens: int, seed: int = 0) -> None:
    """(1, 128, T) log-mel, (1,) length -> (1, ceil(T/4)) int64 ids < n_tokens: argmax of a random projection."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((128, n_tokens)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["feats"], ["ft"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["ft", "w"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["ids"], axis=2, keepdims=0),
        helper.make_node("Slice", ["ids", "starts", "ends", "axes", "steps"], ["tokens"]),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0], np.int64), "starts"),
             numpy_helper.from_array(np.array([2**62], np.int64), "ends"),
             numpy_helper.from_array(np.array([1], np.int64), "axes"),
             numpy_helper.from_array(np.array([4], np.int64), "steps")]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_synthetic",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "N"])], inits)
    _save(graph, path)


def write_speaker_model(path: Path, dim: int = 192, seed: int = 1) -> None:
    """(1, T, 80) fbank -> (1, dim) embedding: time mean then a random projection."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((80, dim)).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["input"], ["m"], axes=[1], keepdims=0),
             helper.make_node("MatMul", ["m", "w"], ["embedding"])]
    graph = helper.make_graph(nodes, "campplus_synthetic",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
                              [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, dim])],
                              [numpy_helper.from_array(w, "w")])
    _save(graph, path)


def write_frontend_files(out: Path, cfg: ModelConfig, seed: int = 0) -> None:
    """The frontend files of ``cfg``'s family.  A CosyVoice3 LM with the real text vocabulary checks for the
    real ``<|endofprompt|>`` id, so its byte vocabulary is padded to the real base size."""
    from cosyvoice_fast.modeldir.families import family_of

    real = cfg.family == "cosyvoice3" and cfg.llm.qwen.vocab_size > QWEN2_BASE_VOCAB + 3
    write_bpe_files(out / "CosyVoice-BlankEN", QWEN2_BASE_VOCAB if real else 256)
    n_tokens = min(cfg.llm.speech_token_size, cfg.flow.vocab_size)
    write_speech_tokenizer(out / family_of(cfg.family).speech_tokenizer, n_tokens, seed)
    write_speaker_model(out / "campplus.onnx", cfg.flow.spk_embed_dim, seed + 1)
