"""The speech LM as pure PyTorch math (Qwen2 decoder, input rule, sampling, bi-streaming schedule)."""
