"""Checkpoint compatibility for weight-normalised layers.

torch >= 2.1 stores a weight-normed layer's magnitude and direction as ``X.parametrizations.weight.original0``
and ``X.parametrizations.weight.original1``; checkpoints saved with the older ``torch.nn.utils.weight_norm``
hook call the same two tensors ``X.weight_g`` and ``X.weight_v``.  Our modules use the new parametrisation,
so an old-layout state dict is renamed before strict loading.  The tensors themselves are identical.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

_LEGACY_SUFFIXES = {
    "weight_g": "parametrizations.weight.original0",
    "weight_v": "parametrizations.weight.original1",
}


def convert_legacy_weight_norm(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return a new state dict with every ``*.weight_g`` / ``*.weight_v`` key renamed to the parametrisation
    layout; other keys (including already-new ones) pass through unchanged and in order."""
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        prefix, _, leaf = key.rpartition(".")
        new_leaf = _LEGACY_SUFFIXES.get(leaf)
        new_key = f"{prefix}.{new_leaf}" if new_leaf is not None and prefix else key
        if new_key in out:
            raise ValueError(f"state dict holds both layouts for {new_key!r}")
        out[new_key] = value
    return out
