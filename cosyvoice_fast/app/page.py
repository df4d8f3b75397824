"""The Gradio layout and its event wiring (the behaviour is in :mod:`cosyvoice_fast.app.handlers`).

``build_demo(service)`` returns the ``gr.Blocks``; ``serve(demo, ...)`` turns on the queue and the serving limits
and launches it (used by ``app.py`` and by the tests).  Gradio serves only its own cache (uploads, generated
audio): no ``allowed_paths`` are added, so no file of the host can be fetched through the app.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import gradio as gr

from cosyvoice_fast.app import dashboard as db, tables
from cosyvoice_fast.frontend.request import MODE_LABELS
from cosyvoice_fast.serving.http import api_store
from cosyvoice_fast.app.handlers import CONFIG_FIELDS, VOICE_FIELDS, Handlers, random_seed
from cosyvoice_fast.app.inputs import field_dropdown, field_number, field_radio, field_slider
from cosyvoice_fast.app.player import PLAYER_CSS, PLAYER_HTML, PLAYER_JS, STOP_JS, ab_click_js, click_js
from cosyvoice_fast.app.bistream import bistream_tab
from cosyvoice_fast.app.queue import count_input_refusals

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MAX_UPLOAD = "10mb"
CSS = """
#banner {background:#fff4e5; border:1px solid #f0a35e; border-radius:8px; padding:6px 14px}
#header h2 {margin-bottom:4px}
.tip {font-size:0.85em; color:#666}
"""
TIPS = {
    "incremental_flow": "Streaming chunks reuse the flow's keys/values of the frames already made (and of the "
                        "voice's prompt, cached per voice), so each chunk costs its own frames instead of the "
                        "whole prefix. Off = upstream's full recompute per chunk (same audio to float rounding; "
                        "eager, cudagraph and fused flows; fused streams a voice incrementally from its third "
                        "request on; TensorRT always recomputes).",
    "token_hop_len_first": "Tokens in the first chunk. Fewer: first audio sooner (less LM decoding before the first "
                           "flow call) but a short first chunk with less context. 25 = upstream (padded so prompt + "
                           "chunk fills whole 25-token attention chunks).",
    "token_hop_len": "Tokens in the second chunk; each later one grows by stream_scale_factor up to 100. Smaller: "
                     "more, shorter flow/vocoder calls (more overhead per second of audio, more underrun risk).",
    "pre_lookahead_len": "Future tokens each chunk waits for before running. Fewer: every chunk is ready sooner; but "
                         "the flow encoder was trained with 3, so chunk edges may sound worse.",
    "stream_scale_factor": "How fast chunks grow. Larger: fewer flow calls and less overhead overall, but later "
                           "chunks need more tokens before they can run. 1 keeps every chunk the same size.",
    "max_tokens": "Cap on speech tokens per text segment (25 tokens = 1 s). 0 = until the LM emits end-of-speech. "
                  "Random-weight models rarely stop on their own: keep a cap there.",
}
MODE_SHOWS = {  # mode -> visible (upload, mic, transcript, instruction, speaker)
    "zero_shot": (True, True, True, False, False), "cross_lingual": (True, True, False, False, False),
    "instruct2": (True, True, False, True, False), "speaker": (False, False, False, False, True),
}


def load_examples(path: Path = ASSETS / "examples.json") -> list[dict[str, Any]]:
    """Example prompts from ``assets/examples.json`` (wav names resolved inside ``assets/``; missing ones skipped)."""
    if not path.is_file():
        return []
    out = []
    for ex in json.loads(path.read_text(encoding="utf-8")):
        wav = path.parent / ex["prompt_wav"] if ex.get("prompt_wav") else None
        if wav is None or wav.is_file():
            out.append({**ex, "prompt_wav": str(wav) if wav else None})
    return out


def config_panel(h: Handlers, *, hop_first: int = 25, lookahead: int = 3, max_tokens: int = 0,
                 backend: str | None = None, key: str = "") -> list[Any]:
    """Tuning sliders + backend per stage + dtype, in the order of ``CONFIG_FIELDS``."""
    comps = [
        field_slider(1, 100, hop_first, field="token_hop_len_first", label="token_hop_len_first",
                     info=TIPS["token_hop_len_first"]),
        field_slider(1, 200, 25, field="token_hop_len", label="token_hop_len", info=TIPS["token_hop_len"]),
        field_slider(0, 3, lookahead, field="pre_lookahead_len", label="pre_lookahead_len",
                     info=TIPS["pre_lookahead_len"]),
        field_slider(1.0, 4.0, 2.0, step=0.5, field="stream_scale_factor", label="stream_scale_factor",
                     info=TIPS["stream_scale_factor"]),
        field_slider(0, 2000, max_tokens, step=5, field="max_tokens", label="max speech tokens",
                     info=TIPS["max_tokens"]),
    ]
    with gr.Row():
        for stage in ("llm", "flow", "vocoder"):
            choices, note = h.backend_choices(stage)
            unavailable = {b.name: b.reason for b in h.backends if b.stage == stage and not b.available}
            if stage == "flow":  # the incremental_flow checkbox is how incremental is chosen, not a backend
                choices = [c for c in choices if c != "incremental"]
                unavailable["incremental"] = ("it is not a separate backend: use flow='eager' with "
                                              "incremental_flow=True")
            value = backend if backend in choices else "eager"
            comps.append(field_dropdown(choices, field=stage, unavailable=unavailable, value=value,
                                        label=f"{stage} backend", info=note,
                                        elem_id=f"{key}{stage}-backend" if key else None))
        dtypes, note = h.dtype_choices()
        # the fast backends are meant to run in bf16; the eager reference keeps the first choice (fp32)
        dtype = "bf16" if backend and backend != "eager" and "bf16" in dtypes else dtypes[0]
        comps.append(field_dropdown(dtypes, field="dtype", value=dtype, label="dtype", info=note,
                                    unavailable={d: note for d in ("fp32", "bf16", "fp16") if d not in dtypes}))
    comps.append(gr.Checkbox(True, label="incremental flow", info=TIPS["incremental_flow"]))
    return comps


def named(fn: Any, names: Sequence[str], with_request: bool = False) -> Any:
    """``fn(*values)`` with a signature naming each input, so the API page and gradio_client show real names.
    ``with_request``: Gradio also passes its ``gr.Request`` (last), handed to ``fn`` as ``request=``.

    Every parameter defaults to None: ``view_api()`` then shows an input without an initial value (microphone,
    instruction, saved speaker) as not required, as it is; one that a mode needs is refused by the handler with a
    message saying so.  Inputs with an initial value show that value as their default."""
    n = len(names)
    if inspect.isgeneratorfunction(fn):
        def wrapper(*values: Any) -> Any:
            if with_request:
                yield from fn(*values[:n], request=values[n] if len(values) > n else None)
            else:
                yield from fn(*values)
    else:
        def wrapper(*values: Any) -> Any:
            if with_request:
                return fn(*values[:n], request=values[n] if len(values) > n else None)
            return fn(*values)
    params = [inspect.Parameter(x, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for x in names]
    if with_request:
        params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                        annotation=gr.Request))
    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    # Gradio finds the gr.Request parameter through the type hints (``__annotations__``), not the signature
    wrapper.__annotations__ = {"request": gr.Request} if with_request else {}
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _mode_visibility(mode: str) -> list[dict]:
    return [gr.update(visible=v) for v in MODE_SHOWS.get(mode, MODE_SHOWS["zero_shot"])]


def build_demo(service: Any) -> gr.Blocks:
    """The whole UI for one loaded service."""
    can_stream = shutil.which("ffmpeg") is not None  # Gradio encodes streamed audio with ffmpeg
    h = Handlers(service, stream_audio=can_stream)
    api_store(service)  # the page's API requests and this app's events share one request store
    examples = load_examples()
    default_cap = 150 if service.synthetic else 0
    fast = next((n for n in ("cudagraph",) if n in h.backend_choices("flow")[0]), None)
    with gr.Blocks(title="cosyvoice_fast", analytics_enabled=False, delete_cache=(1800, 3600)) as demo:
        gr.Markdown(h.header_markdown(), elem_id="header")
        if service.synthetic or service.frontend is None:
            gr.Markdown(service.banner, elem_id="banner")
        startup = getattr(service, "startup", None)  # engine.startup.StartupProgress: phase, graphs N/M, estimate
        if startup is not None and startup.line():
            starting = gr.Markdown(startup.line(), elem_id="startup")
            ticker = gr.Timer(2.0)
            ticker.tick(lambda: (startup.line(), gr.Timer(active=not startup.settled)), None, [starting, ticker],
                        api_visibility="private", queue=False)
        history = gr.State([])
        first = examples[0] if examples else {}
        start_mode = first.get("mode") or "zero_shot"
        shows = MODE_SHOWS.get(start_mode, MODE_SHOWS["zero_shot"])
        # the first example (English: Debian's chromium has no CJK font) and its voice's transcript, where one
        # example gives it, for the zero-shot mode
        transcript = next((e["prompt_text"] for e in examples
                           if e["prompt_wav"] == first.get("prompt_wav") and e["prompt_text"]), "")
        with gr.Tab("Synthesize"):
            with gr.Row():
                with gr.Column(scale=3):
                    text = gr.Textbox(first.get("text", ""), label="Text to speak", lines=3,
                                      max_lines=12, elem_id="tts-text")
                    mode = field_radio([(lab, k) for k, lab in MODE_LABELS.items()], field="mode",
                                       value=start_mode, label="Mode")
                    with gr.Row():
                        # no initial value: the API then shows no default file (it showed Gradio's sample URL);
                        # the page still opens with the first example's voice (demo.load below)
                        upload = gr.Audio(None, sources=["upload"], elem_id="prompt-upload", visible=shows[0],
                                          type="filepath", label="Prompt voice: upload (3–30 s)")
                        mic = gr.Audio(sources=["microphone"], type="filepath", label="…or record", visible=shows[1])
                    prompt_text = gr.Textbox(transcript, label="Prompt transcript", visible=shows[2],
                                             info="exactly what is said in the prompt")
                    instruct = gr.Textbox("", label="Instruction", visible=shows[3],
                                          placeholder="e.g. Speak slowly, in a calm voice.")
                    speaker = gr.Dropdown(h.speaker_names(), value=None, label="Saved speaker", visible=shows[4])
                    with gr.Accordion("Saved voices", open=False):
                        with gr.Row():
                            save_name = gr.Textbox(label="Save this voice as…", placeholder="name", scale=3)
                            save_btn = gr.Button("Save voice", scale=1)
                            del_btn = gr.Button("Delete selected speaker", scale=1)
                    with gr.Row():
                        seed = field_number(0, field="seed", minimum=0, maximum=2**63 - 1, label="Seed", scale=2,
                                            elem_id="seed",
                                            info="same seed + same inputs = same audio")
                        dice = gr.Button("New seed", scale=0, min_width=120, elem_id="dice")
                        stream = gr.Checkbox(True, label="Stream", scale=1)
                        speed = field_slider(0.5, 2.0, 1.0, step=0.05, field="speed",
                                             label="Speed (only without streaming)",
                                             interactive=False, scale=3)
                with gr.Column(scale=2):
                    with gr.Accordion("Tuning: chunking, backends, dtype", open=True):
                        cfg = config_panel(h, max_tokens=default_cap, backend=fast)  # GPU: fastest by default
            with gr.Row():
                run_btn = gr.Button("Synthesize", variant="primary", elem_id="synthesize-btn", scale=3)
                stop_btn = gr.Button("Stop", variant="stop", scale=1, elem_id="stop-btn")
            if examples:
                gr.Examples([[e["text"], e["mode"], e["prompt_wav"], e["prompt_text"], e["instruct_text"]]
                             for e in examples], [text, mode, upload, prompt_text, instruct],
                            example_labels=[e["label"] for e in examples], label="Examples")
            gr.HTML(PLAYER_HTML, elem_id="player")  # the stream's player: pause, progress, volume
            client_rid = gr.Textbox("", visible=False, label="client request id")
            with gr.Row():
                # gradio_client users get the stream here; the page plays it through Web Audio instead
                stream_out = gr.Audio(label="Streaming output (API clients)", streaming=can_stream,
                                      autoplay=False, interactive=False, elem_id="stream-audio", visible=False)
                full_out = gr.Audio(label="Full utterance (wav download)", type="numpy", format="wav",
                                    interactive=False, buttons=["download"], elem_id="full-audio")
            status = gr.Markdown("", elem_id="status", label="status")  # the run's one status line
            with gr.Row():
                # show_label=False: each figure carries its own title (a Gradio label would cover it)
                ttfb_plot = gr.Plot(db.ttfb_figure(None), show_label=False, label="Time to first audio",
                                    elem_id="ttfb-plot", scale=3)
                summary = gr.Dataframe(headers=tables.SUMMARY_HEADERS, label="Summary", interactive=False, scale=2,
                                       wrap=True, column_widths=["28%", "18%", "54%"], elem_id="summary")
            timeline = gr.Plot(db.chunk_timeline_figure(None), show_label=False, label="Chunk timeline",
                               elem_id="timeline-plot")
            hist_plot = gr.Plot(db.history_figure([]), show_label=False, label="Run history", elem_id="history-plot")
            clear_btn = gr.Button("Clear history", size="sm")
            with gr.Accordion("Raw telemetry of the last run (JSON)", open=False):
                raw = gr.JSON(label="telemetry")
        bistream_tab(service, first.get("text", ""), default_cap)  # text arrives word by word
        with gr.Tab("A/B"):
            gr.Markdown("The text, voice, seed and streaming choice of the *Synthesize* tab, through two "
                        "configurations one after the other: hear and see what a backend or a parameter changes. "
                        "The prompt voice is analysed once beforehand, so A and B both find it in the frontend's "
                        "cache and their frontend times are comparable.")
            with gr.Row():
                with gr.Column():
                    gr.Markdown("### A")
                    cfg_a = config_panel(h, max_tokens=default_cap, key="a-")
                with gr.Column():
                    gr.Markdown("### B")
                    cfg_b = config_panel(h, max_tokens=default_cap, key="b-", backend=fast,
                                         hop_first=25 if fast else 10, lookahead=3 if fast else 1)
            ab_btn = gr.Button("Run A then B", variant="primary", elem_id="ab-btn")
            with gr.Row():
                audio_a = gr.Audio(label="A", type="numpy", format="wav", interactive=False)
                audio_b = gr.Audio(label="B", type="numpy", format="wav", interactive=False)
            ab_ttfb = gr.Plot(db.ttfb_figure(None), show_label=False, label="TTFB, A vs B",
                              elem_id="ab-ttfb-plot")
            with gr.Row():
                tl_a = gr.Plot(db.chunk_timeline_figure(None), show_label=False, label="A: chunks")
                tl_b = gr.Plot(db.chunk_timeline_figure(None), show_label=False, label="B: chunks")
            diff = gr.Dataframe(headers=tables.AB_HEADERS, label="Difference (B − A)", interactive=False)
            ab_status = gr.Markdown("", elem_id="ab-status", label="status")

        voice = [text, mode, upload, mic, prompt_text, instruct, speaker, seed, stream, speed]
        run_names = VOICE_FIELDS + CONFIG_FIELDS + ("history", "client_request_id")
        run_btn.click(named(h.synthesize, run_names, with_request=True), voice + cfg + [history, client_rid],
                      [stream_out, full_out, ttfb_plot, timeline, hist_plot, summary, status, raw, history],
                      api_name="synthesize", show_progress="minimal", js=click_js(run_names))
        # Stop aborts the page's stream and cancels the engine request; the run then ends as "stopped" with the
        # audio so far and a history entry (Gradio's cancels= would kill the event before it could say so)
        stop_heard = gr.Number(None, visible=False, label="heard at Stop (s)")
        stop_received = gr.Number(None, visible=False, label="received at Stop (s)")
        stop_btn.click(h.stop, [client_rid, stop_heard, stop_received], status, js=STOP_JS, queue=False,
                       api_visibility="private")
        ab_fields = (VOICE_FIELDS + tuple(f"a_{n}" for n in CONFIG_FIELDS) + tuple(f"b_{n}" for n in CONFIG_FIELDS)
                     + ("client_request_ids",))
        ab_rids = gr.Textbox("", visible=False, label="client request ids")
        ab_btn.click(named(h.ab, ab_fields), voice + cfg_a + cfg_b + [ab_rids],
                     [audio_a, audio_b, ab_ttfb, tl_a, tl_b, diff, ab_status], api_name="ab",
                     js=ab_click_js(ab_fields, VOICE_FIELDS, CONFIG_FIELDS))
        clear_btn.click(h.clear_history, None, [hist_plot, history], api_visibility="private", queue=False)
        dice.click(random_seed, None, seed, api_name="random_seed", queue=False)
        save_btn.click(named(h.save_speaker, ("name", "prompt_upload", "prompt_mic", "prompt_text")),
                       [save_name, upload, mic, prompt_text], speaker, api_name="save_speaker")
        del_btn.click(named(h.delete_speaker, ("speaker",)), [speaker], speaker, api_name="delete_speaker")
        mode.change(_mode_visibility, mode, [upload, mic, prompt_text, instruct, speaker], queue=False,
                    api_visibility="private")
        stream.change(lambda s: gr.update(interactive=not s, value=1.0), stream, speed, queue=False,
                      api_visibility="private")
        demo.load(h.refresh_speakers, None, speaker, api_visibility="private")
        if examples and examples[0]["prompt_wav"]:
            first_voice = gr.Audio(examples[0]["prompt_wav"], type="filepath", render=False).value["path"]
            demo.load(lambda: first_voice, None, upload, api_visibility="private", queue=False)
    h.blocks = demo
    count_input_refusals(demo, getattr(service, "metrics", None))
    demo.cosyvoice_service = service  # read by serve() to mount /health and /metrics
    return demo


def serve(demo: gr.Blocks, *, host: str = "127.0.0.1", port: int | None = 7860, share: bool = False,
          auth: tuple[str, str] | None = None, concurrency: int = 4, max_queue: int = 32,
          max_file_size: str | int = MAX_UPLOAD, prevent_thread_lock: bool = False, quiet: bool = False,
          service: Any = None) -> Any:
    """Queue with a concurrency limit and a bounded size (excess users are told the queue is full), an upload
    size limit, and no extra served paths.  ``GET /health`` (readiness JSON) and ``GET /metrics`` (Prometheus) of
    the service are mounted beside the UI (see :mod:`cosyvoice_fast.serving.metrics`); they need no login.  The ``/v1``
    HTTP API (:mod:`cosyvoice_fast.serving.http`) is mounted behind the same ``auth`` as the page."""
    from cosyvoice_fast.serving.metrics import http_routes

    service = service if service is not None else getattr(demo, "cosyvoice_service", None)
    app_kwargs = {"routes": http_routes(service)} if service is not None else {}
    demo.queue(default_concurrency_limit=concurrency, max_size=max_queue)
    out = demo.launch(server_name=host, server_port=port, share=share, auth=auth, max_file_size=max_file_size,
                      prevent_thread_lock=True, quiet=quiet, show_error=True, ssr_mode=False,
                      theme=gr.themes.Soft(), css=CSS + PLAYER_CSS, head=PLAYER_JS, footer_links=["api"],
                      app_kwargs=app_kwargs)
    if service is not None:  # the OpenAI-compatible /v1 API, behind the same login as the page
        from cosyvoice_fast.serving.http import mount_api

        mount_api(demo.app, service, auth=auth)
    if not prevent_thread_lock:
        demo.block_thread()
    return out
