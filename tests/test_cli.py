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
