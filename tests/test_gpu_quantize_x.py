"""quantize_x (repack.cu), the activation quantizer of the decode matvecs and the mmq products, bit for bit against
numpy models of its three forms: 32 columns per scale (decode), 256 (mmq S256) and one scale per row (mmq XROW).
Skipped without a built extension and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def hilo_model(x: np.ndarray, group: int):
    """hi, lo int8 [R, n] and s [R, n / group] float32 of quantize_x's formulas with one scale per `group` columns."""
    R, n = x.shape
    b = x.reshape(R, n // group, group)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    s = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(amax > 0, s, np.float32(1.0))
    t = (b / safe).astype(np.float32)
    hr = np.rint(t)
    lo = np.clip(np.rint((t - hr) * np.float32(254.0)), -127, 127)
    hi, lo = np.where(amax > 0, hr, 0).astype(np.int8), np.where(amax > 0, lo, 0).astype(np.int8)
    return hi.reshape(R, n), lo.reshape(R, n), s.reshape(R, n // group)


def quantize_x_model(x: np.ndarray):
    """repack.cu quantize_x_kernel in numpy float32: (hi, lo, scale, sum16), the 16-column sums by the kernels' addition
    tree (columns differing in bit 3 first, then bits 2, 1, 0)."""
    R, n = x.shape
    hi, lo, s = hilo_model(x, 32)
    v = x.reshape(R, n // 32, 2, 16)
    for bit in (8, 4, 2, 1):
        v = v + v[..., np.arange(16) ^ bit]  # every column holds the same tree's sum after the four steps
    return hi, lo, s / np.float32(254.0), v[..., 0].reshape(R, n // 16)


def quantize_x256_model(x: np.ndarray):
    """repack.cu quantize_x256_kernel in numpy float32: one scale per 256 columns (stored for each 32-column block),
    the 16-column sums as each lane pair adds them (8 values pairwise, then the two halves)."""
    R, n = x.shape
    hi, lo, s = hilo_model(x, 256)
    v = x.reshape(R, n // 8, 8)
    half = ((v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3])) + ((v[..., 4] + v[..., 5]) + (v[..., 6] + v[..., 7]))
    return hi, lo, np.repeat(s / np.float32(254.0), 8, axis=1), half[:, 0::2] + half[:, 1::2]


def quantize_x_row_model(x: np.ndarray):
    """repack.cu quantize_x_row_kernel in numpy float32: one scale per row (stored for each 32-column block), the
    16-column sums as four threads add them (each its four columns pairwise, then xor 1, then xor 2)."""
    R, n = x.shape
    hi, lo, s = hilo_model(x, n)
    v = x.reshape(R, n // 4, 4)
    a = (v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3])
    a = a.reshape(R, n // 16, 4)
    return hi, lo, np.repeat(s / np.float32(254.0), n // 32, axis=1), (a[..., 0] + a[..., 1]) + (a[..., 2] + a[..., 3])


QUANTIZE_X_MODELS = {32: quantize_x_model, 256: quantize_x256_model, 0: quantize_x_row_model}


@pytest.mark.parametrize("group,R,n,gather", [(32, 1, 4096, False), (32, 7, 96, False), (32, 33, 2048, True),
                                               (256, 1, 4096, False), (256, 9, 256, False), (256, 33, 2048, True),
                                               (0, 1, 4096, False), (0, 9, 512, False), (0, 33, 2048, True),
                                               (0, 5, 768, False), (0, 3, 256, True)])
def test_quantize_x_matches_its_model_bit_for_bit(group, R, n, gather):
    """quantize_x at decode's 32 columns per scale, at mmq S256's 256 and with one scale per row (group 0: mmq's
    XROW form), against the numpy models."""
    import torch

    ext = gpu.load()
    rng = np.random.default_rng(R + n + group)
    src = (rng.standard_normal((R + 5, n)) * rng.choice([1e-3, 1.0, 50.0], size=(R + 5, 1))).astype(np.float32)
    src[0, :group] = 0.0  # an all-zero block
    rows = rng.integers(0, R + 5, R) if gather else np.arange(R)
    x = torch.from_numpy(src if gather else src[:R]).cuda()
    idx = torch.from_numpy(rows).cuda()
    hi, lo = (torch.empty((R, n), dtype=torch.int8, device="cuda") for _ in range(2))
    scale, sum16 = torch.empty((R, n // 32), device="cuda"), torch.empty((R, n // 16), device="cuda")
    ext.quantize_x(x.data_ptr(), R, n, idx.data_ptr() if gather else 0, hi.data_ptr(), lo.data_ptr(),
                   scale.data_ptr(), sum16.data_ptr(), group=group)
    want = QUANTIZE_X_MODELS[group](src[rows])
    for name, got, ref in zip(("hi", "lo", "scale", "sum16"), (hi, lo, scale, sum16), want):
        assert np.array_equal(got.cpu().numpy(), ref), name
    with pytest.raises(ValueError, match="group"):
        ext.quantize_x(x.data_ptr(), R, n, 0, hi.data_ptr(), lo.data_ptr(), scale.data_ptr(), sum16.data_ptr(),
                       group=64)
    with pytest.raises(ValueError, match="one scale per row"):  # multiples of 256 up to 2048, of 512 up to 4096
        ext.quantize_x(x.data_ptr(), R, 2304, 0, hi.data_ptr(), lo.data_ptr(), scale.data_ptr(), sum16.data_ptr(),
                       group=0)
