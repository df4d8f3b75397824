"""HiFT as pure PyTorch math: the f0 predictor, the neural source and the filter network."""
