"""The one scheduler: admission, per-request state, the LLM side and the chunk side, the stage set each request runs
on.
"""
