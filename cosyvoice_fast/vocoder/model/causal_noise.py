"""CosyVoice3's fixed NSF noise tables, reproduced by replaying upstream's random draws, and grown only as needed.

Upstream's ``SineGen2`` (causal) draws ``rand_ini = rand(1, 9)`` and a uniform ``sine_waves = rand(1, 7.2M, 9)``
table once, at construction, from torch's *global* CPU generator; the same table then serves every call, which
is what makes CosyVoice3's audio deterministic and a streamed call agree with a one-shot one.  The generator's
state at that point is fixed by upstream's load order: ``set_all_random_seed(0)`` in the flow's CFM, its
``randn(1, 80, 15000)``, the flow's ``Embedding(6561, 80)`` and ``Linear(192, 80)`` initialisers, then the f0
predictor's five convs and its linear head (weight norm draws nothing).  :func:`replay_generator` makes exactly
those draws, with the same shapes and in the same order, on a private generator (the global one is never
touched), so it works for any channel sizes the config names (the real model's 512 as well as a tiny one).

Memory: the whole table is 7.2M x 9 float32 = 259 MB.  torch's CPU ``uniform_`` is a serial kernel (one 32-bit
draw per element, in order), so drawing the table in pieces with one generator yields the same numbers as one
draw (checked in tests/test_parity_cosyvoice3_hift.py).  :class:`NoiseTable` therefore draws only the prefix the
longest request so far needed (doubling, capped at the table's length): 26 MB per 30 s of audio.  The source
module's own ``uv`` table is drawn after ``sine_waves`` and only feeds an output the generator ignores: not made.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from cosyvoice_fast.config.causal_hift import CausalHiFTConfig

#: first draw when the table grows: 2 s of audio
_MIN_GROW = 48000


def replay_generator(cfg: CausalHiFTConfig) -> torch.Generator:
    """A CPU generator in the state upstream's global one has when ``SineGen2`` starts drawing (see module doc)."""
    g = torch.Generator()
    g.manual_seed(0)

    def draw(*shape: int, normal: bool = False) -> None:
        t = torch.empty(*shape)
        t.normal_(generator=g) if normal else t.uniform_(generator=g)

    draw(*cfg.replay_cfm_noise, normal=True)  # CausalConditionalCFM's fixed noise
    draw(cfg.replay_flow_vocab_size, cfg.replay_flow_input_size, normal=True)  # flow.input_embedding
    draw(cfg.replay_flow_output_size, cfg.replay_spk_embed_dim)  # flow.spk_embed_affine_layer weight, bias
    draw(cfg.replay_flow_output_size)
    c, cin = cfg.f0_cond_channels, cfg.f0_in_channels
    draw(c, cin, 4)  # f0_predictor.condnet.0 weight, bias
    draw(c)
    for _ in range(4):  # condnet.2 .. condnet.8
        draw(c, c, 3)
        draw(c)
    draw(cfg.f0_num_class, c)  # classifier
    draw(cfg.f0_num_class)
    return g


class NoiseTable:
    """``rand_ini`` and the ``sine_waves`` table (as (N, n_harmonics) rows, one per sample), drawn lazily.

    ``state``: the generator state just before the source module is built (``torch.get_rng_state()`` there, e.g.
    a fixture's ``rng_state_before_hift``); None replays it from the config.  Thread-safe; the table only grows.
    """

    def __init__(self, cfg: CausalHiFTConfig, state: Tensor | None = None):
        self.n_harmonics = cfg.n_harmonics
        self.limit = cfg.noise_table_len
        if state is None:
            self._gen = replay_generator(cfg)
        else:
            self._gen = torch.Generator()
            self._gen.set_state(state)
        ini = torch.rand(1, self.n_harmonics, generator=self._gen)
        ini[:, 0] = 0  # no initial phase for the fundamental
        self.rand_ini = ini
        self._table = torch.empty(0, self.n_harmonics)
        self._on_device: dict[torch.device, Tensor] = {}
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> "NoiseTable":
        """Copies of a vocoder share the table: it is fixed (only ever extended with the same numbers)."""
        return self

    @property
    def drawn(self) -> int:
        """Rows (samples) drawn so far."""
        return self._table.shape[0]

    def _grow(self, n: int) -> None:
        if n > self.limit:
            raise ValueError(f"{n} samples of audio exceed CosyVoice3's noise table ({self.limit} samples = "
                             f"{self.limit // 24000} s at 24 kHz): split the text into shorter requests")
        have = self._table.shape[0]
        if n <= have:
            return
        target = min(self.limit, max(n, 2 * have, _MIN_GROW))
        more = torch.rand(1, target - have, self.n_harmonics, generator=self._gen)[0]
        self._table = torch.cat([self._table, more]) if have else more

    def rows(self, start: int, end: int, device: torch.device | str = "cpu") -> Tensor:
        """Table rows ``[start, end)`` as a (1, end - start, n_harmonics) float32 tensor on ``device``."""
        device = torch.device(device)
        with self._lock:
            self._grow(end)
            if device.type == "cpu":
                return self._table[start:end].unsqueeze(0)
            on = self._on_device.get(device)
            if on is None or on.shape[0] < end:
                have = 0 if on is None else on.shape[0]
                new = self._table[have:].to(device)
                on = new if on is None else torch.cat([on, new])
                self._on_device[device] = on
            return on[start:end].unsqueeze(0)
