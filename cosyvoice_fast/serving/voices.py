"""The voices a ``voice`` field can name: saved speakers of the frontend's cache and the bundled prompt recordings
of ``assets/`` (so a fresh install can synthesise without uploading anything)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[2] / "assets"


@dataclass(frozen=True)
class BundledVoice:
    """A prompt recording shipped in ``assets/``: its id is the file's stem; with a known transcript it clones
    zero-shot, without one cross-lingually."""

    id: str
    path: Path
    transcript: str

    @property
    def mode(self) -> str:
        return "zero_shot" if self.transcript else "cross_lingual"


def bundled_voices(assets: Path = ASSETS) -> dict[str, BundledVoice]:
    """Every ``assets/*.wav``, with the transcript ``examples.json`` gives it in a zero-shot example (if any)."""
    transcripts: dict[str, str] = {}
    ex_file = assets / "examples.json"
    if ex_file.is_file():
        for ex in json.loads(ex_file.read_text(encoding="utf-8")):
            if ex.get("prompt_wav") and ex.get("mode") == "zero_shot" and ex.get("prompt_text"):
                transcripts.setdefault(Path(ex["prompt_wav"]).stem, ex["prompt_text"])
    return {p.stem: BundledVoice(p.stem, p, transcripts.get(p.stem, "")) for p in sorted(assets.glob("*.wav"))}


def voice_list(frontend: Any, assets: Path = ASSETS) -> list[dict[str, Any]]:
    """JSON of ``GET /v1/audio/voices``: saved speakers first (they shadow a bundled voice of the same name)."""
    saved = sorted(n for n in frontend.list_speakers() if _usable(frontend, n)) if frontend is not None else []
    out = [{"id": n, "name": n, "kind": "saved", "mode": "speaker"} for n in saved]
    if frontend is not None:  # bundled voices need the frontend to analyse them
        out += [{"id": v.id, "name": v.id, "kind": "bundled", "mode": v.mode, "transcript": v.transcript or None}
                for v in bundled_voices(assets).values() if v.id not in saved]
    return out


def _usable(frontend: Any, name: str) -> bool:
    """A saved speaker whose file loads (memoised by the cache; a damaged or foreign file is not offered)."""
    cache = getattr(frontend, "speakers", None)
    if cache is None:
        return True
    try:
        cache.get(name)
    except ValueError:  # SpeakerCacheError: damaged, or removed meanwhile
        return False
    return True
