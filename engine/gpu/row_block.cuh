// Row post-processing by a whole block (row_post), shared by fused.cu (norm_rope, compress_step) and attn_decode.cu (the
// combine's inverse RoPE); row_warp.cuh is the one-warp-per-row form.
#pragma once

#include <math.h>

#include <stdexcept>

#include "block_ops.cuh"
#include "common.cuh"
#include "row_warp.cuh"

namespace ds4gpu {

// Internal linkage in each including file (as when it lived in fused.cu's anonymous namespace): the compiler keeps its
// inlining choices per kernel.
namespace {

// In-place post-processing of one row v[d] in shared memory by the whole block (NT threads):
// optional RMS norm (times w), RoPE on the last rope_dim dims at position `p` (freq[rope_dim/2]),
// FP8 e4m3 rounding of the first fp8_nope dims in blocks of 64, or Hadamard + FP4 e2m1 in blocks of 32.
// Mirrors ops.rms_norm, ops.apply_tail, ops.fp8_kv_round and ops.indexer_qat.
// RowPost (common.cuh) says which of these steps run.
// cs (optional): the RoPE factors of position p as rope_stage wrote them (the same values row_post would compute).
__device__ void row_post(float* v, float* tmp, int d, float p, const RowPost& o, float* red, const float* cs = nullptr) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if (o.norm) {
    float ss = 0.0f;
    for (int i = tid; i < d; i += nt) ss += v[i] * v[i];
    ss = block_sum(ss, red);
    float r = rsqrtf(ss / (float)d + o.eps);
    for (int i = tid; i < d; i += nt) v[i] = o.w ? v[i] * r * o.w[i] : v[i] * r;
    __syncthreads();
  }
  if (o.freq) {
    const int half = o.rope_dim / 2, n_nope = d - o.rope_dim;
    for (int i = tid; i < half; i += nt) {
      float c, s;
      if (cs) {
        c = cs[i];
        s = cs[half + i];
      } else {
        float ang = p * o.freq[i];
        c = cosf(ang), s = sinf(ang);
        if (o.inverse) s = -s;
      }
      float x0 = v[n_nope + 2 * i], x1 = v[n_nope + 2 * i + 1];
      v[n_nope + 2 * i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
      v[n_nope + 2 * i + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
    __syncthreads();
  }
  const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
  if (o.fp8_nope > 0) {
    for (int b = warp; b < o.fp8_nope / 64; b += nw) {
      float x0 = v[64 * b + lane], x1 = v[64 * b + 32 + lane];
      float amax = fmaxf(warp_max_f(fmaxf(fabsf(x0), fabsf(x1))), 1e-4f);
      float scale = pow2_ceil(amax / 448.0f);
      float q0 = fminf(fmaxf(x0 / scale, -448.0f), 448.0f), q1 = fminf(fmaxf(x1 / scale, -448.0f), 448.0f);
      v[64 * b + lane] = round_minifloat(q0, 3, -6) * scale;
      v[64 * b + 32 + lane] = round_minifloat(q1, 3, -6) * scale;
    }
    __syncthreads();
  }
  if (o.qat) {
    // Hadamard butterflies in the order of ops.hadamard (pairs (i, i + h) within blocks of 2h)
    float* a = v;
    float* b = tmp;
    for (int h = 1; h < d; h *= 2) {
      for (int i = tid; i < d; i += nt) {
        int j = i % (2 * h);
        b[i] = j < h ? a[i] + a[i + h] : a[i - h] - a[i];
      }
      __syncthreads();
      float* t = a;
      a = b;
      b = t;
    }
    for (int i = tid; i < d; i += nt) a[i] = a[i] * o.had_scale;
    __syncthreads();
    for (int blk = warp; blk < d / 32; blk += nw) {
      float x = a[32 * blk + lane];
      float amax = fmaxf(warp_max_f(fabsf(x)), 6.0f * 1.1754943508222875e-38f);
      float scale = pow2_ceil(amax / 6.0f);
      float q = fminf(fmaxf(x / scale, -6.0f), 6.0f);
      v[32 * blk + lane] = round_minifloat(q, 1, 0) * scale;
    }
    __syncthreads();
  }
}

// The prologue a row_post kernel can run before griddepcontrol.wait ($DS4_GPU_PREWAIT): the norm weight and the RoPE
// factors of position p depend only on weights and on the position (written before the step's graph starts), so
// staging them into shared memory takes their L2 round trips (and the cosf/sinf) off the chain that follows the wait.
// Returns o with w pointing at the staged copy; cs receives what rope_stage_size(o) floats row_post(..., cs) reads.
// The staged values are read after the caller's next __syncthreads.
__host__ __device__ constexpr int rope_stage_size(int rope_dim) { return rope_dim; }
__device__ RowPost row_post_stage(const RowPost& o, int d, float p, float* w_stage, float* cs) {
  const int tid = threadIdx.x, nt = blockDim.x;
  RowPost s = o;
  if (o.norm && o.w) {
    for (int i = tid; i < d; i += nt) w_stage[i] = o.w[i];
    s.w = w_stage;
  }
  if (o.freq) {
    const int half = o.rope_dim / 2;
    for (int i = tid; i < half; i += nt) {
      float ang = p * o.freq[i];
      float c = cosf(ang), sn = sinf(ang);
      if (o.inverse) sn = -sn;
      cs[i] = c;
      cs[half + i] = sn;
    }
  }
  return s;
}

}  // namespace

// Host check of a RowPost against a row of d values, before a launch that runs row_post on it.
inline void check_row_post(const RowPost& o, int d) {
  if (d > 2048) throw std::invalid_argument("row length above 2048");
  if (o.freq && (o.rope_dim <= 0 || o.rope_dim > d || o.rope_dim % 2)) throw std::invalid_argument("bad rope_dim");
  if (o.fp8_nope % 64 || o.fp8_nope > d) throw std::invalid_argument("fp8 part must be a multiple of 64");
  if (o.qat && (d % 32 || (d & (d - 1)))) throw std::invalid_argument("FP4 simulation needs a power-of-two row");
}

}  // namespace ds4gpu
