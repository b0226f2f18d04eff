"""The dense prefill GEMMs in row pieces of one size (DS4_GPU_GEMM_PIECE, v38).

cuBLAS(Lt) plans a GEMM per exact problem shape, and the first call at a row count the process has not run costs
~3-4.5 ms of host time for some of the prefill's shapes while the device waits (NOTES.md v37 item 1,
bench_gemm_first.py): ds4-bench meets a new chunk length at every frontier (2048, then 6144, then 8192), and a
server meets one per prompt. Cut into pieces of PIECE rows plus a remainder, every chunk whose length is a multiple of
PIECE runs only row counts already planned; a piece re-reads the weight (~16 us for q_b's 64 MB at copy speed).
Each output row is still one GEMM's dot products over the same operands, so the pieces give the whole product's
values to the GEMM's own rounding (cuBLAS may pick another kernel for another row count, so not always its bits).
PIECE 0 (the default): one GEMM per product. v38 measured both ways: on a 20-layer Flash q2 on one H100 the pieces won
ds4-bench's 2048 -> 8192 interval (9892 / 9902 / 9961 t/s against 9826 / 9672), but on the H200 with all 43 layers they
lost it and the 32k row (4757 / 4754 against 4812 t/s at 8192, 4679 / 4681 against 4757 at 32768): the weight re-reads
and smaller GEMMs cost more than the first-call plans they save. Kept as a switch for cards and models where it wins.
"""

from __future__ import annotations

import os

import torch


def parse_piece(value: str) -> int:
    try:
        piece = int(value.strip() or "0")
    except ValueError:
        raise ValueError(f"DS4_GPU_GEMM_PIECE={value!r}: expected a row count (0: off)") from None
    if piece < 0:
        raise ValueError(f"DS4_GPU_GEMM_PIECE={value!r}: expected a row count >= 0 (0: off)")
    return piece


PIECE = parse_piece(os.environ.get("DS4_GPU_GEMM_PIECE", "0"))


_REFUSED: list[str] = []  # why torch refused a product into a row range of its output (then whole products)


def refuse(e: BaseException) -> None:
    """A product into a row range was refused: the process takes whole products from here (said once)."""
    if not _REFUSED:
        _REFUSED.append(str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        print(f"ds4: GEMM row pieces refused ({_REFUSED[0]}); whole products from here", flush=True)


def refused() -> str | None:
    return _REFUSED[0] if _REFUSED else None


def pieces(m: int, piece: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) row ranges covering m rows: whole pieces of `piece` rows, then the remainder (one range where
    pieces are off or were refused)."""
    piece = PIECE if piece is None else piece
    if piece <= 0 or m <= piece or _REFUSED:
        return [(0, m)]
    return [(i, min(i + piece, m)) for i in range(0, m, piece)]


def rows(t: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """Rows [i, j) of a 2-D operand, or of every matrix of a batched 3-D one (a view)."""
    return t.narrow(-2, i, j - i)
