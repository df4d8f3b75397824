"""What the app's buttons do: widget values -> :class:`SynthesisRequest`, engine chunks -> streamed audio plus live
dashboard figures, A/B pairs, saved voices.

No layout here (that is :mod:`cosyvoice_fast.app.page`) and no model code: everything goes through the engine and the
frontend of a loaded :class:`~cosyvoice_fast.serving.service.Service`.  A user mistake (empty text, unreadable prompt,
prompt too long, parameter out of range, backend unavailable here) becomes a ``gr.Error`` whose text is the
library's own message; the server keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from typing import Any, Callable, Iterator, Sequence

import gradio as gr
import numpy as np

from cosyvoice_fast.app import dashboard as db, tables
from cosyvoice_fast.engine.stages import available_backends, family_of_models
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.engine import EngineClosed
from cosyvoice_fast.frontend.request import MODE_LABELS, SynthesisRequest
from cosyvoice_fast.serving.http import api_store
from cosyvoice_fast.telemetry.request_log import log_refused
from cosyvoice_fast.telemetry.record import RequestTelemetry
from cosyvoice_fast.app.messages import SHUTTING_DOWN, user_error, user_message
from cosyvoice_fast.app.queue import gradio_queue_wait, set_app_queue
from cosyvoice_fast.app.voices import SavedVoices
from cosyvoice_fast.serving.store import engine_record

log = logging.getLogger(__name__)

VOICE_FIELDS = ("text", "mode", "prompt_upload", "prompt_mic", "prompt_text", "instruct_text", "speaker", "seed",
                "stream", "speed")
CONFIG_FIELDS = ("token_hop_len_first", "token_hop_len", "pre_lookahead_len", "stream_scale_factor", "max_tokens",
                 "llm", "flow", "vocoder", "dtype", "incremental_flow")
STAGE_NAMES = ("llm", "flow", "vocoder")
MAX_HISTORY = 200
FOLLOW_TIMEOUT_S = 15.0  # the page's API request reaches the server at the same time as this event
HEARD_WAIT_S = 1.0  # at the end, how long to wait for the page's "heard at" report
# Drawing a chunk's dashboard holds the GIL for ~60 ms of Python (Plotly figures; measured on CPU): done the moment
# the first chunk exists it delayed the first bytes of the page's own audio stream, served by this process.  The
# first update waits (at most this long) until the page says its first bytes arrived.
FIRST_AUDIO_WAIT_S = 0.5


def pcm16(x: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16.  Converting here keeps Gradio from peak-normalising each chunk on its own, which
    would make the streamed chunks jump in loudness."""
    return (np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


def random_seed() -> int:
    return secrets.randbelow(2**31)


class Handlers(SavedVoices):
    """Event handlers bound to one loaded service (shared by all sessions; per-session data lives in gr.State)."""

    def __init__(self, service: Any, stream_audio: bool = True):
        self.service = service
        self.stream_audio = stream_audio  # False without ffmpeg: Gradio cannot encode a stream, audio comes whole
        self.engine = service.engine
        self.frontend = service.frontend
        self.device = service.models.device
        self.family = family_of_models(service.models)  # which model family is loaded (the header shows it)
        self.backends = available_backends(self.device, family=self.family)
        self.blocks: Any = None  # the gr.Blocks (set by build_demo): its queue tells how long events waited

    # ------------------------------------------------------------------------------------------ header
    def backend_choices(self, stage: str) -> tuple[list[str], str]:
        """Backends of ``stage`` that can run here, and a note naming the others with the reason."""
        ok = [b.name for b in self.backends if b.stage == stage and b.available]
        why: dict[str, list[str]] = {}
        for b in self.backends:
            if b.stage == stage and not b.available:
                why.setdefault(b.reason, []).append(b.name)
        off = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in why.items())
        return ok, f"unavailable here: {off}" if off else "all backends available"

    def dtype_choices(self) -> tuple[list[str], str]:
        if self.device.type == "cpu":
            return ["fp32"], "fp16/bf16 need a CUDA GPU (this engine runs on CPU)"
        return ["fp32", "bf16", "fp16"], "bf16/fp16 cast the LM and flow (HiFT stays fp32)"

    def header_markdown(self) -> str:
        svc = self.service
        dtype = str(svc.models.dtype).replace("torch.", "")
        fe = "yes" if self.frontend is not None else "no (prompt voices disabled)"
        rows = "\n".join(f"| {b.stage} | `{b.name}` | {'yes' if b.available else 'no'} | "
                         f"{'; '.join(x for x in (b.reason, b.note) if x)} |" for b in self.backends)
        no_ff = "" if self.stream_audio else (" · **ffmpeg not found**: audio plays when complete, not "
                                              "streamed (install ffmpeg)")
        title = {"cosyvoice2": "CosyVoice2", "cosyvoice3": "CosyVoice3"}.get(self.family, self.family)
        return (f"## cosyvoice_fast · streaming {title}\n"
                f"**model** `{svc.model_name}` · **family** `{self.family}` · "
                f"**device** `{self.device}` · **dtype** `{dtype}` · "
                f"**frontend** {fe} · **sample rate** {self.engine.sample_rate} Hz{no_ff}\n\n"
                f"<details><summary>backends on this machine</summary>\n\n| stage | backend | available | why not |\n"
                f"|---|---|---|---|\n{rows}\n</details>")

    # ------------------------------------------------------------------------------------------ requests
    def request_from(self, voice: dict[str, Any], cfg: dict[str, Any]) -> SynthesisRequest:
        """Check what the widgets hold and build the request; any problem is a gr.Error the user can act on."""
        text = (voice.get("text") or "").strip()
        if not text:
            raise user_error("Text is empty: type something to synthesise.")
        mode = voice.get("mode") or "zero_shot"
        wav = voice.get("prompt_upload") or voice.get("prompt_mic")
        if mode != "speaker" and wav is None:
            raise user_error(f"Mode '{MODE_LABELS.get(mode, mode)}' needs a prompt voice: upload or record one "
                           "(or pick the 'saved speaker' mode).")
        if mode == "zero_shot" and not (voice.get("prompt_text") or "").strip():
            raise user_error("Zero-shot needs the prompt's transcript (what is said in the prompt audio); "
                           "without one use cross-lingual mode.")
        if mode == "instruct2" and not (voice.get("instruct_text") or "").strip():
            raise user_error("Instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'")
        if mode == "speaker" and not voice.get("speaker"):
            raise user_error("Pick a saved speaker first (save one from a prompt voice under 'Saved voices').")
        try:
            seed = int(voice.get("seed") or 0)
            max_tokens = int(cfg.get("max_tokens") or 0) or None
            params = StreamParams(token_hop_len_first=int(cfg["token_hop_len_first"]),
                                  token_hop_len=int(cfg["token_hop_len"]),
                                  pre_lookahead_len=int(cfg["pre_lookahead_len"]),
                                  stream_scale_factor=float(cfg["stream_scale_factor"]),
                                  token_max_hop_len=max(100, int(cfg["token_hop_len"])))
            backend = BackendConfig(llm=cfg["llm"], flow=cfg["flow"], vocoder=cfg["vocoder"], dtype=cfg["dtype"],
                                    incremental=bool(cfg.get("incremental_flow", True)))
            return SynthesisRequest(
                text=text, mode=mode, prompt_wav=wav if mode != "speaker" else None,
                prompt_text=(voice.get("prompt_text") or "").strip() if mode == "zero_shot" else "",
                instruct_text=(voice.get("instruct_text") or "").strip() if mode == "instruct2" else "",
                speaker=voice.get("speaker") if mode == "speaker" else None, seed=seed,
                stream=bool(voice.get("stream")), stream_params=params, backend=backend,
                speed=float(voice.get("speed") or 1.0), max_tokens=max_tokens)
        except (ValueError, TypeError, KeyError) as e:
            raise user_error(user_message(e)) from e

    def _checked_request(self, voice: dict[str, Any], cfg: dict[str, Any]) -> SynthesisRequest:
        """:meth:`request_from`, counting a refusal in the service's metrics (the engine never sees it)."""
        try:
            return self.request_from(voice, cfg)
        except gr.Error as e:
            metrics = getattr(self.service, "metrics", None)
            if metrics is not None:
                metrics.count_rejected()
            log_refused(secrets.token_hex(6), str(voice.get("mode") or "-"), len(str(voice.get("text") or "")),
                        str(e.message))
            raise

    def _open(self, req: SynthesisRequest, app_queue_s: float = 0.0) -> Any:
        """Start the request: the frontend runs here, so prompt problems surface before any audio.
        ``app_queue_s``: how long the event waited in Gradio's queue (a TTFB stage)."""
        try:
            stream = self.engine.stream(req)
            set_app_queue(stream, app_queue_s)
            return stream
        except EngineClosed as e:
            raise user_error(SHUTTING_DOWN) from e
        except (ValueError, RuntimeError) as e:  # frontend validation, ConfigError, BackendUnavailable, engine full
            raise user_error(user_message(e)) from e
        except Exception as e:  # anything else (OSError, ...): a message without server paths, never a raw trace
            log.exception("request %s failed before synthesis", req.request_id)
            raise user_error(f"could not start synthesis: {user_message(e)}") from e

    def _source(self, voice: dict[str, Any], cfg: dict[str, Any], rid: str,
                request: Any) -> tuple[Iterator[Any], Callable[[], RequestTelemetry | None], Callable[[], str]]:
        """Where this run's chunks come from: the page's own API request ``rid`` (the page plays it through Web
        Audio; this event only draws the dashboard) or, without one (gradio_client, no JavaScript), a request
        run here.  Returns (chunks, the engine's live record, the outcome so far)."""
        if rid:
            self.request_from(voice, cfg)  # same checks and messages as a direct run; the API counts refusals
            store = api_store(self.service)
            try:
                chunks = store.follow(rid, start_timeout=FOLLOW_TIMEOUT_S)
                first = next(chunks, None)
            except TimeoutError as e:
                raise user_error(f"the page's audio request did not reach the server: {e}") from e
            live = store.get(rid)
            if first is None and live is not None and live.outcome in ("rejected", "error"):
                raise user_error(user_message(RuntimeError(live.error or "the request failed")))
            return (itertools.chain([first] if first is not None else [], chunks),
                    lambda: live.partial() if live is not None else None,
                    lambda: (live.outcome or "running") if live is not None else "error")
        req = self._checked_request(voice, cfg)
        stream = self._open(req, app_queue_s=gradio_queue_wait(request, self.blocks))
        state = {"outcome": "running"}

        def chunks() -> Iterator[Any]:
            got_last = False
            try:
                for ch in stream:
                    got_last = got_last or ch.is_last
                    yield ch
            finally:
                stream.close()  # cancels the engine request if the user pressed Stop or left
                state["outcome"] = "ok" if got_last else "cancelled"

        return chunks(), lambda: engine_record(stream), lambda: state["outcome"]

    def stop(self, rid: str | None, heard_s: float | None = None, received_s: float | None = None) -> Any:
        """Stop button: cancel the page's current request (the page also aborts its audio fetch and stops playing).
        ``heard_s``: the audio the listener had heard, from the page's player clock at the moment of Stop, and
        ``received_s`` what had reached the page; the status line reports those, not the engine's count, which runs
        ahead of playback.  Returns the status line (the run's own event may already have ended)."""
        if not rid:
            return gr.skip()
        heard = float(heard_s) if heard_s is not None and heard_s >= 0 else None
        if heard is not None:
            api_store(self.service).report_client(rid, {"stop_heard_s": heard})
        api_store(self.service).cancel(rid)  # only a request this page's session (or the id's bearer) owns
        if heard is None:
            return gr.skip()
        return tables.stopped_line(heard, float(received_s or 0.0), verb="received")

    # ------------------------------------------------------------------------------------------ synthesis
    def split(self, values: Sequence[Any], *groups: Sequence[str]) -> list[dict[str, Any]]:
        out, i = [], 0
        for names in groups:
            out.append(dict(zip(names, values[i:i + len(names)])))
            i += len(names)
        return out + [list(values[i:])]

    def synthesize(self, *values: Any, request: Any = None) -> Iterator[tuple]:
        """Stream one request: yields (audio chunk, full wav, TTFB fig, timeline fig, history fig, summary, status,
        telemetry json, history state) with each chunk; the full wav, history and raw telemetry come at the end.
        A Stop ends the run as "stopped" with the audio so far and a history entry."""
        voice, cfg, rest = self.split(values, VOICE_FIELDS, CONFIG_FIELDS)
        history = list(rest[0] or []) if rest else []
        rid = str(rest[1] or "") if len(rest) > 1 else ""
        skip = gr.skip()
        try:
            chunks, record, outcome = self._source(voice, cfg, rid, request)
        except gr.Error as e:
            if not rid:  # gradio_client: the error is the answer
                raise
            # the page: one message in the status line, no toast and no red "Error" over every output
            yield (skip,) * 6 + (f"Not synthesised: {e.message}",) + (skip,) * 2
            return
        sr = self.engine.sample_rate
        parts: list[np.ndarray] = []
        try:
            for ch in chunks:
                parts.append(ch.samples)
                if rid and len(parts) == 1:  # the page's first audio before the first figures (see FIRST_AUDIO_WAIT_S)
                    api_store(self.service).wait_client(rid, "first_byte_ms", FIRST_AUDIO_WAIT_S)
                tele = self._with_client(record(), rid)
                status = (f"streaming… chunk {ch.index + 1}, {sum(map(len, parts)) / sr:.2f} s of audio, "
                          f"first audio after {tele['derived']['ttfb_ms'] or 0:.0f} ms")
                audio = (sr, pcm16(ch.samples)) if self.stream_audio and not rid else skip
                yield (audio, skip, db.ttfb_figure(tele), db.chunk_timeline_figure(tele), skip,
                       tables.summary_rows(tele), status, skip, skip)
        except gr.Error:
            raise
        except EngineClosed as e:  # shutdown: every open stream ends with this message, not a hang
            raise user_error(SHUTTING_DOWN) from e
        except Exception as e:  # a failure inside the engine: report it, keep serving
            log.exception("request %s failed", rid or "(app)")
            raise user_error(f"synthesis failed: {user_message(e)}") from e
        if not parts:
            raise user_error("stopped before the first audio chunk" if outcome() == "cancelled"
                             else "the engine produced no audio for this request")
        wav = np.concatenate(parts)
        tele = self._with_client(record(), rid, wait_s=HEARD_WAIT_S)
        history = (history + [db.history_record(tele, len(history) + 1)])[-MAX_HISTORY:]
        rows = tables.summary_rows(tele)
        status = tables.status_line(tele, outcome())
        # streamed to a gradio_client: None ends the stream (the client's result is then the stream's file, not
        # a raw {'__type__': 'update'}); not streamed: the whole utterance; the page: its player has it
        last = skip if rid else None if self.stream_audio else (sr, pcm16(wav))
        yield (last, (sr, pcm16(wav)), db.ttfb_figure(tele),
               db.chunk_timeline_figure(tele), db.history_figure(history), rows, status, tele, history)

    def _with_client(self, tele: RequestTelemetry | None, rid: str, wait_s: float = 0.0) -> dict[str, Any]:
        """The record's JSON plus what the page measured (``client.heard_ms``), waiting up to ``wait_s`` for it."""
        d = tele.to_dict() if tele is not None else {"chunks": [], "derived": {}}
        if rid:
            store = api_store(self.service)
            if wait_s:
                store.wait_client(rid, "heard_ms", wait_s)
            live = store.get(rid)
            d["client"] = dict(live.client) if live is not None else {}
        return d

    def clear_history(self) -> tuple:
        return db.history_figure([]), []

    def _whole(self, req: SynthesisRequest) -> tuple[np.ndarray, RequestTelemetry]:
        chunks = self._open(req)
        parts, tele = [], None
        try:
            for ch in chunks:
                parts.append(ch.samples)
                tele = ch.telemetry or tele
        except EngineClosed as e:
            raise user_error(SHUTTING_DOWN) from e
        except Exception as e:
            log.exception("request %s failed", req.request_id)
            raise user_error(f"synthesis failed: {user_message(e)}") from e
        finally:
            chunks.close()
        if tele is None or not parts:
            raise user_error("the engine produced no audio for this request")
        return np.concatenate(parts), tele

    def _followed(self, rid: str, start_timeout: float) -> tuple[np.ndarray, dict[str, Any]]:
        """The whole audio of the page's API request ``rid`` and its record with the page's figures."""
        store = api_store(self.service)
        try:
            parts = [ch.samples for ch in store.follow(rid, start_timeout=start_timeout)]
        except TimeoutError as e:
            raise user_error(f"the page's audio request did not reach the server: {e}") from e
        live = store.get(rid)
        if not parts:
            outcome = live.outcome if live is not None else "error"
            raise user_error("stopped before the first audio chunk" if outcome == "cancelled"
                           else user_message(RuntimeError(live.error if live is not None and live.error
                                                          else "the engine produced no audio for this request")))
        return np.concatenate(parts), self._with_client(live.partial() if live else None, rid, wait_s=HEARD_WAIT_S)

    def _warm_prompt(self, req: SynthesisRequest) -> None:
        """Analyse the prompt voice once, so that the frontend's cache serves it to both A and B alike."""
        if self.frontend is None or req.prompt_wav is None:
            return
        try:
            self.frontend.prompt_features(req.prompt_wav, req.prompt_sr)
        except (ValueError, RuntimeError, OSError) as e:
            raise user_error(user_message(e)) from e

    def ab(self, *values: Any) -> Iterator[tuple]:
        """Same text, voice and seed through configuration A, then B (one after the other, so neither steals the
        other's GPU time).  Yields A's result as soon as it exists, then B's and the comparison.  With the page's
        two request ids (``client_request_ids``, "A,B") it follows the page's own streams instead of running them."""
        voice, cfg_a, cfg_b, rest = self.split(values, VOICE_FIELDS, CONFIG_FIELDS, CONFIG_FIELDS)
        rids = str(rest[0] or "").split(",") if rest and rest[0] else []
        sr, skip = self.engine.sample_rate, gr.skip()
        if len(rids) == 2 and all(rids):  # the page plays A then B through the API: follow those requests
            try:
                self.request_from(voice, cfg_a), self.request_from(voice, cfg_b)
            except gr.Error as e:  # the page: one message in the status line, no red "Error" on every output
                yield (skip,) * 6 + (f"Not run: {e.message}",)
                return
            run_a = lambda: self._followed(rids[0], FOLLOW_TIMEOUT_S)  # noqa: E731
            # B is requested once A has been heard to its end
            run_b = lambda: self._followed(rids[1], FOLLOW_TIMEOUT_S + len(wav_a) / self.engine.sample_rate)  # noqa: E731
        else:
            req_a, req_b = self._checked_request(voice, cfg_a), self._checked_request(voice, cfg_b)
            self._warm_prompt(req_a)  # otherwise only A would pay for analysing the prompt voice
            run_a, run_b = (lambda: self._whole(req_a)), (lambda: self._whole(req_b))
        wav_a, tele_a = run_a()
        yield ((sr, pcm16(wav_a)), skip, db.ttfb_figure([tele_a], ["A"]), db.chunk_timeline_figure(tele_a, "A"),
               skip, skip, "A done; B is playing…" if rids else "A done; B is running…")
        wav_b, tele_b = run_b()
        n = min(len(wav_a), len(wav_b))
        rows = tables.ab_difference_rows(tele_a, tele_b)
        diff = float(np.max(np.abs(wav_a[:n] - wav_b[:n]))) if n else float("nan")
        rows += [[f"audio max |B − A| (first {n} samples)", None, None, round(diff, 6), None],
                 ["audio samples", len(wav_a), len(wav_b), len(wav_b) - len(wav_a),
                  round(len(wav_b) / len(wav_a), 3) if len(wav_a) else None]]
        span = db.timeline_extent(tele_a, tele_b)  # one x axis for both timelines
        yield ((sr, pcm16(wav_a)), (sr, pcm16(wav_b)), db.ttfb_figure([tele_a, tele_b], ["A", "B"]),
               db.chunk_timeline_figure(tele_a, "A", x_range=span), db.chunk_timeline_figure(tele_b, "B", x_range=span),
               rows, tables.ab_status_line(tele_a, tele_b))
