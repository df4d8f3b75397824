"""The page's player: Synthesize fetches ``POST /v1/audio/speech`` (pcm) and plays it through Web Audio from the
first chunk, while the Gradio event (given the same request id) draws the dashboard.

Playback: an ``AudioContext`` at the engine's sample rate (no resampling between buffers), each network read turned
into an ``AudioBufferSourceNode`` started exactly where the previous one ends (sample-aligned, so no gap and no
click between chunks; a chunk that arrives after its predecessor finished is an underrun, counted).  "Heard at" is
click -> the moment the first sample leaves the output (``getOutputTimestamp`` maps the scheduled context time to
the page clock, so the output latency is included); the page reports it to ``/v1/requests/{id}/client`` and the
dashboard draws it as its own bar.  ``window.cvfPlayback`` holds the figures of the last run (the browser test
reads them).

The player is visible (:data:`PLAYER_HTML`): pause / resume (suspends the audio context, so the schedule holds),
a bar of what was heard and what has arrived, the time, and a volume slider (a gain node every chunk goes
through).  Stop reads the audio heard so far from the same clock (``getOutputTimestamp``: the context time now at
the speakers) and hands it to the Stop event, so "stopped after 1.02 s heard" is what the listener heard, not
what the engine had made.  The run's status is the page's one status line (the Gradio event's); the player only
shows its time.
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
  // a server-issued session key: the page's request ids are labels inside it, and "<session>.<id>" is the address
  // the Gradio events (dashboard, Stop) use; a bare id addresses nothing (see serving/store.py)
  let session = "";
  const sessionReady = fetch(api("v1/sessions"), {method: "POST", credentials: "same-origin"})
    .then((r) => (r.ok ? r.json() : {})).then((j) => { session = j.session || ""; }).catch(() => {});
  const addr = (id) => (session && id ? session + "." + id : "");
  const P = {ctx: null, run: null, sampleRate: 24000, gain: null, volume: 1};
  function context() {
    if (!P.ctx) {
      P.ctx = new AudioContext({sampleRate: P.sampleRate, latencyHint: "interactive"});
      P.gain = P.ctx.createGain();
      P.gain.gain.value = P.volume;
      P.gain.connect(P.ctx.destination);
    }
    if (P.ctx.state === "suspended") P.ctx.resume();
    return P.ctx;
  }
  function atSpeakers(ctx) {  // the context time whose sample is leaving the speakers now
    const ts = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
    if (ts && ts.contextTime > 0) return ts.contextTime;
    return ctx.currentTime - (ctx.outputLatency || ctx.baseLatency || 0);
  }
  P.heard = (run) => {  // seconds of the run's audio heard so far: its buffers' time before the speakers' clock
    if (!run || run.firstAt === undefined || !P.ctx) return 0;  // (gaps after an underrun are not audio)
    const end = run.stoppedAt !== undefined ? run.stoppedAt : atSpeakers(P.ctx);
    let heard = 0;
    for (const [at, dur] of run.spans) heard += Math.max(0, Math.min(dur, end - at));
    return heard;
  };
  const $ = (id) => document.getElementById(id);
  function draw() {  // the player's bar and time, a few times a second while a run is on
    const run = P.run, got = run ? run.samples / P.sampleRate : 0, heard = P.heard(run);
    const total = Math.max(got, 0.001);
    if ($("cvf-heard")) $("cvf-heard").style.width = (100 * heard / total) + "%";
    if ($("cvf-time")) $("cvf-time").textContent = heard.toFixed(1) + " / " + got.toFixed(1) + " s";
    if ($("cvf-pause")) {
      $("cvf-pause").disabled = !run || run.firstAt === undefined || run.stoppedAt !== undefined;
      $("cvf-pause").textContent = P.ctx && P.ctx.state === "suspended" ? "Play" : "Pause";
    }
  }
  setInterval(draw, 100);
  document.addEventListener("click", (e) => {
    if (!(e.target.closest && e.target.closest("#cvf-pause")) || !P.ctx) return;
    if (P.ctx.state === "running") P.ctx.suspend(); else P.ctx.resume();
    setTimeout(draw, 20);
  });
  document.addEventListener("input", (e) => {
    if (e.target.id !== "cvf-volume") return;
    P.volume = Number(e.target.value);
    if (P.gain) P.gain.gain.value = P.volume;
  });
  function pageTime(ctx, t) {  // page clock (performance.now) at which context time t reaches the speakers
    const ts = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
    if (ts && ts.performanceTime > 0) return ts.performanceTime + (t - ts.contextTime) * 1000;
    return performance.now() + (t - ctx.currentTime + (ctx.outputLatency || ctx.baseLatency || 0)) * 1000;
  }
  P.stop = () => {  // -> [request id, seconds heard, seconds received] of the run Stop ended
    const run = P.run;
    if (!run) return ["", null, null];
    if (P.ctx && run.firstAt !== undefined && run.stoppedAt === undefined) run.stoppedAt = atSpeakers(P.ctx);
    const heard = P.heard(run);
    run.abort.abort();
    for (const r of P.runs || []) for (const s of r.sources) { try { s.stop(); } catch (e) {} }
    run.stopped = true;
    run.heardAtStop = heard;
    if (P.ctx && P.ctx.state === "suspended") P.ctx.resume();
    return [addr(run.id), heard, run.samples / P.sampleRate];
  };
  function play(id, v, t0, abort) {
    const ctx = context();  // inside the click's user activation: allowed to start sound
    const run = {id, clickAt: t0, abort, sources: [], spans: [], stopped: false, next: 0,
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
      run.fetchAt = performance.now();
      await sessionReady;
      run.address = addr(id);  // how the server knows this request ("<session>.<id>")
      const resp = await fetch(api("v1/audio/speech"), {method: "POST", body: form, signal: run.abort.signal,
                                                        credentials: "same-origin",
                                                        headers: session ? {"X-Session": session} : {}});
      if (!resp.ok) {
        run.endAt = performance.now();
        let msg = resp.status + "";
        try { msg = (await resp.json()).error.message; } catch (e) {}
        run.error = msg; return run;  // the Gradio event says why, in the status line
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
        src.connect(P.gain);
        const now = ctx.currentTime + LEAD_S;
        if (run.samples && run.next < now) run.underruns += 1;  // the previous audio ran out: an audible gap
        const at = Math.max(run.next, now);
        src.start(at);
        run.sources.push(src);
        run.spans.push([at, n / P.sampleRate]);
        if (run.heardAt === null) {
          run.firstAt = at;
          run.heardAt = pageTime(ctx, at);
          const heard = run.heardAt - run.clickAt;
          run.heardMs = heard;
          fetch(api("v1/requests/" + addr(id) + "/client"), {method: "POST", credentials: "same-origin",
                headers: {"Content-Type": "application/json"},
                body: JSON.stringify({heard_ms: heard, first_byte_ms: run.firstByteAt - run.clickAt,
                                      click_to_fetch_ms: run.fetchAt - run.clickAt})});
        }
        run.next = at + n / P.sampleRate;
        run.samples += n;
        run.chunks += 1;
      }
      run.endAt = performance.now();
      run.playedWhenEnded = ctx.currentTime >= run.firstAt;  // the first sample was already out at stream end
      return run;
    })().catch((e) => {
      if (run.stopped || abort.signal.aborted) { run.stopped = true; return run; }
      run.error = String(e); console.warn("playback failed", e);
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
  // async: Gradio awaits the hook; a click before the page's session key arrived waits for it, else the request
  // would go out with no address and the server would synthesise it a second time on its own
  P.click = async (names, values) => {
    const t0 = clickAt !== null && performance.now() - clickAt < 2000 ? clickAt : performance.now();
    clickAt = null;
    await sessionReady;
    const v = Object.fromEntries(names.map((n, i) => [n, values[i]]));
    const id = newId();
    // no text: nothing to request (the event's check says so in the status line); stop what was playing
    if (!String(v.text || "").trim()) {
      P.stop();
      values[names.indexOf("client_request_id")] = addr(id);
      return values;
    }
    try { P.start(id, v, t0); } catch (e) { console.error(e); return values; }
    values[names.indexOf("client_request_id")] = addr(id);
    return values;
  };
  async function warm(v) {  // analyse the prompt voice once (a 1-token request), so A and B both find it cached
    const f = new FormData();  // a real word: punctuation alone has nothing to speak and is refused (400)
    f.append("input", "Hello."); f.append("response_format", "pcm"); f.append("max_tokens", "1");
    f.append("mode", v.mode === "speaker" ? "speaker" : "cross_lingual");
    if (v.mode === "speaker") f.append("voice", v.speaker);
    else { const b = await promptBlob(v.prompt_upload || v.prompt_mic); if (b) f.append("prompt_audio", b, "prompt"); }
    const r = await fetch(api("v1/audio/speech"), {method: "POST", body: f, credentials: "same-origin"});
    await r.arrayBuffer();
    if (!r.ok) throw new Error("prompt warm-up refused (" + r.status + ")");
  }
  P.abClick = async (names, values, voiceNames, cfgNames) => {
    await sessionReady;
    const all = Object.fromEntries(names.map((n, i) => [n, values[i]]));
    const pick = (p) => Object.fromEntries([...voiceNames.map((n) => [n, all[n]]),
                                             ...cfgNames.map((n) => [n, all[p + n]])]);
    const ids = [newId(), newId()];
    context();
    (async () => {
      try { await warm(all); } catch (e) { console.warn("prompt warm-up failed", e); }
      await P.sequence([[ids[0], pick("a_")], [ids[1], pick("b_")]]);
    })();
    values[names.indexOf("client_request_ids")] = session ? ids.map(addr).join(",") : "";
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


STOP_JS = ("(rid, heard, received) => { if (!window.cvfPlayer) return [rid, null, null];"
           " const r = window.cvfPlayer.stop(); return r[0] ? r : [rid, null, null]; }")

PLAYER_HTML = """<div id="cvf-player" class="cvf-player" title="the stream, played from its first chunk (Web Audio)">
<button id="cvf-pause" type="button" disabled>Pause</button>
<div class="cvf-bar"><div id="cvf-heard"></div></div>
<span id="cvf-time">0.0 / 0.0 s</span>
<label class="cvf-vol">volume <input id="cvf-volume" type="range" min="0" max="1" step="0.05" value="1"></label>
</div>"""

PLAYER_CSS = """
.cvf-player {display:flex; align-items:center; gap:12px; padding:6px 10px; border:1px solid #ddd; border-radius:8px}
.cvf-player button {min-width:64px; padding:2px 10px; border:1px solid #bbb; border-radius:6px; background:#f6f6f6}
.cvf-bar {flex:1; height:8px; background:#e6e6e6; border-radius:4px; overflow:hidden}
#cvf-heard {height:100%; width:0; background:#6366f1}
#cvf-time {font-variant-numeric:tabular-nums; min-width:100px; text-align:right}
.cvf-vol {display:flex; align-items:center; gap:6px; font-size:0.85em; color:#555}
"""
