"""One-shot benchmark scripts, run as ``python benchmarks/<name>.py`` from the repository root.

A package so the scripts import their shared helpers as ``benchmarks.steps`` once they have put the repository
root first on ``sys.path`` (which they do for ``cosyvoice_fast`` anyway): a unique name that no installed
module can shadow.  Nothing here is collected by pytest (no ``test_*.py``).
"""
