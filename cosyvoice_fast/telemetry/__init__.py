"""What each request measured (stage times, chunk timings) and the operator's one-line log. A leaf: the engine writes
it, the app, API and benchmarks read it.
"""
