"""The app's "type as you go" demo: the text box's words are fed to a bi-streaming request at a chosen pace,
as a voice agent's LLM would write them, and the chunk timeline shows when each piece arrived against the audio.

Kept out of ``webui.py`` (which only calls :func:`bistream_tab`): widgets, one handler, no model code.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cosyvoice_fast.app import dashboard as db
from cosyvoice_fast.app.handlers import pcm16
from cosyvoice_fast.frontend.request import SynthesisRequest

DEFAULT_PROMPT = Path(__file__).resolve().parents[2] / "assets" / "cross_lingual_prompt.wav"


# CJK ideographs, kana, hangul and full-width forms: text written without spaces, fed one character at a time
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
_PUNCT = "\u3000-\u303f\uff00-\uffef.,;:!?"
_PIECE = re.compile(f"[{_CJK}][{_PUNCT}]*\\s*|[^\\s{_CJK}]+\\s*|\\s+")


def pieces(text: str) -> list[str]:
    """``text`` cut as an LLM would write it: a word with its following space, or one CJK character (Chinese and
    Japanese use no spaces; split on spaces alone a whole sentence was one "word"); punctuation stays with what
    it follows.  Joined, the pieces are ``text`` again."""
    return _PIECE.findall(text)


def words_at(text: str, words_per_second: float) -> Iterator[str]:
    """:func:`pieces` of ``text``, one every ``1 / words_per_second`` s."""
    if not 0 < words_per_second <= 100:
        raise ValueError(f"words per second = {words_per_second!r}: choose 0.5 to 100")
    for i, w in enumerate(pieces(text)):
        if i:
            time.sleep(1.0 / words_per_second)
        yield w


def type_as_you_go(service: Any, text: str, words_per_second: float, max_tokens: float | None = None,
                   seed: int = 0) -> Iterator[tuple[str, Any, Any]]:
    """Handler: (status, audio (rate, samples) or None, chunk timeline) as the request runs; the audio comes
    whole at the end, the status after every chunk."""
    if not (text or "").strip():
        raise ValueError("Text is empty: type something to speak.")
    source = words_at(text, float(words_per_second))
    req = SynthesisRequest(text_source=source, mode="cross_lingual", prompt_wav=str(DEFAULT_PROMPT), seed=int(seed),
                           max_tokens=int(max_tokens) if max_tokens else None)
    parts, tele = [], None
    for chunk in service.engine.stream(req):
        parts.append(chunk.samples)
        tele = chunk.telemetry or tele
        yield f"{len(parts)} chunks so far…", None, None
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    status = "done"
    if tele is not None:
        status = (f"done: {len(tele.text_arrivals)} words fed; first audio "
                  f"{1e3 * tele.first_audio_from_text:.0f} ms after the first word, last audio "
                  f"{1e3 * tele.last_audio_lag:.0f} ms after the last word")
    yield status, (service.engine.sample_rate, pcm16(audio)), db.chunk_timeline_figure(tele, "Type as you go")


def bistream_tab(service: Any, default_text: str = "", default_cap: int = 0) -> None:
    """The "Type as you go" tab (call inside the app's ``gr.Blocks``)."""
    import gradio as gr

    with gr.Tab("Type as you go"):
        gr.Markdown("The words of the text box reach the speech LM one by one at the pace below, as an agent's "
                    "LLM writes them; audio starts before the text is complete.")
        text = gr.Textbox(default_text, label="Text (fed word by word; CJK character by character)", lines=3,
                          elem_id="bistream-text")
        with gr.Row():
            rate = gr.Slider(0.5, 20, value=4, step=0.5, label="Words per second", elem_id="bistream-rate")
            cap = gr.Number(default_cap or None, label="Max speech tokens (empty: until the LM stops)",
                            precision=0)
            go = gr.Button("Speak as it is typed", variant="primary", elem_id="bistream-go")
        status = gr.Markdown("", label="status", elem_id="bistream-status")
        audio = gr.Audio(label="speech", type="numpy", interactive=False)
        # show_label=False: the figure has its own title, which a Gradio label would cover
        timeline = gr.Plot(label="chunk timeline", show_label=False, elem_id="bistream-plot")

        def speak(text: str, words_per_second: float, max_tokens: float | None) -> Iterator[tuple[str, Any, Any]]:
            """Feed ``text`` to one bi-streaming request, ``words_per_second`` pieces a second; returns (status,
            speech (rate, samples) at the end, chunk timeline)."""
            try:
                yield from type_as_you_go(service, text, words_per_second, max_tokens)
            except ValueError as e:  # a user's mistake: one message in the status line, no red "Error" pills
                yield f"Not spoken: {e}", gr.skip(), gr.skip()

        go.click(speak, [text, rate, cap], [status, audio, timeline], api_name="type_as_you_go")
