"""The command line a new user tries first: synth on the synthetic model, with and without a prompt voice."""

from __future__ import annotations

import pytest

sf = pytest.importorskip("soundfile", reason="soundfile is not installed here (pip install -r requirements.txt)")

from cosyvoice_fast.cli.main import main  # noqa: E402


def test_synth_streams_to_a_wav_and_prints_the_breakdown(tmp_path, capsys):
    out = tmp_path / "out.wav"
    assert main(["synth", "--synthetic", "tiny", "--text", "Hello there.", "--stream", "--out", str(out),
                 "--speaker-cache", str(tmp_path / "spk")]) == 0  # no --prompt-wav: the bundled example voice
    printed = capsys.readouterr().out
    for stage in ("frontend", "llm_prefill", "flow", "vocoder", "TTFB"):
        assert stage in printed
    wav, sr = sf.read(out)
    assert sr == 24000 and len(wav) > 0 and len(wav) % 960 == 0  # whole tokens of audio


def test_synth_max_tokens_caps_the_audio(tmp_path, capsys):
    out = tmp_path / "out.wav"
    assert main(["synth", "--synthetic", "tiny", "--text", "Hello there, a longer sentence to speak.", "--max-tokens",
                 "12", "--out", str(out), "--speaker-cache", str(tmp_path / "spk")]) == 0
    wav, sr = sf.read(out)
    assert 0 < len(wav) <= 12 * 960 and len(wav) % 960 == 0
    assert main(["synth", "--synthetic", "tiny", "--text", "Hi.", "--max-tokens", "0", "--out", str(out),
                 "--speaker-cache", str(tmp_path / "spk")]) == 2
    assert capsys.readouterr().err.strip().endswith("error: max_tokens=0: use 1 to 4000")


