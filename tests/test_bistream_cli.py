"""The bi-streaming CLI draft on the tiny synthetic model: stdin read in pieces, tokens, a wav, messages."""

from __future__ import annotations

import io

import pytest

from cosyvoice_fast.cli.bistream import main


class Trickle(io.RawIOBase):
    """A stdin that hands out one small piece per read, as a pipe from a streaming LLM does."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = list(pieces)
        self.reads = 0

    def read1(self, n: int = -1) -> bytes:
        self.reads += 1
        return self.pieces.pop(0) if self.pieces else b""


def test_stdin_pieces_become_speech_tokens_and_a_wav(tmp_path, capsys):
    import soundfile as sf

    text = "Hello there, this is a sentence that arrives a few words at a time, 5 % slower than 1990s speech."
    pieces = [text[i:i + 7].encode() for i in range(0, len(text), 7)]
    stdin = Trickle(pieces)
    out = tmp_path / "a.wav"
    rc = main(["--synthetic", "tiny", "--device", "cpu", "--prompt-text", "a prompt", "--greedy",
               "--max-tokens", "40", "--out", str(out)], stdin=stdin)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert f"{len(pieces)} pieces" in printed and "40 speech tokens (cap)" in printed
    wav, sr = sf.read(out)
    assert sr == 24000 and len(wav) == 40 * 960  # one speech token is 960 samples at 24 kHz
    assert stdin.reads <= len(pieces) + 1  # read only while the LM waited for text


@pytest.mark.parametrize("data, message", [([b"", b""], "without anything to speak"),
                                           ([b"\xf0\x9f\x98\x80 !!"], "without anything to speak")])
def test_empty_stdin_gets_a_clear_message(tmp_path, capsys, data, message):
    rc = main(["--synthetic", "tiny", "--device", "cpu", "--out", str(tmp_path / "b.wav")], stdin=Trickle(data))
    assert rc == 2 and message in capsys.readouterr().err


def test_synth_bistream_reads_stdin_through_the_engine(tmp_path, monkeypatch, capsys):
    """``python -m cosyvoice_fast synth --bistream``: stdin's pieces stream into the engine, audio streams out."""
    import soundfile as sf

    from cosyvoice_fast.cli.main import main as cli_main

    text = "Hello there, this is streamed text from a pipe, a few words at a time."
    stdin = Trickle([text[i:i + 5].encode() for i in range(0, len(text), 5)])
    monkeypatch.setattr("sys.stdin", type("Stdin", (), {"buffer": stdin})())
    out = tmp_path / "s.wav"
    rc = cli_main(["synth", "--bistream", "--synthetic", "tiny", "--device", "cpu", "--max-tokens", "40",
                   "--out", str(out), "--speaker-cache", str(tmp_path / "spk")])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    pieces = -(-len(text) // 5)
    assert f"bi-streaming: {pieces} text pieces" in printed
    wav, sr = sf.read(out)
    assert sr == 24000 and len(wav) == 40 * 960


def test_synth_needs_text_or_bistream(capsys):
    from cosyvoice_fast.cli.main import main as cli_main

    assert cli_main(["synth", "--synthetic", "tiny", "--device", "cpu"]) == 2
    assert "give --text, or --bistream" in capsys.readouterr().err
