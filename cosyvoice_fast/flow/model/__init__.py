"""The flow as pure PyTorch math: the token encoder, the CFM estimator and its solver, the incremental variant."""
