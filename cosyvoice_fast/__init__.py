"""cosyvoice_fast: a fast, streaming CosyVoice2 text-to-speech engine with a latency dashboard."""

__version__ = "0.1.0"
