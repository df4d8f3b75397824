"""The page's player: Synthesize fetches ``POST /v1/audio/speech`` (pcm) and plays it through Web Audio from the
first chunk, while the Gradio event (given the same request id) draws the dashboard.

Playback: an ``AudioContext`` at the engine's sample rate (no resampling between buffers), each network read turned
into an ``AudioBufferSourceNode`` started exactly where the previous one ends (sample-aligned, so no gap and no
click between chunks; a chunk that arrives after its predecessor finished is an underrun, counted).  "Heard at" is
click -> the moment the first sample leaves the output (``getOutputTimestamp`` maps the scheduled context time to
the page clock, so the output latency is included); the page reports it to ``/v1/requests/{id}/client`` and the
dashboard draws it as its own bar.  ``window.cvfPlayback`` holds the figures of the last run (the browser test
reads them).
"""

from __future__ import annotations

import json
from typing import Sequence

PLAYER_JS = r"""
<script>
(() => {
  const LEAD_S = 0.005;  // schedule the first buffer this far ahead of the context clock (one render quantum)
  let clickAt = null;
  document.addEventListener("pointerdown", (e) => {
    if (e.target.closest && e.target.closest("#synthesize-btn")) clickAt = performance.now();
  }, true);
  const newId = () => "page-" + Array.from(crypto.getRandomValues(new Uint8Array(8)),
                                           (b) => b.toString(16).padStart(2, "0")).join("");
  const blobs = new Map();  // prompt file url -> Blob (the same upload is sent again without refetching it)
  async function promptBlob(file) {
    const url = file && (file.url || (file.path ? "gradio_api/file=" + file.path : null));
    if (!url) return null;
    if (!blobs.has(url)) {
      const r = await fetch(url, {credentials: "same-origin"});
      if (!r.ok) throw new Error("could not read the prompt voice (" + r.status + ")");
      blobs.clear();
      blobs.set(url, await r.blob());
    }
    return blobs.get(url);
  }
  const api = (path) => new URL(path, document.baseURI).toString();
  const P = {ctx: null, run: null, sampleRate: 24000};
  function context() {
    if (!P.ctx) P.ctx = new AudioContext({sampleRate: P.sampleRate, latencyHint: "interactive"});
    if (P.ctx.state === "suspended") P.ctx.resume();
    return P.ctx;
  }
  function pageTime(ctx, t) {  // page clock (performance.now) at which context time t reaches the speakers
    const ts = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
    if (ts && ts.performanceTime > 0) return ts.performanceTime + (t - ts.contextTime) * 1000;
    return performance.now() + (t - ctx.currentTime + (ctx.outputLatency || ctx.baseLatency || 0)) * 1000;
  }
  function setStatus(text) {
    const el = document.querySelector("#player-status");
    if (el) el.textContent = text;
  }
  P.stop = () => {
    const run = P.run;
    if (!run) return "";
    run.abort.abort();
    for (const r of P.runs || []) for (const s of r.sources) { try { s.stop(); } catch (e) {} }
    run.stopped = true;
    return run.id;
  };
  function play(id, v, t0, abort) {
    const ctx = context();  // inside the click's user activation: allowed to start sound
    const run = {id, clickAt: t0, abort, sources: [], stopped: false, next: 0,
                 samples: 0, chunks: 0, underruns: 0, heardAt: null, firstByteAt: null, endAt: null, error: null};
    P.run = run;
    window.cvfPlayback = run;
    P.runs.push(run);
    return (async () => {
      const form = new FormData();
      const put = (k, x) => { if (x !== null && x !== undefined && x !== "") form.append(k, String(x)); };
      put("input", v.text); put("model", "cosyvoice2"); put("response_format", "pcm"); put("request_id", id);
      put("mode", v.mode); put("seed", v.seed); put("speed", v.stream ? 1 : v.speed);
      for (const k of ["token_hop_len_first", "token_hop_len", "pre_lookahead_len", "stream_scale_factor"]) put(k, v[k]);
      if (Number(v.max_tokens) > 0) put("max_tokens", v.max_tokens);
      form.append("backends", JSON.stringify({llm: v.llm, flow: v.flow, vocoder: v.vocoder, dtype: v.dtype,
                                              incremental: !!v.incremental_flow}));
      if (v.mode === "speaker") put("voice", v.speaker);
      else {
        const b = await promptBlob(v.prompt_upload || v.prompt_mic);
        if (b) form.append("prompt_audio", b, "prompt");
        if (v.mode === "zero_shot") put("prompt_text", v.prompt_text);
        if (v.mode === "instruct2") put("instruction", v.instruct_text);
      }
      setStatus("requesting…");
      const resp = await fetch(api("v1/audio/speech"), {method: "POST", body: form, signal: run.abort.signal,
                                                        credentials: "same-origin"});
      if (!resp.ok) {
        run.endAt = performance.now();
        let msg = resp.status + "";
        try { msg = (await resp.json()).error.message; } catch (e) {}
        run.error = msg; setStatus("not played: " + msg); return;
      }
      const reader = resp.body.getReader();
      let carry = null;
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        if (run.firstByteAt === null) run.firstByteAt = performance.now();
        let bytes = value;
        if (carry) { bytes = new Uint8Array(carry.length + value.length); bytes.set(carry); bytes.set(value, carry.length); }
        const n = bytes.length >> 1;
        carry = bytes.length & 1 ? bytes.slice(bytes.length - 1) : null;
        if (!n) continue;
        const dv = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
        const f = new Float32Array(n);
        for (let i = 0; i < n; i++) f[i] = dv.getInt16(2 * i, true) / 32768;
        const buf = ctx.createBuffer(1, n, P.sampleRate);
        buf.copyToChannel(f, 0);
        const src = ctx.createBufferSource();
        src.buffer = buf;
        src.connect(ctx.destination);
        const now = ctx.currentTime + LEAD_S;
        if (run.samples && run.next < now) run.underruns += 1;  // the previous audio ran out: an audible gap
        const at = Math.max(run.next, now);
        src.start(at);
        run.sources.push(src);
        if (run.heardAt === null) {
          run.firstAt = at;
          run.heardAt = pageTime(ctx, at);
          const heard = run.heardAt - run.clickAt;
          run.heardMs = heard;
          fetch(api("v1/requests/" + id + "/client"), {method: "POST", credentials: "same-origin",
                headers: {"Content-Type": "application/json"},
                body: JSON.stringify({heard_ms: heard, first_byte_ms: run.firstByteAt - run.clickAt})});
          setStatus("playing · heard " + heard.toFixed(0) + " ms after the click");
        }
        run.next = at + n / P.sampleRate;
        run.samples += n;
        run.chunks += 1;
      }
      run.endAt = performance.now();
      run.playedWhenEnded = ctx.currentTime >= run.firstAt;  // the first sample was already out at stream end
      setStatus("played " + (run.samples / P.sampleRate).toFixed(2) + " s · heard " + run.heardMs.toFixed(0) +
                " ms after the click · " + run.underruns + " gaps");
      return run;
    })().catch((e) => {
      if (run.stopped || abort.signal.aborted) { run.stopped = true; setStatus("stopped"); return run; }
      run.error = String(e); setStatus("not played: " + e);
      return run;
    });
  }
  P.runs = [];
  P.start = (id, v, t0) => {
    P.stop();
    P.runs = [];
    return play(id, v, t0, new AbortController());
  };
  P.sequence = async (items) => {  // A then B: B is requested when A has finished playing
    P.stop();
    P.runs = [];
    const abort = new AbortController();
    for (const [id, v] of items) {
      if (abort.signal.aborted) break;
      if (id !== items[0][0]) {
        const prev = P.run;
        const wait = prev && prev.next ? Math.max(0, (prev.next - P.ctx.currentTime) * 1000) : 0;
        await new Promise((r) => setTimeout(r, wait));
        if (abort.signal.aborted || (prev && prev.stopped)) break;
      }
      await play(id, v, performance.now(), abort);
    }
  };
  P.click = (names, values) => {
    const t0 = clickAt !== null && performance.now() - clickAt < 2000 ? clickAt : performance.now();
    clickAt = null;
    const v = Object.fromEntries(names.map((n, i) => [n, values[i]]));
    const id = newId();
    try { P.start(id, v, t0); } catch (e) { console.error(e); return values; }
    values[names.indexOf("client_request_id")] = id;
    return values;
  };
  async function warm(v) {  // analyse the prompt voice once (a 1-token request), so A and B both find it cached
    const f = new FormData();
    f.append("input", "."); f.append("response_format", "pcm"); f.append("max_tokens", "1");
    f.append("mode", v.mode === "speaker" ? "speaker" : "cross_lingual");
    if (v.mode === "speaker") f.append("voice", v.speaker);
    else { const b = await promptBlob(v.prompt_upload || v.prompt_mic); if (b) f.append("prompt_audio", b, "prompt"); }
    const r = await fetch(api("v1/audio/speech"), {method: "POST", body: f, credentials: "same-origin"});
    await r.arrayBuffer();
  }
  P.abClick = (names, values, voiceNames, cfgNames) => {
    const all = Object.fromEntries(names.map((n, i) => [n, values[i]]));
    const pick = (p) => Object.fromEntries([...voiceNames.map((n) => [n, all[n]]),
                                             ...cfgNames.map((n) => [n, all[p + n]])]);
    const ids = [newId(), newId()];
    context();
    (async () => {
      try { await warm(all); } catch (e) { console.warn("prompt warm-up failed", e); }
      await P.sequence([[ids[0], pick("a_")], [ids[1], pick("b_")]]);
    })();
    values[names.indexOf("client_request_ids")] = ids.join(",");
    return values;
  };
  window.cvfPlayer = P;
})();
</script>
"""


def click_js(names: Sequence[str]) -> str:
    """The Synthesize button's ``js=``: starts the page's stream and hands its request id to the Gradio event."""
    return f"(...values) => window.cvfPlayer ? window.cvfPlayer.click({json.dumps(list(names))}, values) : values"


def ab_click_js(names: Sequence[str], voice: Sequence[str], cfg: Sequence[str]) -> str:
    """The A/B button's ``js=``: warms the prompt, plays A, then B once A has played, and hands both ids over."""
    n, v, c = (json.dumps(list(x)) for x in (names, voice, cfg))
    return f"(...values) => window.cvfPlayer ? window.cvfPlayer.abClick({n}, values, {v}, {c}) : values"


STOP_JS = "(rid) => window.cvfPlayer ? window.cvfPlayer.stop() : rid"
