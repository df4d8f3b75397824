"""Command line: ``python -m cosyvoice_fast {synth,speaker-state,download,build-engines,synthetic,backends,soak,serve}``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("cosyvoice_fast")


DEFAULT_PROMPT = Path(__file__).resolve().parents[2] / "assets" / "cross_lingual_prompt.wav"


def cmd_synth(a: argparse.Namespace) -> int:
    import itertools

    import soundfile as sf

    from cosyvoice_fast.config.flags import from_cli_args
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.frontend.request import SynthesisRequest
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.telemetry.record import format_breakdown

    run = from_cli_args(a)
    a.bistream = getattr(a, "bistream", False)  # callers that build the namespace themselves may omit it
    if a.bistream == (a.text is not None):
        print("give --text, or --bistream to read the text from stdin as it is written (not both)", file=sys.stderr)
        return 2
    warmups = max(0, int(getattr(a, "warmup", 0) or 0))
    svc = load_service(**run.service_kwargs(), speaker_cache_dir=a.speaker_cache)
    try:
        mode = a.mode or ("speaker" if a.speaker else "zero_shot" if a.prompt_text else "cross_lingual")
        if a.prompt_wav is None and mode != "speaker":
            a.prompt_wav = str(DEFAULT_PROMPT)  # a voice is required; the bundled example keeps a quick try short
            log.info("no --prompt-wav given: using the example voice %s", DEFAULT_PROMPT)
        from cosyvoice_fast.cli.bistream import bistream_summary, stdin_pieces

        params = StreamParams(token_hop_len_first=a.token_hop_len_first,
                              token_hop_len=getattr(a, "token_hop_len", 25),
                              stream_scale_factor=getattr(a, "stream_scale_factor", 2.0),
                              pre_lookahead_len=a.pre_lookahead_len)
        voice = dict(mode=mode, prompt_wav=a.prompt_wav, prompt_text=a.prompt_text or "",
                     instruct_text=a.instruct or "", speaker=a.speaker, seed=a.seed, stream_params=params,
                     backend=run.backend)
        if svc.synthetic:
            log.warning(svc.banner)
        for i in range(warmups):  # first kernels, allocations and the prompt analysis: not what a user waits for
            svc.engine.synthesize(SynthesisRequest(text="Warming up.", stream=True, max_tokens=30, **voice))
        source = None
        if a.bistream:  # the request starts with the first piece: waiting for the writer is not synthesis time
            pieces = stdin_pieces(sys.stdin.buffer)
            first = next(pieces, "")
            source = itertools.chain([first], pieces)
        req = SynthesisRequest(text=a.text or "", text_source=source, stream=a.stream or a.bistream,
                               speed=a.speed, max_tokens=a.max_tokens, **voice)
        wav, tele = svc.engine.synthesize(req)
        sf.write(a.out, wav, svc.engine.sample_rate)
        print(format_breakdown(tele))
        print(warm_note(warmups))
        if a.bistream:
            print(bistream_summary(tele))
        print(f"wrote {a.out} ({len(wav) / svc.engine.sample_rate:.2f} s)")
        if a.telemetry_json:
            Path(a.telemetry_json).write_text(json.dumps(tele.to_dict(), indent=1))
    finally:
        svc.close()
    return 0


def warm_note(warmups: int) -> str:
    """The line under synth's figures saying whether they are warm (the app's steady state) or cold."""
    if warmups:
        return (f"warm: timed after {warmups} untimed warm-up request{'s' if warmups > 1 else ''} with the same voice "
                "and backends (--warmup 0 times the cold first request)")
    return ("cold: the first request of this process, so these figures include one-time costs (first kernels, "
            "allocations, analysing the prompt voice); --warmup 1 (the default) times a warm request")


def cmd_download(a: argparse.Namespace) -> int:
    """Fetch CosyVoice2-0.5B with huggingface_hub or modelscope (needs network; run once on the GPU box)."""
    target = Path(a.out)
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id="FunAudioLLM/CosyVoice2-0.5B", local_dir=str(target))
    except ImportError:
        try:
            from modelscope import snapshot_download as ms_download  # type: ignore[import-not-found]

            ms_download("iic/CosyVoice2-0.5B", local_dir=str(target))
        except ImportError:
            print("Neither huggingface_hub nor modelscope is installed: pip install huggingface_hub", file=sys.stderr)
            return 2
    except Exception as e:  # network errors: say what to do
        print(f"Download failed ({type(e).__name__}: {e}). Check the network, or copy the CosyVoice2-0.5B "
              f"directory to {target} by hand.", file=sys.stderr)
        return 1
    print(f"downloaded to {target}")
    return 0


def cmd_synthetic(a: argparse.Namespace) -> int:
    from cosyvoice_fast.modeldir.synthetic import write_synthetic_model_dir

    print(write_synthetic_model_dir(a.out, a.size, seed=a.seed))
    return 0


def cmd_backends(a: argparse.Namespace) -> int:
    from cosyvoice_fast.engine.stages import available_backends
    from cosyvoice_fast.config.flags import pick_device

    families = ("cosyvoice2", "cosyvoice3") if a.family == "all" else (a.family,)
    for family in families:
        if len(families) > 1:
            print(f"# {family}")
        for b in available_backends(pick_device(a.device), family=family):
            why = "; ".join(x for x in (b.reason, b.note) if x)
            print(f"{b.stage:<8}{b.name:<13}{'yes' if b.available else 'no':<5}{why}")
    return 0


def cmd_speaker_state(a: argparse.Namespace) -> int:
    from cosyvoice_fast.config.flags import from_cli_args
    from cosyvoice_fast.config.backends import BackendConfig
    from cosyvoice_fast.serving.service import load_service

    run = from_cli_args(a)
    svc = load_service(**run.service_kwargs(), speaker_cache_dir=a.speaker_cache)
    try:
        cfg = BackendConfig(flow=a.flow_backend, dtype=run.dtype)
        for name in a.names:
            n = svc.engine.store_flow_state(name, cfg)
            log.info("stored the flow prompt state of %r (%s flow, %s): %.1f MB", name, cfg.flow, cfg.dtype, n / 1e6)
    finally:
        svc.close()
    return 0


def cmd_build_engines(a: argparse.Namespace) -> int:
    from cosyvoice_fast.flow.tensorrt_build import build_engines_cli

    return build_engines_cli(a)


def cmd_soak(a: argparse.Namespace) -> int:
    from cosyvoice_fast.bench.soak import cmd_soak as run

    return run(a)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (every option carries a help text: tests/test_cli_args.py walks it)."""
    from cosyvoice_fast.config.flags import add_cli_args

    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("synth", help="synthesise one utterance and print its TTFB breakdown")
    add_cli_args(p)
    g = p.add_argument_group("what to say, in which voice")
    g.add_argument("--text", help="the text to speak (or --bistream)")
    g.add_argument("--bistream", action="store_true",
                   help="read the text from stdin as it is written (e.g. piped from an LLM) and speak while it "
                        "comes; TTFB counts from the first piece of text, not from the wait for it")
    g.add_argument("--mode", choices=["zero_shot", "cross_lingual", "instruct2", "speaker"],
                   help="default: speaker with --speaker, zero_shot with --prompt-text, else cross_lingual")
    g.add_argument("--prompt-wav", metavar="FILE",
                   help="the voice to clone, 3-10 s of clear speech (default: the bundled example voice)")
    g.add_argument("--prompt-text", help="exactly what is said in --prompt-wav (zero-shot mode)")
    g.add_argument("--instruct", help="instruct2 mode: how to speak, e.g. 'Speak slowly and calmly.'")
    g.add_argument("--speaker", help="a saved speaker's name (speaker mode; see --speaker-cache)")
    g.add_argument("--speaker-cache", default="speakers", metavar="DIR",
                   help="where saved speakers are kept (default: speakers)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed: same seed + same inputs = same audio "
                                                         "(default 0)")
    g = p.add_argument_group("streaming and timing")
    g.add_argument("--stream", action="store_true",
                   help="stream in chunks (the TTFB printed is the first chunk's); without it one whole chunk")
    g.add_argument("--speed", type=float, default=1.0, help="speaking rate, without --stream only (default 1.0)")
    g.add_argument("--token-hop-len-first", type=int, default=25, metavar="N",
                   help="speech tokens in the first chunk (default 25 = upstream, padded so prompt + chunk fill "
                        "whole 25-token attention chunks; fewer: earlier first audio)")
    g.add_argument("--token-hop-len", type=int, default=25, metavar="N",
                   help="speech tokens in the second chunk; later ones grow by --stream-scale-factor (default 25)")
    g.add_argument("--stream-scale-factor", type=float, default=2.0, metavar="X",
                   help="how fast chunks grow, up to 100 tokens (default 2.0; 1 keeps them equal)")
    g.add_argument("--pre-lookahead-len", type=int, default=3, metavar="N",
                   help="future tokens each chunk waits for, 0-3 (default 3, what the flow was trained with)")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help="cap on speech tokens per text segment (25 tokens = 1 s of audio; default: until the LM "
                        "stops; keep a cap on random-weight models, which rarely stop)")
    g.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed short requests with the same voice and backends before the timed one, so the "
                        "printed figures are warm (first kernels, prompt analysis); 0 times the cold first request "
                        "and says so (default 1)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="out.wav", metavar="FILE", help="where to write the audio (default: out.wav)")
    g.add_argument("--telemetry-json", metavar="FILE", help="also write the request's full telemetry as JSON here")
    p.set_defaults(fn=cmd_synth)

    p = sub.add_parser("speaker-state", help="store saved speakers' flow prompt state in the speaker cache, so "
                       "their first chunk skips the prompt after a restart (large: ~230 MB per 3 s voice in bf16)")
    add_cli_args(p, parts=("model", "device", "engine"))
    p.add_argument("names", nargs="+", help="saved speaker names")
    p.add_argument("--speaker-cache", default="speakers", metavar="DIR",
                   help="where saved speakers are kept (default: speakers)")
    p.add_argument("--flow-backend", default="cudagraph", choices=["eager", "cudagraph"],
                   help="the flow runner that will use it (each keeps its own layout; default cudagraph)")
    p.set_defaults(fn=cmd_speaker_state)

    p = sub.add_parser("download", help="download CosyVoice2-0.5B (needs network)")
    p.add_argument("--out", default="pretrained_models/CosyVoice2-0.5B", metavar="DIR",
                   help="where to put the model directory (default: pretrained_models/CosyVoice2-0.5B, where "
                        "app.py and --model-dir look first)")
    p.set_defaults(fn=cmd_download)

    p = sub.add_parser("synthetic", help="write a random-weight model directory (same files as a real one; "
                                         "the audio is noise, the timings are real)")
    p.add_argument("--size", choices=["tiny", "full", "tiny3", "full3"], default="tiny",
                   help="tiny: seconds on a CPU; full: CosyVoice2-0.5B's sizes, for GPU timing; tiny3 / full3: the "
                        "same for CosyVoice3 (Fun-CosyVoice3-0.5B's sizes) (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (then --model-dir DIR)")
    p.set_defaults(fn=cmd_synthetic)

    p = sub.add_parser("backends", help="list backends and why any is unavailable")
    p.add_argument("--device", default="auto",
                   help="the device to check: cpu, cuda, cuda:1 … (default: cuda if available, else cpu)")
    p.add_argument("--family", choices=["all", "cosyvoice2", "cosyvoice3"], default="all",
                   help="the model family whose backends to list (default: both)")
    p.set_defaults(fn=cmd_backends)

    p = sub.add_parser("build-engines", help="export the flow estimator to ONNX and build TensorRT engines")
    add_cli_args(p, parts=("model",))
    p.add_argument("--engines-dir", default="engines", metavar="DIR",
                   help="where the ONNX file and the engines go (default: engines)")
    p.add_argument("--onnx-only", action="store_true", help="stop after the ONNX export (no TensorRT needed)")
    p.add_argument("--engine-dtype", default="fp16", choices=["fp32", "fp16", "bf16"],
                   help="TensorRT engine precision (the ONNX export is fp32 unless TensorRT 11 needs it typed)")
    p.add_argument("--max-frames", type=int, default=3000,
                   help="longest estimator input the engine accepts (mel frames, 50 per second)")
    p.set_defaults(fn=cmd_build_engines)

    p = sub.add_parser("soak", help="many requests with injected faults; prints memory / fd / queue growth")
    from cosyvoice_fast.bench.soak import add_arguments as soak_arguments

    soak_arguments(p)
    p.set_defaults(fn=cmd_soak)

    p = sub.add_parser("warmup", help="build backends once so their compiled kernels are cached for every later "
                       "start (e.g. in a Docker build step); prints the start-up phases")
    from cosyvoice_fast.cli.warmup import add_arguments as warmup_arguments, cmd_warmup

    warmup_arguments(p)
    p.set_defaults(fn=cmd_warmup)

    p = sub.add_parser("serve", help="serve the HTTP API on Ray Serve replicas (one engine per GPU, many hosts)")
    from cosyvoice_fast.cli.serve import add_arguments as serve_arguments, cmd_serve

    serve_arguments(p)
    p.set_defaults(fn=cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
