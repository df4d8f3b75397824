"""``python -m cosyvoice_fast.bench``: the engine benchmark (:mod:`cosyvoice_fast.bench.engine_bench`)."""

from cosyvoice_fast.bench.engine_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
