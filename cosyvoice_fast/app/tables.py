"""The dashboard's tables and status lines (summary, A/B differences, what a run or a Stop ended with), built only
from telemetry like the figures of :mod:`cosyvoice_fast.app.dashboard`; kept apart so each module stays small."""

from __future__ import annotations

import math
from typing import Any, Mapping

from cosyvoice_fast.app.dashboard import TeleLike, as_dict, as_number, breakdown_ms, fmt_number, heard_ms

SUMMARY_HEADERS = ["metric", "value", "unit"]
AB_HEADERS = ["metric", "A", "B", "B − A", "B / A"]


def _fin(x: Any) -> bool:
    return math.isfinite(as_number(x))


def status_line(t: TeleLike, outcome: str) -> str:
    """The status under the player at the end of a run: done, or stopped with what was made before Stop."""
    d = as_dict(t) or {}
    der = d.get("derived") or {}
    chunks = d.get("chunks") or []
    audio = sum(as_number(c.get("n_samples")) / (c.get("sample_rate") or 1) for c in chunks)
    under = sum(bool(c.get("underrun")) for c in der.get("chunks") or [])
    heard = heard_ms(d)
    tail = f", heard at {heard:.0f} ms" if _fin(heard) else ""
    if outcome == "cancelled":
        return stopped_line(as_number((d.get("client") or {}).get("stop_heard_s")), audio, len(chunks)) + (
            f", TTFB {fmt_number(der.get('ttfb_ms'), 0)} ms{tail}")
    return (f"done: {len(chunks)} chunks, {audio:.2f} s of audio, TTFB {fmt_number(der.get('ttfb_ms'), 0)} ms, "
            f"RTF {fmt_number(der.get('rtf'), 3)}, {under} underruns{tail}")


def stopped_line(heard_s: float, audio_s: float, chunks: int | None = None, verb: str = "made") -> str:
    """What Stop ended: the audio the listener heard (the page's player clock at the moment of Stop) beside the audio
    the engine had ``verb`` ("made", or "received" by the page) by then, which runs ahead of playback."""
    made = f"{audio_s:.2f} s of audio {verb}" + (
        f" in {chunks} chunk{'s' if chunks != 1 else ''}" if chunks is not None else "") + " before Stop"
    if not _fin(heard_s):
        return f"stopped: {made}"
    return f"stopped after {heard_s:.2f} s heard ({made})"


def summary_rows(t: TeleLike | None) -> list[list[Any]]:
    """[metric, value, unit] rows: TTFB, RTF, chunks, tokens/s, audio length, underruns, speaker cache."""
    d = as_dict(t)
    if not d:
        return []
    der = d.get("derived") or {}

    def r(x: Any, n: int) -> Any:
        return round(as_number(x), n) if _fin(x) else None

    rows = [["TTFB", r(der.get("ttfb_ms"), 1), "ms"], ["RTF", r(der.get("rtf"), 3), "wall / audio"],
            ["chunks", len(d.get("chunks") or []), ""], ["tokens/s", r(der.get("tokens_per_s"), 1), "LM"],
            ["speech tokens", len(d.get("token_times") or []), ""],
            ["audio", r(sum(as_number(c.get("n_samples")) / (c.get("sample_rate") or 1) for c in d.get("chunks") or []),
                        2), "s"],
            ["underruns", sum(bool(c.get("underrun")) for c in der.get("chunks") or []), "late chunks"],
            ["speaker cache", "hit" if d.get("speaker_cache_hit") else "miss", ""]]
    if _fin(heard_ms(d)):
        rows.insert(1, ["heard at", r(heard_ms(d), 1), "ms (click → heard)"])
    first = first_chunk_row(d)
    if first:
        rows.insert([r[0] for r in rows].index("chunks") + 1, first)
    if d.get("error"):
        rows.append(["error", d["error"], ""])
    return rows


def first_chunk_row(d: Mapping[str, Any]) -> list[Any] | None:
    """["first chunk", tokens, what was asked]: the first chunk's size as the engine made it.  The default
    ``token_hop_len_first`` (25) is padded so that prompt + chunk fill whole 25-token attention chunks, so 25
    and 50 can give the same first chunk; this row says which size was used."""
    chunks = d.get("chunks") or []
    if not chunks:
        return None
    made = int(chunks[0].get("n_tokens") or 0)
    asked = (d.get("params") or {}).get("token_hop_len_first")
    if asked is None:
        return ["first chunk", made, "tokens"]
    if (d.get("params") or {}).get("stream") is False:
        return ["first chunk", made, "tokens (not streamed: the whole segment)"]
    if chunks[0].get("finalize") and made < int(asked):
        return ["first chunk", made, f"tokens (the whole segment; {asked} asked)"]
    if made == int(asked):
        return ["first chunk", made, "tokens (as asked)"]
    return ["first chunk", made, f"tokens ({asked} asked, padded to fill whole 25-token chunks)"]


def _ab_metrics(d: Mapping[str, Any]) -> dict[str, float]:
    der = d.get("derived") or {}
    chunks = der.get("chunks") or []

    def mean(key: str) -> float:
        v = [as_number(c.get(key)) for c in chunks if _fin(c.get(key))]
        return sum(v) / len(v) if v else math.nan

    m = {"TTFB (ms)": as_number(der.get("ttfb_ms"))}
    m.update({f"  {s} (ms)": v for s, v in breakdown_ms(d).items()})
    m["heard at (ms)"] = heard_ms(d)
    m.update({"RTF": as_number(der.get("rtf")), "tokens/s": as_number(der.get("tokens_per_s")),
              "chunks": float(len(chunks)), "underruns": float(sum(bool(c.get("underrun")) for c in chunks)),
              "flow ms / chunk": mean("flow_ms"), "vocoder ms / chunk": mean("vocoder_ms"),
              "audio (s)": sum(as_number(c.get("audio_s")) for c in chunks if _fin(c.get("audio_s"))),
              "prompt from cache (1 = yes)": float(bool(d.get("speaker_cache_hit")))})
    return m


def ab_difference_rows(a: TeleLike, b: TeleLike) -> list[list[Any]]:
    """[metric, A, B, B−A, B/A] rows comparing two runs of the same text, voice and seed."""
    ma, mb = _ab_metrics(as_dict(a) or {}), _ab_metrics(as_dict(b) or {})
    rows = []
    for k in ma:
        x, y = ma[k], mb[k]
        n = _ab_digits(k)
        diff = round(y - x, n) if _fin(x) and _fin(y) else None
        ratio = round(y / x, 2) if _fin(x) and _fin(y) and x != 0 else None
        rows.append([k, round(x, n) if _fin(x) else None, round(y, n) if _fin(y) else None, diff, ratio])
    return rows


def _ab_digits(metric: str) -> int:
    """Decimals a difference row keeps: 0.1 ms for times (finer is timer noise), 3 for RTF, 2 for the rest."""
    if "ms" in metric:
        return 1
    return 3 if metric == "RTF" else 2


def ab_status_line(a: TeleLike, b: TeleLike) -> str:
    """The A/B tab's one line at the end: each side's TTFB and, where the page played it, when it was heard."""
    def side(name: str, t: TeleLike) -> str:
        d = as_dict(t) or {}
        heard = heard_ms(d)
        return (f"{name} TTFB {fmt_number((d.get('derived') or {}).get('ttfb_ms'), 0)} ms"
                + (f", heard at {heard:.0f} ms" if _fin(heard) else ""))
    return f"done: {side('A', a)} · {side('B', b)}"
