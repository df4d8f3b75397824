"""Settings read once and passed down: model hyperparameters (from the model directory's yaml), stream parameters,
engine capacity, backend choices, presets and command-line flags. A leaf: imports nothing else of the package.
(Frozen kernel tunings live beside their kernels, e.g. flow/kernels/tuning.py.)
"""
