"""FP8 e4m3 / ue8m0 / FP4 e2m1 decoding of official checkpoints (tooling-spec §1.4).

Oracles: torch's float8_e4m3fn and float8_e8m0fnu dtypes, and a literal FP4 value table.
"""

import math

import numpy as np
import pytest
import torch

from ds4.gguf_tools.hf import (
    E2M1, E4M3FN, E8M0, HFError, dequant_fp4, dequant_fp8, e4m3fn_to_f32, e8m0_to_f32, quant_fp4, quant_fp8,
)

ALL = np.arange(256, dtype=np.uint8)
# tooling-spec §1.4: FP4 E2M1 by nibble 0..15, bit 3 = sign
FP4_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def torch_e4m3(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)).view(torch.float8_e4m3fn).float().numpy()


def torch_e8m0(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)).view(torch.float8_e8m0fnu).float().numpy()


def test_e4m3fn_all_codes_match_torch():
    ours, ref = e4m3fn_to_f32(ALL), torch_e4m3(ALL)
    nan = np.isnan(ref)
    assert sorted(np.flatnonzero(nan)) == [0x7F, 0xFF]
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    assert np.all(ours[nan] == 0.0)  # the reference decodes the NaN code to 0
    assert np.signbit(ours[0x80]) and ours[0x80] == 0.0
    assert ours.max() == 448.0 and E4M3FN[1] == 2.0 ** -9


def test_e8m0_all_codes_match_torch():
    ours, ref = e8m0_to_f32(ALL), torch_e8m0(ALL)
    np.testing.assert_array_equal(ours[1:255], ref[1:255])
    assert ours[0] == 2.0 ** -127 == ref[0]  # bit pattern 0x00400000
    assert np.isinf(ours[255])  # e << 23 for e = 255: not special-cased (torch says NaN)
    assert all(ours[e] == 2.0 ** (e - 127) for e in range(1, 255))
    assert E8M0.dtype == np.float32


def test_e2m1_all_codes_match_table():
    np.testing.assert_array_equal(E2M1, np.array(FP4_TABLE, dtype=np.float32))
    assert list(np.signbit(E2M1)) == [False] * 8 + [True] * 8


def _fp8_reference(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-element loop: W[r, c] = e4m3fn(w[r, c]) * e8m0(s[r // 128, c // 128]) with torch decoders."""
    vals = torch_e4m3(codes)
    vals[np.isnan(vals)] = 0.0
    s = torch_e8m0(scale)
    out = np.empty_like(vals)
    for r in range(codes.shape[0]):
        for c0 in range(0, codes.shape[1], 128):
            out[r, c0:c0 + 128] = vals[r, c0:c0 + 128] * s[r // 128, c0 // 128]
    return out


@pytest.mark.parametrize("shape", [(256, 384), (200, 72), (64, 130)])
def test_fp8_block_dequant_random(shape):
    rng = np.random.default_rng(sum(shape))
    rows, cols = shape
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    scale = rng.integers(100, 150, (math.ceil(rows / 128), math.ceil(cols / 128)), dtype=np.uint8)
    full = dequant_fp8(codes, scale)
    np.testing.assert_array_equal(full, _fp8_reference(codes, scale))
    # a row block starting mid-grid decodes the same rows
    r0, r1 = 37, min(rows, 181)
    np.testing.assert_array_equal(dequant_fp8(codes[r0:r1], scale, r0), full[r0:r1])


def test_fp8_scale_grid_mismatch_is_an_error():
    with pytest.raises(HFError, match="scale grid"):
        dequant_fp8(np.zeros((256, 256), np.uint8), np.zeros((1, 2), np.uint8))


def test_fp4_dequant_random_blocks():
    rng = np.random.default_rng(7)
    rows, cols = 48, 256
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(110, 140, (rows, cols // 32), dtype=np.uint8)
    got = dequant_fp4(packed.view(np.int8), scale)
    ref = np.empty((rows, cols), dtype=np.float32)
    for r in range(rows):
        for j in range(cols // 2):
            b = int(packed[r, j])
            for c, nib in ((2 * j, b & 15), (2 * j + 1, b >> 4)):  # low nibble first
                ref[r, c] = FP4_TABLE[nib] * 2.0 ** (int(scale[r, c // 32]) - 127)
    np.testing.assert_array_equal(got, ref)


def test_fp8_encode_decode_roundtrip_error_bound():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 200)).astype(np.float32) * np.float32(0.05)
    codes, scale = quant_fp8(w)
    assert scale.shape == (3, 2) and codes.dtype == np.uint8
    back = dequant_fp8(codes, scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, plus the subnormal floor
    step = e8m0_to_f32(scale).max() * 2.0 ** -9
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0 ** -4 + step)
    # the block maximum lands within the e4m3 range, never on the NaN code
    assert not np.any((codes & 0x7F) == 0x7F)


def test_fp4_encode_is_nearest_on_grid():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    packed, scale = quant_fp4(w)
    back = dequant_fp4(packed, scale)
    s = np.repeat(e8m0_to_f32(scale), 32, axis=1)
    grid = np.array(sorted(set(np.abs(FP4_TABLE))), dtype=np.float32)
    # every value is decoded to the grid point nearest to w/s (within one half step of the grid)
    nearest = grid[np.abs(np.abs(w / s)[..., None] - grid).argmin(-1)] * np.sign(w)
    np.testing.assert_allclose(np.abs(back / s), np.abs(nearest), atol=0)
