"""Benchmarks and profilers: `python -m cosyvoice_fast.bench` (engine TTFB and throughput) and its siblings."""
