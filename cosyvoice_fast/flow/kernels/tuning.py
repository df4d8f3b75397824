"""Launch settings and tile tables of the flow's fused kernels, as frozen objects passed in at construction.

:class:`FlowTuning` holds every knob the estimator and encoder kernels read: which GEMM path a launch of so
many rows takes, programmatic dependent launch, and the tile table of each kernel kind.  :data:`GPU` is the
shipped setting (the fastest of the variants timed on an H100); :data:`INTERPRETER` is the same object with
tiles for Triton's CPU interpreter, where every program is a Python loop iteration, so few tall tiles run much
faster.  :func:`default_tuning` picks between the two; a benchmark or test that wants another setting builds one
with :func:`dataclasses.replace` and passes it to :class:`~.estimator_fused.FusedEstimator`,
:class:`~.encoder_fused.FusedEncoder` or a kernel wrapper's ``tuning=`` -- nothing reads a mutable global.

Why the GPU values: the estimator's forward of a few hundred rows is a chain of ~340 launch-bound kernels, where a
kernel's time depends on its neighbours' grids (the next kernel's programs start, and park, while it drains), so
the GEMM, attention and convolution tiles for one request's CFG pair (:attr:`FlowTuning.pair_rows`, the flow's
frame buckets from 100 to 250) were chosen together over the whole forward; at 2 x 56 frames those tiles were
slower, hence the lower bound.  From :attr:`FlowTuning.large_m` rows (a batched solve) taller tiles win, because
thin 32-row tiles re-read every weight tile per 32 rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from torch import Tensor

from cosyvoice_fast.kernels.common import interpreting
from cosyvoice_fast.kernels.pdl import pdl_options

class Tiles(Mapping[str, object]):
    """A read-only, hashable table: a kernel's tile extents (``bm``/``bn``/``bk``), ``warps``, pipeline ``stages``
    and kind-specific entries, or a table of such tables."""

    __slots__ = ("_items",)

    def __init__(self, **items: object):
        self._items = dict(items)

    def __getitem__(self, key: str) -> object:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __repr__(self) -> str:
        return f"Tiles({', '.join(f'{k}={v!r}' for k, v in self._items.items())})"




@dataclass(frozen=True)
class FlowTuning:
    """Every launch setting of the flow kernels (GPU values by default; see the module docstring)."""

    #: programmatic dependent launch (:mod:`~cosyvoice_fast.kernels.pdl`) for launches of at most
    #: ``pdl_max_rows`` rows: with several waves of programs the parked programs of the next kernel cost more
    #: than the hidden gap (8 x 206 rows measured 4.35 -> 4.61 ms with it)
    pdl: bool = True
    pdl_max_rows: int = 1024
    #: the row-tiled GEMMs load their first weight tile before the PDL wait
    early_weights: bool = True
    #: ``linear`` calls of at most ``oneshot_max_rows`` rows run as one-shot GEMMs (except the Mish and
    #: sinusoidal prologues and a ``norm_out`` request): up to one CFG pair at the 250-frame bucket the one-shot
    #: GEMMs with the pair tiles beat the row-tiled ones at every measured length
    oneshot: bool = True
    oneshot_max_rows: int = 512
    #: rows (inclusive) of a 16-bit launch that get the pair tiles
    pair_rows: tuple[int, int] = (129, 512)
    #: rows from which 16-bit GEMMs take the many-rows path (cuBLAS or the tall kernel): one request's 300- and
    #: 450-frame chunks already run faster there; its 206-frame first chunk (412 rows) is still launch-bound
    many_rows_m: int = 512
    #: rows from which launches with a ``large`` tile setting use it
    large_m: int = 2048
    #: rows up to which a one-shot launch counts as "few" for its tile choice (a CFG pair of up to 128 frames)
    few_rows: int = 256
    #: rows up to which the ResNet convs run split from their LayerNorm (a GEMM spread over output channels
    #: plus a row pass): below it the whole-row kernel has too few programs to fill the GPU
    split_ln_max_rows: int = 1024
    #: row-tiled GEMM (``estimator_linear.linear``); ``min_programs``: narrow tiles until a launch has that many
    linear: Tiles = Tiles(bm=32, bn=64, bk=128, warps=4, stages=3, min_programs=132)
    linear_fp32: Tiles = Tiles(bm=32, bn=64, bk=64, warps=4, stages=3)
    #: causal convolutions; ``ln_*`` apply to the LayerNorm-epilogue variant, whose programs hold whole rows
    conv: Tiles = Tiles(bm=32, bn=64, bk=128, warps=4, ln_bm=16, ln_warps=8, stages=3, min_programs=132)
    conv_large: Tiles = Tiles(bm=64, bn=128, bk=64, warps=4, ln_bm=32, ln_warps=8, stages=3)
    conv_pair: Tiles = Tiles(bm=16, bn=64, bk=128, warps=4, ln_bm=16, ln_warps=8, stages=3, min_programs=132)
    conv_fp32: Tiles = Tiles(bm=32, bn=64, bk=64, warps=4, ln_bm=16, ln_warps=8, stages=2)
    #: rows per program of the conv's separate LayerNorm pass (``estimator_conv.row_epilogue``)
    row_bm: int = 8
    #: estimator attention: batch rows of more than 32 frames, of at most 32, and over ``pair_rows`` rows
    attn: Tiles = Tiles(bm=64, bn=64, warps=4, stages=3)
    attn_small: Tiles = Tiles(bm=16, bn=16, warps=4, stages=3)
    attn_pair: Tiles = Tiles(bm=32, bn=128, warps=4, stages=3)
    #: one-shot GEMMs by kind: ``pair_*`` over ``pair_rows`` rows (q/k/v, FF1, out-projection, FF2);
    #: ``small_k`` (K <= 256: q/k/v and FF1) and ``small_k_wide`` (beyond ``few_rows`` with N >= 1536);
    #: ``out_few``/``out_many`` (K <= 512, the out-projection); ``ff2_few``/``ff2_many`` (K of 1024); ``fp32``
    oneshot_tiles: Tiles = Tiles(
        pair_qkv=Tiles(bm=32, bn=256, warps=8), pair_ff1=Tiles(bm=32, bn=128, warps=8),
        pair_out=Tiles(bm=32, bn=32, warps=4), pair_ff2=Tiles(bm=64, bn=16, warps=4, bk=256, stages=2),
        small_k=Tiles(bm=32, bn=64, warps=4), small_k_wide=Tiles(bm=64, bn=128, warps=8),
        out_few=Tiles(bm=16, bn=16, warps=4), out_many=Tiles(bm=64, bn=64, warps=4),
        ff2_few=Tiles(bm=32, bn=16, warps=4, bk=1024, stages=1),
        ff2_many=Tiles(bm=64, bn=16, warps=4, bk=256, stages=2),
        fp32=Tiles(bm=16, bn=16, warps=4, bk=256, stages=2))
    #: the tall many-rows GEMM; ``tall_norm``: launches that also write the next LayerNorm (``bn`` = the row)
    tall: Tiles = Tiles(bm=64, bn=128, bk=64, warps=4, stages=3)
    tall_norm: Tiles = Tiles(bm=64, bk=64, warps=8, stages=3)
    #: the cuBLAS path's epilogue pass: (rows, columns) per program; None = 32 rows x up to 128 columns
    epilogue_tiles: tuple[int, int] | None = None
    #: its LayerNorm-writing pass: rows per program; None = about 4K fp32 values per program
    norm_epilogue_bm: int | None = None
    #: the encoder's relative-position attention, 16-bit and fp32 operands (the band is ``bm + bn - 1`` rows)
    relpos: Tiles = Tiles(bm=16, bn=64, warps=4, stages=2)
    relpos_fp32: Tiles = Tiles(bm=32, bn=32, warps=4, stages=2)
    #: how each encoder GEMM kind runs at few rows (16-bit, CUDA, up to ``oneshot_max_rows`` rows): one-shot
    #: tiles, ``"rowtiled"`` or ``"cublas"``; a kind not listed takes ``linear``'s own choice.  The encoder's
    #: GEMMs are wider than the estimator's (K 512 and 2048, N up to 2048), where the estimator's one-shot tiles
    #: were 1.1-2x slower than these at a first chunk's 125 and 250 rows
    encoder_gemms: Tiles = Tiles(
        qkv=Tiles(bm=32, bn=128, warps=8),  # N = 3 D, K = D, LayerNorm prologue
        ff1=Tiles(bm=32, bn=128, warps=8),  # N = 4 D, K = D, LayerNorm prologue, SiLU
        out=Tiles(bm=32, bn=32, warps=4),  # N = D, K = D, residual
        ff2="rowtiled",  # N = D, K = 4 D, residual
        pos="cublas")  # every block's position projection of the table: N = blocks x D, 2T - 1 rows

    def pair(self, m: int) -> bool:
        """Whether a launch over ``m`` rows takes the pair tiles."""
        return self.pair_rows[0] <= m <= self.pair_rows[1]

    def pdl_kwargs(self, t: Tensor, rows: int) -> dict:
        """The ``PDL`` constexpr and launch flag of a kernel over ``rows`` rows whose operands live where ``t``
        does."""
        return pdl_options(self.pdl and rows <= self.pdl_max_rows, t)


#: The shipped GPU setting.
GPU = FlowTuning()

_INTERP_LINEAR = Tiles(bm=128, bn=64, bk=64, warps=4, stages=1)
_INTERP_CONV = Tiles(bm=128, bn=64, bk=64, warps=4, ln_bm=64, ln_warps=4, stages=1)
_INTERP_ONESHOT = Tiles(bm=64, bn=64, warps=4)
_INTERP_RELPOS = Tiles(bm=32, bn=32, warps=4, stages=1)

#: Tiles for Triton's CPU interpreter: few, tall programs everywhere; no pair tiles, no encoder GEMM table.
INTERPRETER = FlowTuning(
    linear=_INTERP_LINEAR, linear_fp32=_INTERP_LINEAR,
    conv=_INTERP_CONV, conv_large=_INTERP_CONV, conv_pair=_INTERP_CONV, conv_fp32=_INTERP_CONV, row_bm=64,
    attn_pair=GPU.attn,
    oneshot_tiles=Tiles(**{k: _INTERP_ONESHOT for k in GPU.oneshot_tiles}),
    tall=Tiles(bm=64, bn=64, bk=32, warps=4, stages=1), tall_norm=Tiles(bm=64, bn=64, bk=32, warps=4, stages=1),
    epilogue_tiles=(64, 64), norm_epilogue_bm=64,
    relpos=_INTERP_RELPOS, relpos_fp32=_INTERP_RELPOS, encoder_gemms=Tiles())


def default_tuning() -> FlowTuning:
    """:data:`INTERPRETER` under Triton's CPU interpreter (``TRITON_INTERPRET=1``), else :data:`GPU`."""
    return INTERPRETER if interpreting() else GPU
