"""The app's "type as you go" demo: the text box's words are fed to a bi-streaming request at a chosen pace,
as a voice agent's LLM would write them, and the chunk timeline shows when each piece arrived against the audio.

Kept out of ``webui.py`` (which only calls :func:`bistream_tab`): widgets, one handler, no model code.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cosyvoice_fast.app import dashboard as db
from cosyvoice_fast.frontend.request import SynthesisRequest

DEFAULT_PROMPT = Path(__file__).resolve().parents[2] / "assets" / "cross_lingual_prompt.wav"


def words_at(text: str, words_per_second: float) -> Iterator[str]:
    """``text`` word by word (each with its following space), one every ``1 / words_per_second`` s."""
    if not 0 < words_per_second <= 100:
        raise ValueError(f"words per second = {words_per_second!r}: choose 0.5 to 100")
    words = text.split(" ")
    for i, w in enumerate(words):
        if i:
            time.sleep(1.0 / words_per_second)
        yield w + (" " if i < len(words) - 1 else "")


def type_as_you_go(service: Any, text: str, words_per_second: float, max_tokens: float | None = None,
                   seed: int = 0) -> Iterator[tuple[str, Any, Any]]:
    """Handler: (status, audio (rate, samples) or None, chunk timeline) as the request runs; the audio comes
    whole at the end, the status after every chunk."""
    if not text.strip():
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
    yield status, (service.engine.sample_rate, audio), db.chunk_timeline_figure(tele, "Type as you go")


def bistream_tab(service: Any, default_text: str = "", default_cap: int = 0) -> None:
    """The "Type as you go" tab (call inside the app's ``gr.Blocks``)."""
    import gradio as gr

    with gr.Tab("Type as you go"):
        gr.Markdown("The words of the text box reach the speech LM one by one at the pace below, as an agent's "
                    "LLM writes them; audio starts before the text is complete.")
        text = gr.Textbox(default_text, label="Text (fed word by word)", lines=3, elem_id="bistream-text")
        with gr.Row():
            rate = gr.Slider(0.5, 20, value=4, step=0.5, label="Words per second", elem_id="bistream-rate")
            cap = gr.Number(default_cap or None, label="Max speech tokens (empty: until the LM stops)",
                            precision=0)
            go = gr.Button("Speak as it is typed", variant="primary", elem_id="bistream-go")
        status = gr.Markdown("")
        audio = gr.Audio(label="Speech", type="numpy", interactive=False)
        timeline = gr.Plot(label="Chunk timeline with text arrivals")
        go.click(lambda t, r, c: (yield from type_as_you_go(service, t, r, c)), [text, rate, cap],
                 [status, audio, timeline], api_name="type_as_you_go")
