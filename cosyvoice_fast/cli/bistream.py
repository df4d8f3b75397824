"""Draft of ``synth --bistream``: text read from stdin as it is written, speech tokens decoded meanwhile.

    some_llm --stream | python -m cosyvoice_fast.cli.bistream --prompt-wav voice.wav --prompt-text "..." --out a.wav

The voice is prepared once, before the first piece is read; stdin is read as bytes whenever the LM schedule
waits for text (never while it can decode), normalised and tokenised incrementally and fed to the LM on the
eager backend.  Audio is made from all tokens at the end (flow + HiFT, non-streaming); for audio that streams
out while text streams in, use ``python -m cosyvoice_fast synth --bistream`` (the engine, with the helpers
:func:`stdin_pieces` and :func:`bistream_summary` below).  It prints when the first speech token came, measured
from the first text piece and from the 5th text token.
"""

from __future__ import annotations

import argparse
import codecs
import logging
import sys
import time
from pathlib import Path
from typing import BinaryIO, Iterator

import torch

log = logging.getLogger(__name__)
DEFAULT_PROMPT = Path(__file__).resolve().parents[2] / "assets" / "cross_lingual_prompt.wav"


def _read_some(stream: BinaryIO) -> bytes:
    """Whatever is available now (at most one read), b"" at the end: pieces are used as soon as they arrive."""
    read1 = getattr(stream, "read1", None)
    return read1(4096) if read1 is not None else stream.read(4096)


def stdin_pieces(stream: BinaryIO) -> Iterator[str]:
    """The text of ``stream`` as it comes (one read per piece, UTF-8 decoded incrementally), for
    ``synth --bistream``: the engine's reader thread pulls it while the LM speaks what came before."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    while data := _read_some(stream):
        yield decoder.decode(data)
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def bistream_summary(tele: object) -> str:
    """One line: text pieces, first audio from the first piece and from the 5th text token, last-audio lag."""
    def ms(x: float) -> str:
        return "n/a" if x != x else f"{1000 * x:.0f} ms"

    return (f"bi-streaming: {len(tele.text_arrivals)} text pieces; first audio {ms(tele.first_audio_from_text)} "
            f"after the first piece, {ms(tele.first_audio_from_token5)} after the 5th text token; last audio "
            f"{ms(tele.last_audio_lag)} after the last piece")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_fast.cli.bistream", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", metavar="DIR", help="CosyVoice2-0.5B directory")
    p.add_argument("--synthetic", choices=["tiny", "full", "tiny3", "full3"],
                   help="random weights of that size instead (no download; tiny3/full3: CosyVoice3)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 … (default: cuda if available)")
    p.add_argument("--mode", choices=["zero_shot", "cross_lingual", "instruct2", "speaker"],
                   help="default: speaker with --speaker, zero_shot with --prompt-text, else cross_lingual")
    p.add_argument("--prompt-wav", metavar="FILE", help="the voice to clone (default: the bundled example voice)")
    p.add_argument("--prompt-text", default="", help="exactly what is said in --prompt-wav (zero-shot mode)")
    p.add_argument("--instruct", default="", help="instruct2 mode: how to speak")
    p.add_argument("--speaker", help="a saved speaker's name (speaker mode)")
    p.add_argument("--speaker-cache", default="speakers", metavar="DIR", help="where saved speakers are kept")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many speech tokens")
    p.add_argument("--greedy", action="store_true", help="argmax instead of upstream's sampler (deterministic)")
    p.add_argument("--out", default="out.wav", metavar="FILE", help="where to write the audio (default out.wav)")
    return p


def main(argv: list[str] | None = None, stdin: BinaryIO | None = None) -> int:
    import soundfile as sf

    from cosyvoice_fast.llm.bistream_eager import EagerBistream
    from cosyvoice_fast.flow.eager import flow_chunk_mel
    from cosyvoice_fast.llm.model.sampling import greedy_sample
    from cosyvoice_fast.frontend.request import SynthesisRequest
    from cosyvoice_fast.engine.bistream import TextFeed
    from cosyvoice_fast.config.schedule import ChunkCall
    from cosyvoice_fast.serving.service import load_service

    a = parser().parse_args(argv)
    stdin = stdin if stdin is not None else sys.stdin.buffer
    svc = load_service(a.model_dir, a.synthetic, a.device, "fp32", speaker_cache_dir=a.speaker_cache,
                       progress=False)
    try:
        if svc.frontend is None:
            print("this model directory has no prompt-voice frontend (campplus.onnx, speech_tokenizer_v2.onnx, "
                  "tokenizer files): bi-streaming needs it", file=sys.stderr)
            return 2
        mode = a.mode or ("speaker" if a.speaker else "zero_shot" if a.prompt_text else "cross_lingual")
        req = SynthesisRequest(text="(read from stdin)", mode=mode, seed=a.seed, speaker=a.speaker,
                               prompt_wav=a.prompt_wav or (None if mode == "speaker" else str(DEFAULT_PROMPT)),
                               prompt_text=a.prompt_text, instruct_text=a.instruct)
        side = svc.frontend.prepare_prompt(req)  # the voice, once, before any text is read
        llm, dev = svc.models.llm, svc.models.device
        runner = EagerBistream(llm, sampler=greedy_sample if a.greedy else None)
        state = runner.new_state(*side.lm_prompt, max_tokens=a.max_tokens,
                                 max_token_text_ratio=llm.cfg.max_token_text_ratio)
        feed = TextFeed(svc.frontend.text_stream(), state)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        gen, cache, tokens, t_first = torch.Generator().manual_seed(a.seed), None, [], None
        try:
            while not state.done:
                if state.waiting:
                    data = _read_some(stdin)
                    feed.push(decoder.decode(data)) if data else feed.end()
                    continue
                record, cache = runner.step(state, cache, gen)
                if record is not None and record.yielded is not None:
                    tokens.append(record.yielded)
                    t_first = t_first or time.monotonic()
        except ValueError as e:  # empty or over-long text: the frontend's message says what to do
            print(f"error: {e}", file=sys.stderr)
            return 2
        n = len(tokens)
        if n == 0:
            print("the LM ended before any speech token: nothing to write", file=sys.stderr)
            return 1
        inputs = side.model_inputs([torch.tensor([feed.text.ids], dtype=torch.int32)]).to(dev)
        call = ChunkCall(index=0, token_offset=0, hop=n, n_tokens=n, lookahead=0, finalize=True)
        with torch.inference_mode():
            mel = flow_chunk_mel(svc.models.flow, inputs, torch.tensor([tokens], device=dev), call, stream=False)
            wav, _ = svc.models.hift.inference(mel.float(), generator=torch.Generator(dev).manual_seed(a.seed))
        sf.write(a.out, wav[0].cpu().numpy(), svc.models.config.sample_rate)
        ms = (lambda t0: f"{1000 * (t_first - t0):.0f} ms" if t_first and t0 else "n/a")
        print(f"{len(feed.arrivals)} pieces, {len(feed.text.ids)} text tokens, {n} speech tokens "
              f"({'eos' if state.eos_reached else 'cap'}); first speech token {ms(feed.t_first_piece)} after the "
              f"first piece, {ms(feed.t_text_token_5)} after the 5th text token; wrote {a.out} "
              f"({wav.shape[-1] / svc.models.config.sample_rate:.2f} s)")
    finally:
        svc.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
