"""Per-request streaming parameters: how many speech tokens make each chunk, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_fast.config.yamlfile import ConfigError


@dataclass(frozen=True, slots=True)
class StreamParams:
    """Per-request chunking parameters.  Defaults reproduce upstream's schedule.

    ``token_hop_len_first`` < 25 buys earlier first audio for a possibly audible first chunk edge;
    ``pre_lookahead_len`` < 3 saves look-ahead waiting at the cost of encoder context the model was trained with.
    """

    token_hop_len_first: int = 25
    token_hop_len: int = 25
    stream_scale_factor: float = 2.0
    token_max_hop_len: int = 100
    pre_lookahead_len: int = 3

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, rule: str) -> None:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is out of range: {rule}")

        check("token_hop_len_first", isinstance(self.token_hop_len_first, int) and 1 <= self.token_hop_len_first <= 100,
              "use a whole number of tokens from 1 to 100 (default 25)")
        check("token_hop_len", isinstance(self.token_hop_len, int) and 1 <= self.token_hop_len <= 200,
              "use a whole number of tokens from 1 to 200 (default 25)")
        check("stream_scale_factor", 1.0 <= float(self.stream_scale_factor) <= 4.0,
              "use a factor from 1.0 to 4.0 (default 2)")
        check("token_max_hop_len", isinstance(self.token_max_hop_len, int)
              and self.token_hop_len <= self.token_max_hop_len <= 400,
              "use a whole number from token_hop_len to 400 (default 100)")
        check("pre_lookahead_len", isinstance(self.pre_lookahead_len, int) and 0 <= self.pre_lookahead_len <= 3,
              "use 0 to 3 tokens (the model was trained with 3)")
