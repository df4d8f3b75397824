"""One GPU run: the flow encoder's graphs with the eager encoder against the fused one (``kernels/encoder_fused``).

    PYTHONUNBUFFERED=1 python benchmarks/encoder_fused_check.py --out $OUT/encoder_fused_check.json

Full-size flow (CosyVoice2-0.5B sizes, seeded random weights; timing does not depend on weight values, and the
position biases are randomised so both score terms are live), bf16, the engine's default token buckets (its
frame buckets / 2).  The graph encoder of the ``cudagraph`` flow (eager encoder captured) and the ``fused`` one
(:class:`FusedEncoder` captured), the same calls through :meth:`GraphEncoder.encode_rows`, streaming mode.
Cases: one request's first chunk (75 prompt + 28 tokens, 3 of them look-ahead: the 125-token bucket), a
second-chunk recompute (75 + 53 tokens), and the first chunk of 4 and 16 requests at once.  Steps:

- ``graphs``: median GPU ms (CUDA events) per call, three alternating rounds of 50 calls; kernels per call, and
  for the first chunk their count and summed µs by name; the largest |mu| difference between the two in bf16,
  and each one's against the eager encoder in fp32.
- ``gemms``: per encoder GEMM kind at a first chunk's row counts, 10 launches with distinct weights in one graph
  (the stages' 10 blocks): µs per launch for ``linear``'s own choice, its row-tiled kernel, one-shot tile
  variants and (position projection) cuBLAS; the fastest per kind over both row counts is kept for ``graphs``,
  which then also times a ``fused_tuned`` encoder with it.
- ``tiles``: the attention kernel's tile table (``RELPOS_TUNING``) in a few variants, each captured into its
  own fused graph encoder, the one-request cases timed in alternating rounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.estimator_rows_sweep import by_name  # noqa: E402
from benchmarks.steps import alternating_rounds, gpu_runner, step_args, time_call  # noqa: E402

PROMPT = 75
CASES = {"first_chunk": (1, 28), "second_chunk": (1, 53), "first_chunk_x4": (4, 28), "first_chunk_x16": (16, 28)}
#: GEMM kinds of the encoder at a first chunk's rows (125-token bucket: 125 rows below the upsampling, 250 above;
#: the position projection has 2T-1 rows): (N, K, LayerNorm prologue, activation, residual, rows)
GEMM_KINDS = {"qkv": (1536, 512, True, 0, False, (125, 250)), "out": (512, 512, False, 0, True, (125, 250)),
              "ff1": (2048, 512, True, 2, False, (125, 250)), "ff2": (512, 2048, False, 0, True, (125, 250)),
              "pos": (3072, 512, False, 0, False, (249, 499))}
ONESHOT_VARIANTS = {  # (bm, bn, warps[, bk, stages]); the LayerNorm kinds take the whole row (bk = K)
    "qkv": [(16, 64, 4), (32, 64, 4), (16, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 8), (16, 32, 4)],
    "ff1": [(16, 64, 4), (32, 64, 4), (16, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 8), (16, 32, 4)],
    "out": [(16, 16, 4), (16, 32, 4), (32, 32, 4), (32, 16, 4), (32, 64, 4), (64, 32, 4), (32, 32, 4, 256, 2)],
    "ff2": [(16, 32, 4, 512, 2), (32, 32, 4, 256, 2), (32, 16, 4, 512, 2), (16, 16, 4, 1024, 1),
            (64, 32, 4, 256, 2), (32, 64, 4, 256, 3), (16, 64, 4, 256, 3), (32, 32, 4, 512, 2)],
    "pos": [(32, 64, 4), (64, 64, 4), (64, 128, 8), (32, 128, 4), (64, 64, 4, 256, 2)],
}
#: what the ``gemms`` step found fastest per kind, used by a later ``graphs`` step of the same run
TUNED: dict = {}
VARIANTS = {"bm32_bn64": {"bm": 32, "bn": 64}, "bm64_bn64": {"bm": 64, "bn": 64}, "bm16_bn64": {"bm": 16, "bn": 64},
            "bm32_bn32": {"bm": 32, "bn": 32}, "bm32_bn128": {"bm": 32, "bn": 128}}


def _flow(dtype: torch.dtype) -> torch.nn.Module:
    from cosyvoice_fast.config.model import full_config
    from cosyvoice_fast.flow.model.flow import CausalMaskedDiffWithXvec
    from cosyvoice_fast.flow.model.encoder_layers import RelPositionSelfAttention

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        flow = CausalMaskedDiffWithXvec(full_config().flow).eval().requires_grad_(False)
        for m in flow.modules():
            if isinstance(m, RelPositionSelfAttention):
                m.pos_bias_u.normal_()
                m.pos_bias_v.normal_()
    return flow.cuda().to(dtype)


def _rows(flow: torch.nn.Module, n_rows: int, n_new: int, dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(n_rows * 100 + n_new)
    la = flow.encoder.cfg.pre_lookahead_len
    out = []
    for _ in range(n_rows):
        ids = torch.randint(0, flow.cfg.vocab_size, (1, PROMPT + n_new), generator=g).cuda()
        emb = torch.randn(1, flow.cfg.spk_embed_dim, generator=g).cuda().to(dtype)
        out.append((ids, PROMPT + n_new - la, emb))
    return out


def main() -> int:
    out, steps = step_args("gemms,graphs,tiles")
    runner = gpu_runner("encoder_fused_check.py", out, step_timeout=400)

    def encoders(flow: torch.nn.Module, modes: list[str]) -> dict:
        from cosyvoice_fast.flow.graph_encoder import GraphEncoder, token_buckets
        from cosyvoice_fast.config.engine import EngineConfig
        from cosyvoice_fast.flow.kernels.encoder_fused import FusedEncoder

        buckets = EngineConfig().flow_buckets
        assert 125 in token_buckets(buckets, 2, 25, 750)
        encode = {"eager": lambda: None, "fused": lambda: FusedEncoder(flow).encode_padded,
                  "fused_tuned": lambda: FusedEncoder(flow, gemms=TUNED).encode_padded}
        return {m: GraphEncoder(flow, torch.device("cuda"), buckets, encode=encode[m]()) for m in modes}

    def gemms() -> dict:
        import torch.nn.functional as F

        from cosyvoice_fast.flow.kernels.estimator_linear import PRO_LN, PRO_NONE, linear
        from cosyvoice_fast.flow.kernels.estimator_oneshot import linear_oneshot
        from cosyvoice_fast.bench.estimator_profile import graph_replay_ms

        g = torch.Generator(device="cuda").manual_seed(0)
        r: dict = {"us_per_launch": {}, "best": {}}
        for kind, (n, k, ln, act, res, row_counts) in GEMM_KINDS.items():
            ws = [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16() for _ in range(10)]
            b = torch.randn(n, device="cuda", generator=g).bfloat16() if kind != "pos" else None
            norm = (torch.ones(k, device="cuda", dtype=torch.bfloat16),
                    torch.zeros(k, device="cuda", dtype=torch.bfloat16), 1e-5)
            cands = {"default": None, "rowtiled": "rowtiled"}
            cands.update({"oneshot_" + "x".join(map(str, v)): v for v in ONESHOT_VARIANTS[kind]})
            if kind == "pos":
                cands["cublas"] = "cublas"
            per: dict = {}
            for m in row_counts:
                x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
                resid = torch.randn(m, n, device="cuda", generator=g).bfloat16() if res else None
                kw = dict(prologue=PRO_LN if ln else PRO_NONE, ln=norm if ln else None, act=act, residual=resid)

                def launch(how, w):  # noqa: ANN001, ANN202
                    if how is None:
                        return linear(x, w, b, **kw)
                    if how == "rowtiled":
                        return linear(x, w, b, oneshot=False, **kw)
                    if how == "cublas":
                        return F.linear(x, w)
                    t = {"bm": how[0], "bn": how[1], "warps": how[2]}
                    if len(how) > 3:
                        t.update(bk=how[3], stages=how[4])
                    return linear_oneshot(x, w, b, tiles=t, **kw)

                for name, how in cands.items():
                    ms = graph_replay_ms(lambda: [launch(how, w) for w in ws], iters=50)
                    per.setdefault(name, {})[str(m)] = round(ms * 100, 2)  # µs per launch
            r["us_per_launch"][kind] = per
            name = min(per, key=lambda c: sum(per[c].values()))
            r["best"][kind] = name
            how = cands[name]
            if how is not None:
                TUNED[kind] = how if isinstance(how, str) else dict(
                    zip(("bm", "bn", "warps", "bk", "stages"), how))
        r["tuned"] = dict(TUNED)
        return r

    def graphs() -> dict:
        from cosyvoice_fast.bench.estimator_profile import count_kernels, kernel_times

        flow = _flow(torch.bfloat16)
        flow32 = _flow(torch.float32)
        encs = encoders(flow, ["eager", "fused"])
        if TUNED:
            encs.update(encoders(flow, ["fused_tuned"]))
        rows = {k: _rows(flow, *v, torch.bfloat16) for k, v in CASES.items()}
        r: dict = {"kernels": {}, "mu_diff_bf16": {}, "mu_err_vs_fp32": {}}
        with torch.inference_mode():
            for label, rs in rows.items():
                mus = {m: [e.mu for e in encs[m].encode_rows(rs, True)] for m in encs}  # captures the graphs
                ref = [flow32.encode_padded(i, torch.tensor([i.shape[1]], device="cuda"),
                                            torch.tensor([b], device="cuda"), e.float(), streaming=True).mu
                       for i, b, e in rs] if label == "first_chunk" else None
                r["mu_diff_bf16"][label] = max((a.float() - b.float()).abs().max().item()
                                               for a, b in zip(mus["eager"], mus["fused"]))
                if ref is not None:
                    r["mu_err_vs_fp32"][label] = {m: max((a.float() - b[..., :a.shape[2]]).abs().max().item()
                                                         for a, b in zip(mus[m], ref)) for m in mus}
                for m, enc in encs.items():
                    r["kernels"][f"{m}_{label}"] = count_kernels(lambda: enc.encode_rows(rs, True))
            for m, enc in encs.items():  # where one first-chunk call's GPU time goes, by kernel name
                r.setdefault("kernel_names", {})[m] = by_name(
                    kernel_times(lambda: enc.encode_rows(rows["first_chunk"], True)), top=30)  # noqa: B023
            r.update(alternating_rounds(rows, list(encs), lambda rs, m: time_call(
                lambda: encs[m].encode_rows(rs, True), warmup=3, iters=50)["median_ms"]))
        return r

    def tiles() -> dict:
        from cosyvoice_fast.flow.kernels import encoder_attention

        flow = _flow(torch.bfloat16)
        saved = dict(encoder_attention.RELPOS_TUNING)
        encs, cases = {}, {k: _rows(flow, *CASES[k], torch.bfloat16) for k in ("first_chunk", "second_chunk")}
        try:
            with torch.inference_mode():
                for name, tile in VARIANTS.items():
                    encoder_attention.RELPOS_TUNING.update(tile)  # read at launch: captured into this variant
                    encs[name] = encoders(flow, ["fused"])["fused"]
                    for rs in cases.values():
                        encs[name].encode_rows(rs, True)
        finally:
            encoder_attention.RELPOS_TUNING.clear()
            encoder_attention.RELPOS_TUNING.update(saved)
        with torch.inference_mode():
            return alternating_rounds(cases, list(VARIANTS), lambda rs, m: time_call(
                lambda: encs[m].encode_rows(rs, True), warmup=3, iters=50)["median_ms"])

    for name, fn in (("gemms", gemms), ("graphs", graphs), ("tiles", tiles)):
        if name in steps:
            runner.run(name, fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
