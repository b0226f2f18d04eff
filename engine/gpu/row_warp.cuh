// Row post-processing with one warp per row (element lane + 32 k of a row in register v[k]), for fused.cu's
// norm_rope_warp_kernel: RMS norm (times w), RoPE on the tail (pairs in adjacent lanes), FP8 e4m3 rounding of the
// first fp8_nope columns in blocks of 64, Hadamard + FP4 e2m1 in blocks of 32. Same formulas as fused.cu's block-wide
// row_post; only the norm's sum runs in another order (a lane's own elements in k order, then the warp's butterfly).
// attn_prefill.cu's ap_q_post repeats the norm and RoPE steps on rows in shared memory (registers there cost the
// attention's main loop its allocation); tests/test_gpu_prefill_attn.py holds the two to the same bits.
#pragma once

#include <math.h>

#include "block_ops.cuh"
#include "common.cuh"

namespace ds4gpu {

// The smallest power of two >= v (v > 0), as ops._pow2_ceil.
__device__ __forceinline__ float pow2_ceil(float v) {
  int e;
  float m = frexpf(v, &e);
  if (m == 0.5f) e -= 1;
  return ldexpf(1.0f, e);
}

// Round to a minifloat grid with `mant` mantissa bits and smallest exponent min_exp (ops._round_minifloat).
__device__ __forceinline__ float round_minifloat(float x, int mant, int min_exp) {
  float ax = fabsf(x);
  int e;
  frexpf(ax > 0.0f ? ax : 1.0f, &e);
  e = max(e - 1, min_exp);
  float step = ldexpf(1.0f, e - mant);
  return rintf(x / step) * step;
}

// row_post's FP8 step on a row held by one warp (element lane + 32 k): block b of 64 is k = 2b, 2b + 1.
template <int KMAX>
__device__ __forceinline__ void warp_row_fp8(float (&v)[KMAX], int blocks) {
#pragma unroll
  for (int b = 0; b < KMAX / 2; ++b) {
    if (b >= blocks) break;
    const float amax = fmaxf(warp_max_f(fmaxf(fabsf(v[2 * b]), fabsf(v[2 * b + 1]))), 1e-4f);
    const float scale = pow2_ceil(amax / 448.0f);
    const float q0 = fminf(fmaxf(v[2 * b] / scale, -448.0f), 448.0f);
    const float q1 = fminf(fmaxf(v[2 * b + 1] / scale, -448.0f), 448.0f);
    v[2 * b] = round_minifloat(q0, 3, -6) * scale;
    v[2 * b + 1] = round_minifloat(q1, 3, -6) * scale;
  }
}

// row_post's Hadamard + FP4 step on a row held by one warp: the butterflies in the same order and with the same
// operands (lower a[i] + a[i + h], upper a[i - h] - a[i]), pairs in other lanes (h < 32) or other registers.
template <int KMAX>
__device__ __forceinline__ void warp_row_qat(float (&v)[KMAX], int nk, int lane, float had_scale) {
#pragma unroll
  for (int h = 1; h < 32; h *= 2) {
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const float p = __shfl_xor_sync(0xffffffffu, v[k], h);
      if (k < nk) v[k] = (lane & h) ? p - v[k] : v[k] + p;
    }
  }
#pragma unroll
  for (int hk = 1; hk < KMAX; hk *= 2) {
    if (hk >= nk) break;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      if ((k & hk) || k + hk >= nk) continue;
      const float lo = v[k], hi = v[k + hk];
      v[k] = lo + hi;
      v[k + hk] = lo - hi;
    }
  }
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    if (k >= nk) break;
    const float x = v[k] * had_scale;
    const float amax = fmaxf(warp_max_f(fabsf(x)), 6.0f * 1.1754943508222875e-38f);
    const float scale = pow2_ceil(amax / 6.0f);
    v[k] = round_minifloat(fminf(fmaxf(x / scale, -6.0f), 6.0f), 1, 0) * scale;
  }
}

// norm, RoPE at position p, then FP8 or FP4 as o says, on a row of d = 32 nk columns (nk <= KMAX).
template <int KMAX>
__device__ __forceinline__ void warp_row_post(float (&v)[KMAX], int d, int lane, const RowPost& o, float p) {
  const int nk = d / 32;
  if (o.norm) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) ss += v[k] * v[k];
    ss = warp_sum_f(ss);
    const float r = rsqrtf(ss / (float)d + o.eps);
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < nk) v[k] = o.w ? v[k] * r * o.w[lane + 32 * k] : v[k] * r;
  }
  if (o.freq) {
    const int n_nope = d - o.rope_dim;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      if (k >= nk) break;  // uniform over the warp
      const int e = lane + 32 * k;
      const float partner = __shfl_xor_sync(0xffffffffu, v[k], 1);
      if (e >= n_nope) {
        const float ang = p * o.freq[(e - n_nope) / 2];
        const float c = cosf(ang), sn = o.inverse ? -sinf(ang) : sinf(ang);
        v[k] = (lane & 1) ? __fadd_rn(__fmul_rn(partner, sn), __fmul_rn(v[k], c))
                          : __fsub_rn(__fmul_rn(v[k], c), __fmul_rn(partner, sn));
      }
    }
  }
  if (o.fp8_nope > 0) warp_row_fp8<KMAX>(v, o.fp8_nope / 64);
  if (o.qat) warp_row_qat<KMAX>(v, nk, lane, o.had_scale);
}

}  // namespace ds4gpu