def test_backends_lists_every_stage(capsys):
    assert main(["backends", "--device", "cpu"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any(r.split()[:3] == ["flow", "cudagraph", "no"] and "needs a CUDA GPU" in r for r in rows)
    assert any(r.split() == ["flow", "eager", "yes"] for r in rows)  # flow="incremental" is incremental=True now


def test_gpu_only_tools_say_so_without_a_gpu():
    import pytest
    import torch

    from cosyvoice_fast.bench import flow as bench_flow, profile_stages

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        profile_stages.main([])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_flow.main([])


def test_profile_stages_names_bad_frames_and_flows(capsys):
    import pytest

    from cosyvoice_fast.bench import profile_stages

    for argv, message in ((["--frames", "56,x"], "expected comma-separated frame counts like 56,206, got '56,x'"),
                          (["--frames", "0"], "frame counts must be >= 1, got '0'"),
                          (["--flows", "fused,warp"], "unknown flow warp; choose from eager, incremental, cudagraph, "
                                                      "cudagraph-incremental, fused, fused-incremental")):
        with pytest.raises(SystemExit) as e:
            profile_stages.main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_speaker_state_stores_a_saved_voice_and_names_bad_requests(tmp_path, capsys):
    from pathlib import Path

    prompt = Path(__file__).resolve().parents[1] / "assets" / "cross_lingual_prompt.wav"
    spk = tmp_path / "spk"
    assert main(["synth", "--synthetic", "tiny", "--text", "Hi.", "--out", str(tmp_path / "o.wav"),
                 "--speaker-cache", str(spk), "--prompt-wav", str(prompt)]) == 0
    from cosyvoice_fast.serving.service import load_service

    svc = load_service(synthetic="tiny", device="cpu", speaker_cache_dir=spk, progress=False)
    try:
        svc.frontend.add_speaker("bob", str(prompt))
    finally:
        svc.close()
    capsys.readouterr()
    assert main(["speaker-state", "bob", "--synthetic", "tiny", "--device", "cpu", "--speaker-cache", str(spk),
                 "--flow-backend", "eager"]) == 0
    assert main(["speaker-state", "nobody", "--synthetic", "tiny", "--device", "cpu", "--speaker-cache", str(spk),
                 "--flow-backend", "eager"]) == 2
    assert "no saved speaker named 'nobody'" in capsys.readouterr().err
    assert main(["speaker-state", "bob", "--synthetic", "tiny", "--device", "cpu", "--speaker-cache", str(spk)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _options_without_help(parser, path=()):
    """(command path, option) of every option of ``parser`` and its subcommands that has no help text."""
    import argparse

    out = []
    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            for name, sub in act.choices.items():
                out += _options_without_help(sub, path + (name,))
        elif not isinstance(act, argparse._HelpAction) and not (act.help or "").strip():
            out.append((" ".join(path), "/".join(act.option_strings) or act.dest))
    return out


def test_every_option_of_every_command_has_help_text():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import app
    import install
    from cosyvoice_fast.cli import bistream
    from cosyvoice_fast.cli.main import build_parser

    parsers = {"python -m cosyvoice_fast": build_parser(), "python app.py": app.build_parser(),
               "python install.py": install.build_parser(), "cli.bistream": bistream.parser()}
    missing = {name: _options_without_help(p) for name, p in parsers.items()}
    assert not any(missing.values()), missing
    synth = next(a for a in build_parser()._actions if a.dest == "cmd").choices["synth"]
    opts = {o for a in synth._actions for o in a.option_strings}
    assert {"--token-hop-len-first", "--token-hop-len", "--stream-scale-factor", "--pre-lookahead-len",
            "--warmup"} <= opts
    flow = next(a for a in synth._actions if "--flow-backend" in a.option_strings)
    assert flow.default == "eager" and "incrementally" in flow.help and "--recompute-flow" in flow.help


def test_synth_says_whether_its_figures_are_warm_or_cold(tmp_path, capsys):
    import json

    out, tele = tmp_path / "o.wav", tmp_path / "t.json"
    common = ["synth", "--synthetic", "tiny", "--device", "cpu", "--text", "Hello there.", "--stream",
              "--max-tokens", "30", "--out", str(out), "--speaker-cache", str(tmp_path / "spk")]
    assert main(common + ["--warmup", "0"]) == 0
    assert "\ncold: the first request of this process" in capsys.readouterr().out
    assert main(common + ["--token-hop-len-first", "7", "--token-hop-len", "9", "--stream-scale-factor", "1",
                          "--telemetry-json", str(tele)]) == 0
    assert "\nwarm: timed after 1 untimed warm-up request" in capsys.readouterr().out
    t = json.loads(tele.read_text())
    assert (t["params"]["token_hop_len_first"], t["params"]["token_hop_len"], t["params"]["stream_scale_factor"]) \
        == (7, 9, 1.0)
    assert [c["n_tokens"] for c in t["chunks"]][:3] == [7, 9, 9]  # scale factor 1: every later chunk the same


def test_synth_bistream_ttfb_starts_with_the_first_piece_not_the_wait_for_it(tmp_path, monkeypatch, capsys):
    import io
    import json
    import time

    class SlowStart(io.RawIOBase):
        """A pipe whose writer takes 2 s to send its first words."""

        def __init__(self):
            self.pieces = [b"Hello there, ", b"a few words ", b"at a time."]

        def read1(self, n: int = -1) -> bytes:
            if len(self.pieces) == 3:
                time.sleep(2.0)
            return self.pieces.pop(0) if self.pieces else b""

    monkeypatch.setattr("sys.stdin", type("Stdin", (), {"buffer": SlowStart()})())
    tele = tmp_path / "t.json"
    assert main(["synth", "--bistream", "--synthetic", "tiny", "--device", "cpu", "--max-tokens", "30",
                 "--warmup", "0", "--out", str(tmp_path / "o.wav"), "--speaker-cache", str(tmp_path / "spk"),
                 "--telemetry-json", str(tele)]) == 0
    t = json.loads(tele.read_text())
    # the first piece was there when the request was received (its 2 s wait is not part of the TTFB); a bound far
    # under the 2 s wait, not a timing threshold
    assert t["text_arrivals"][0] < 1.0, t["text_arrivals"]
