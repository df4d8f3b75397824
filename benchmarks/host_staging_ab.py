"""Same-process A/B of how a new request's inputs reach the prefill graph and its first chunk's encoder graph.

    PYTHONUNBUFFERED=1 python benchmarks/host_staging_ab.py --out $OUT --rounds 3 --requests 32 -- \\
        --synthetic full --backends fused --dtype bf16 --flow-rows 1 --vocoder-rows 1

One service, the bench's concurrency-1 workload, alternating per round (``one_stream.ab_rounds``):

- ``before``: the host work until session 27, reproduced by patching (the graphs are the shipped ones):
  - the prefill built each LM input with eager ops (``Qwen2LM.build_lm_input``), copied it into the prefill
    graph's embedding rows and launched the first draw's Philox kernel from the host (the shipped graph takes
    such rows as given embeddings and draws the same variates again inside: a few microseconds of GPU time the
    old graph did not have);
  - the encoder call built each row's ids on the device (the tokens copied in, folded, concatenated after the
    prompt's), cleared the graph's id buffer, copied each row's ids and embedding in, and the lengths from a
    pinned buffer (here into the shipped graph's length columns).
- ``prefill``: the prefill as shipped, the encoder call as ``before``.
- ``after``: the shipped code: the prefill copies the prompt's ids into the graph's id rows and the graph
  gathers the LM input and draws the variates itself; the encoder call copies the chunk's ids and lengths in
  one host copy and the prompt's ids and the embedding by one device copy each.

Results: ``OUT/host_staging_ab.json`` (per round and variant the bench's aggregate: TTFB p50/p95 and its stages).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def before_prefill(self: Any, states: Sequence[Any]) -> list[Any]:
    """``CudaGraphLLM.prefill`` with the LM input built eagerly and the first draw launched from the host, as
    before session 27 (for the A/B only; error handling trimmed: the benchmark's requests do not fail)."""
    import torch

    from cosyvoice_fast.llm.buckets import token_budget
    from cosyvoice_fast.llm.prefill import PrefillItem

    out: list[Any] = [None] * len(states)
    items = []
    with torch.inference_mode(), self._lock:
        if self._feed is not None:
            self._feed.settle()
        for i, st in enumerate(states):
            st.slot, s = self.pool.acquire()
            self._set_mask(s, 0, st.min_len, st.ignore_eos)
            lm_input = self.llm.build_lm_input(st.text, st.prompt_text, st.prompt_speech)
            st.pos = lm_input.shape[1]
            st.max_len = token_budget(st.pos, st.max_len, self.max_len, st.ignore_eos)
            it = PrefillItem(i, st, s, lm_input=lm_input)
            if st.generator.device.type == "cuda":
                self._prefill_draw(it, in_graph=False)
            items.append(it)
        for padded, group in self.prefiller.groups(items):
            for it, token in zip(group, self.prefiller.run(padded, group)):
                out[it.index] = self._accept(it.state, self._take(it.slot, it.state.history, it.state.generator,
                                                                  token))
    return out


def before_encode_calls(self: Any, items: Sequence[Any], streaming: bool) -> list[Any]:
    """``GraphEncoder.encode_calls`` before session 27: ids built on the device (for the A/B only)."""
    import numpy as np
    import torch

    from cosyvoice_fast.flow.eager import fold_to_flow_vocab

    dev = items[0][0].flow_prompt_speech_token.device
    flat = torch.cat([tokens.reshape(-1).to(items[0][1].device) for _, tokens, _ in items]).to(dev)
    flat = fold_to_flow_vocab(flat, self.flow.cfg.vocab_size)
    rows, at = [], 0
    for inputs, tokens, call in items:
        ptok = inputs.flow_prompt_speech_token
        n = tokens.shape[-1]
        ids = torch.cat((ptok, flat[at:at + n].unsqueeze(0).to(ptok.dtype)), dim=1)
        at += n
        rows.append((ids, np.zeros(0, np.int64), ids.shape[1] - (0 if call.finalize else call.lookahead),
                     inputs.embedding))
    return self._encode(rows, streaming)


#: the shipped ``GraphEncoder._run`` (set by :func:`main`)
SHIPPED_RUN: list[Any] = []


def before_run(self: Any, bucket: Any, rows: Sequence[Any], streaming: bool) -> list[Any]:
    """``GraphEncoder._run`` before session 27, into the shipped graph's inputs (for the A/B only)."""
    import torch

    n = len(rows)
    prows = next((r for r in self.rows if r >= n), None)
    g = self.caches[bool(streaming)].graphs.get((bucket, prows, rows[0][3].dtype))
    if g is None:  # no graph for it: the shipped path's eager fallback
        return SHIPPED_RUN[0](self, bucket, rows, streaming)
    dev = rows[0][0].device
    with self.lock, torch.inference_mode():
        if self._last_replay is not None:
            torch.cuda.current_stream(dev).wait_event(self._last_replay)
        stage_in, emb_in = g.inputs
        src = [rows[j] if j < n else rows[0] for j in range(prows)]
        stage_in[:, :bucket].zero_()
        for j, (ids, _, _, emb) in enumerate(src):
            stage_in[j, :ids.shape[1]].copy_(ids[0])
            emb_in[j].copy_(emb[0])
        lens = torch.tensor([[r[0].shape[1] for r in src], [r[2] for r in src]], dtype=torch.int64).pin_memory()
        stage_in[:, bucket].copy_(lens[0], non_blocking=True)
        stage_in[:, bucket + 1].copy_(lens[1], non_blocking=True)
        g.graph.replay()
        self.caches[bool(streaming)].replays += 1
        mu, spks = g.outputs
        res = [(mu[j:j + 1, :, :self.stride * rows[j][2]].clone(), spks[j:j + 1].clone()) for j in range(n)]
        self._last_replay = torch.cuda.Event()
        self._last_replay.record(torch.cuda.current_stream(dev))
        return res


def main(argv: list[str]) -> None:
    from benchmarks import one_stream

    mine, bench_argv, out = one_stream.script_args(argv, __doc__, "benchmarks/host_staging_ab.py", one_stream.ab_flags)

    from cosyvoice_fast.llm.graph import CudaGraphLLM
    from cosyvoice_fast.flow.graph_encoder import GraphEncoder

    one = one_stream.load(bench_argv, "benchmarks/host_staging_ab.py")
    shipped = (CudaGraphLLM.prefill, GraphEncoder.encode_calls, GraphEncoder._run)
    old_encoder = (before_encode_calls, before_run)
    SHIPPED_RUN.append(GraphEncoder._run)

    def use(prefill: Any, encode_calls: Any, run: Any) -> Any:
        def apply() -> None:
            CudaGraphLLM.prefill, GraphEncoder.encode_calls, GraphEncoder._run = prefill, encode_calls, run
        return apply

    one_stream.ab_rounds(one, {"before": use(before_prefill, *old_encoder), "prefill": use(shipped[0], *old_encoder),
                               "after": use(*shipped)},
                         mine.rounds, mine.requests, out / "host_staging_ab.json", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
