// Shared pieces of the prefill attention kernels (attn_prefill.cu: the TF32 forms; attn_prefill_bf16.cu: form 3):
// the key tiles' addresses and loads, the TF32 split products, the queries' post-processing in shared memory, the
// online softmax and the epilogue. Included by those two translation units only.
#pragma once

#include <cuda_fp8.h>
#include <math.h>

#include <algorithm>

#include "block_ops.cuh"
#include "common.cuh"
#include "mma_ops.cuh"

namespace ds4gpu {
namespace {

constexpr int AP_THREADS = 256, AP_WARPS = AP_THREADS / 32;
constexpr int AP_KT = 16;            // keys per tile
constexpr int AP_PAD = 8;            // floats of padding per shared row (d + 8 = 8 mod 32 for d % 32 == 0)
constexpr int AP_SP = AP_KT + 4;     // score row stride
constexpr int AP_PVC = 4;            // form 2: output tiles per P.V chunk (independent accumulators in flight)

// Bytes of one key row: float32, or packed (pk_dims bfloat16 values, then float32).
template <bool PK>
__device__ __forceinline__ int64_t ap_row_bytes(const PrefillAttn& a) {
  return PK ? 2 * (int64_t)a.pk_dims + 4 * (int64_t)(a.d - a.pk_dims) : 4 * (int64_t)a.d;
}

// Key kk of query t (its window rows, then its compressed rows): the row's address, or null where that key is
// missing or not visible. sel_s: the query's selected rows staged in shared memory (-1: not a key), or null.
template <bool PK>
__device__ __forceinline__ const uint8_t* ap_key_src(const PrefillAttn& a, int t, int64_t p, int64_t n_vis,
                                                     int n_keys, int kk, const int* sel_s) {
  const uint8_t* win = PK ? (const uint8_t*)a.win_pk : (const uint8_t*)a.win;
  const uint8_t* comp = PK ? (const uint8_t*)a.comp_pk : (const uint8_t*)a.comp;
  const int64_t rb = ap_row_bytes<PK>(a);
  if (kk < a.Wn) return p - (a.Wn - 1) + kk >= 0 ? win + ((int64_t)t + kk) * rb : nullptr;
  if (kk >= n_keys) return nullptr;
  const int j = kk - a.Wn;
  if (sel_s) return sel_s[j] >= 0 ? comp + (int64_t)sel_s[j] * rb : nullptr;
  const int64_t row = a.sel ? a.sel[(int64_t)t * a.n_sel + j] : j;
  return row >= 0 && row < n_vis && row < a.n_comp ? comp + row * rb : nullptr;
}

// The query's selected compressed rows into sel_s (as ap_key_src reads them from a.sel; -1 where not a key).
__device__ __forceinline__ void ap_stage_sel(const PrefillAttn& a, int t, int64_t n_vis, int* sel_s) {
  for (int j = threadIdx.x; j < a.n_sel; j += AP_THREADS) {
    const int64_t row = a.sel[(int64_t)t * a.n_sel + j];
    sel_s[j] = row >= 0 && row < n_vis && row < a.n_comp ? (int)row : -1;
  }
}

// The rows of key tile k0 into L2 (prefetch.global.L2: no registers, no completion to wait for), one warp per row,
// one 128-byte line per lane.
template <bool PK>
__device__ __forceinline__ void ap_prefetch_tile(const PrefillAttn& a, int t, int64_t p, int64_t n_vis, int n_keys,
                                                 int k0, const int* sel_s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < AP_KT; r += AP_WARPS) {
    const uint8_t* src = ap_key_src<PK>(a, t, p, n_vis, n_keys, k0 + r, sel_s);
    if (src && 128 * lane < ap_row_bytes<PK>(a)) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src + 128 * lane));
  }
}

// Loads key tile `k0` (rows of the query's window, then its compressed rows) into Kb (rows dsb bytes apart) with
// cp.async (16-byte pieces; missing or invisible rows are zero-filled), and whether each row is a key into ok. One
// warp per row.
template <bool PK>
__device__ __forceinline__ void ap_load_tile(const PrefillAttn& a, int t, int64_t p, int64_t n_vis, int n_keys, int k0,
                                             uint8_t* Kb, int* ok, int dsb, const int* sel_s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c16 = (int)(ap_row_bytes<PK>(a) / 16);
  for (int r = warp; r < AP_KT; r += AP_WARPS) {
    const uint8_t* src = ap_key_src<PK>(a, t, p, n_vis, n_keys, k0 + r, sel_s);
    const uint8_t* from = src ? src : (const uint8_t*)a.win;  // a valid address; 0 bytes are read from it
    const int bytes = src ? 16 : 0;
    for (int c = lane; c < c16; c += 32) {
      const uint32_t dst = (uint32_t)__cvta_generic_to_shared(Kb + r * dsb + 16 * c);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(from + 16 * c), "r"(bytes));
    }
    if (lane == 0) ok[r] = src != nullptr;
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Key values from a shared key row (float32, or packed: bfloat16 below pk, float32 from pk on); c even for the pair.
// The bfloat16 values widen exactly, so both forms give the float32 values the products saw before.
// REG: where c lies, when the caller knows it at compile time: 0 ask (c < pk), 1 the packed columns, 2 the float32 ones.
template <bool PK, int REG = 0>
__device__ __forceinline__ float2 ap_key_pair(const uint8_t* row, int c, int pk) {
  if (PK && (REG == 1 || (REG == 0 && c < pk))) {
    const uint32_t w = *(const uint32_t*)(row + 2 * c);
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  return *(const float2*)(row + (PK ? 2 * pk + 4 * (c - pk) : 4 * c));
}
template <bool PK, int REG = 0>
__device__ __forceinline__ float ap_key_value(const uint8_t* row, int c, int pk) {
  if (PK && (REG == 1 || (REG == 0 && c < pk))) return __uint_as_float((uint32_t)*(const uint16_t*)(row + 2 * c) << 16);
  return *(const float*)(row + (PK ? 2 * pk + 4 * (c - pk) : 4 * c));
}

// ---- the straight-line inner loops (form 2, DS4_GPU_ATTN_FORM; v14) ----
// Form 1 tests `kk >= k_hi` / `n >= ntw` and whether the keys need their TF32 split at every 8-column step. nvcc turns
// that into a branch per step and a predicated mma behind a WARPSYNC, and keeps each step's products in source order, so
// a chain's second product waits on its first (SASS of v13: WARPSYNC + NOP between dependent HMMA.1688, ncu: "Stall
// Wait", a fixed-latency dependency, 3.1 of 6.8 cycles per issued instruction). Form 2 splits the column range where
// the split changes (loops whose bodies have no branch) and orders each step's products so that two on one
// accumulator are never adjacent. Every accumulator still sees its own products in form 1's order: the same bits.

// One 8-column step of the scores into chain (cm, cc): cc += al.bh, cm += ah.bh, then (SPLIT) cc += ah.bl.
template <bool SPLIT, bool PK>
__device__ __forceinline__ void ap_score_step(const float* q0, const float* q1, const uint8_t* kr, int kk, int i4,
                                              int pk, float (&cm)[4], float (&cc)[4]) {
  const float2 x0 = *(const float2*)(q0 + kk), x1 = *(const float2*)(q1 + kk);
  const float2 y = ap_key_pair<PK, SPLIT ? 2 : 1>(kr, kk + 2 * i4, pk);
  uint32_t ah[4], al[4], bh[2], bl[2];
  split_tf32(x0.x, ah[0], al[0]);
  split_tf32(x1.x, ah[1], al[1]);
  split_tf32(x0.y, ah[2], al[2]);
  split_tf32(x1.y, ah[3], al[3]);
  if constexpr (SPLIT) {
    split_tf32(y.x, bh[0], bl[0]);
    split_tf32(y.y, bh[1], bl[1]);
  } else {
    bh[0] = __float_as_uint(y.x);
    bh[1] = __float_as_uint(y.y);
  }
  mma_tf32(cc, al, bh);
  mma_tf32(cm, ah, bh);
  if constexpr (SPLIT) mma_tf32(cc, ah, bl);
}

// KC steps from column k, step j into chain j.
template <bool SPLIT, bool PK, int KC>
__device__ __forceinline__ void ap_score_steps(const float* q0, const float* q1, const uint8_t* kr, int k, int i4,
                                               int pk, float (&cm)[KC][4], float (&cc)[KC][4]) {
#pragma unroll
  for (int j = 0; j < KC; ++j) ap_score_step<SPLIT, PK>(q0, q1, kr, k + 8 * j, i4, pk, cm[j], cc[j]);
}

// P.V of PVC output tiles from tile n0 (columns col0 = 8 n0 ..): the values of all PVC tiles first, then al.bh on
// each, (SPLIT) ah.bl on each, ah.bh on each: each tile's products in form 1's order, PVC apart.
template <bool SPLIT, bool PK, int PVC, int NT>
__device__ __forceinline__ void ap_pv_chunk(const uint8_t* v0, int dsb, int col0, int g, int pk,
                                            const uint32_t (&ah)[4], const uint32_t (&al)[4], float (&acc)[NT][4],
                                            int n0) {
  uint32_t bh[PVC][2], bl[PVC][2];
#pragma unroll
  for (int i = 0; i < PVC; ++i) {
    const int col = col0 + 8 * i;
    const float v_0 = ap_key_value<PK, SPLIT ? 2 : 1>(v0, col + g, pk);
    const float v_1 = ap_key_value<PK, SPLIT ? 2 : 1>(v0 + 4 * dsb, col + g, pk);
    if constexpr (SPLIT) {
      split_tf32(v_0, bh[i][0], bl[i][0]);
      split_tf32(v_1, bh[i][1], bl[i][1]);
    } else {
      bh[i][0] = __float_as_uint(v_0);
      bh[i][1] = __float_as_uint(v_1);
    }
  }
#pragma unroll
  for (int i = 0; i < PVC; ++i) mma_tf32(acc[n0 + i], al, bh[i]);
  if constexpr (SPLIT) {
#pragma unroll
    for (int i = 0; i < PVC; ++i) mma_tf32(acc[n0 + i], ah, bl[i]);
  }
#pragma unroll
  for (int i = 0; i < PVC; ++i) mma_tf32(acc[n0 + i], ah, bh[i]);
}

// Shared bytes per key row: float32 rows padded by AP_PAD floats (rows 8 banks apart: the 8-byte score loads and
// the P.V loads are conflict-free); packed rows by 16 bytes (for d a multiple of 64 and pk_dims = d - 64: rows 4
// banks apart, so the 4-byte bfloat16 pair loads of the scores, 8 rows x 4 lanes, hit 32 banks; the float32 RoPE
// columns, 1/8 of the score steps, then take two passes).
template <bool PK>
__host__ __device__ inline int ap_smem_row_bytes(int d, int pk_dims) {
  return PK ? 2 * pk_dims + 4 * (d - pk_dims) + 16 : 4 * (d + AP_PAD);
}

// Fragments of m16n8k8 (PTX ISA, .tf32): with g = lane / 4, i = lane % 4,
//   A (16 x 8, row): a0 (g, i), a1 (g + 8, i), a2 (g, i + 4), a3 (g + 8, i + 4)
//   B (8 x 8, col):  b0 (k = i, n = g), b1 (k = i + 4, n = g)
//   C (16 x 8):      c0 (g, 2i), c1 (g, 2i + 1), c2 (g + 8, 2i), c3 (g + 8, 2i + 1)
// A product sums over k in any order, so the scores map the fragments' k = i and i + 4 to the head dimension's
// columns 2i and 2i + 1 of the 8-column step, for queries and keys alike: one 8-byte shared load per pair.
//
// MT m-tiles of 16 heads per CTA; the scores of a 16-key tile are 2 MT (m-tile, 8-key half) jobs, each split over
// KS parts of the head dimension so that all 8 warps take one (partials summed by the softmax); NBUF key buffers
// (2: the next tile loads while this one is used); MINB CTAs per SM (2: 16 resident warps hide more latency, at
// most 128 registers per thread).
// v2 (v10): double-buffered tiles, scores in independent chains, softmax on 4 threads per head row; v3: TF32
// splits by truncation, paired loads, rows padded to 8 floats mod 32 (conflict-free reads for both products), and
// for 64 heads two CTAs of 32 per query (DS4_GPU_ATTN_HEADS=64: one of 64).
// With q_post_on, the staged query rows (raw q_b product rows) post-processed in shared memory as norm_rope_warp_kernel
// processes them in registers: one warp per head row, element lane + 32 k, the same operations in the same order
// (so the same bits; tests/test_gpu_prefill_attn.py holds them equal). In shared memory and rolled loops rather than
// row_warp.cuh's register row: held in registers, the staging cost the main loop's allocation (54 spill loads and
// stores among its products against 10).
template <int HG>
__device__ __forceinline__ void ap_q_post(const PrefillAttn& a, int t, float p, int h_base, float* Qs, int ds) {
  constexpr int R = (HG + AP_WARPS - 1) / AP_WARPS;  // rows per warp, processed side by side (independent chains)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nk = a.d / 32;
  const RowPost& o = a.q_post;
  const float in_s = a.q_in_scale ? a.q_in_scale[t] : 1.0f;
  float* row[R];
  bool live[R];
  float ss[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = warp + i * AP_WARPS;
    live[i] = r < HG && h_base + r < a.H;  // rows past H stay zero
    row[i] = Qs + (live[i] ? r : 0) * ds + lane;
    ss[i] = 0.0f;
  }
#pragma unroll 1
  for (int k = 0; k < nk; ++k) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!live[i]) continue;
      float x = row[i][32 * k];
      if (a.q_in_scale) row[i][32 * k] = x = x * in_s;
      ss[i] += x * x;
    }
  }
  if (o.norm) {
    float rn[R];
#pragma unroll
    for (int i = 0; i < R; ++i) rn[i] = rsqrtf(warp_sum_f(ss[i]) / (float)a.d + o.eps);
#pragma unroll 1
    for (int k = 0; k < nk; ++k) {
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (live[i]) row[i][32 * k] = o.w ? row[i][32 * k] * rn[i] * o.w[lane + 32 * k] : row[i][32 * k] * rn[i];
    }
  }
  if (o.freq) {
    const int n_nope = a.d - o.rope_dim;
#pragma unroll 1
    for (int k = n_nope / 32; k < nk; ++k) {
      const int e = lane + 32 * k;
      float c = 1.0f, sn = 0.0f;
      if (e >= n_nope) {
        const float ang = p * o.freq[(e - n_nope) / 2];
        c = cosf(ang);
        sn = o.inverse ? -sinf(ang) : sinf(ang);
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float v = row[i][32 * k], partner = __shfl_xor_sync(0xffffffffu, v, 1);
        if (live[i] && e >= n_nope)
          row[i][32 * k] = (lane & 1) ? __fadd_rn(__fmul_rn(partner, sn), __fmul_rn(v, c))
                                      : __fsub_rn(__fmul_rn(v, c), __fmul_rn(partner, sn));
      }
    }
  }
}

// out_a8: columns (col, col + 1) of head h's split as the float8 operand of fp8_split's correction GEMM, [G, T, 2 K]
// with K = out_hpg d: hi * 2^8 at column c of (group h / out_hpg, query t), lo * 2^19 at K + c (pack_x's values; the
// scales are exact, the conversion rounds to nearest even as torch's cast does, saturating only past e4m3's range,
// which |hi| <= 1 and |lo| <= 2^-12 never reach).
__device__ __forceinline__ void ap_store_a8(const PrefillAttn& a, int t, int h, int col, __half h0, __half h1,
                                            __half l0, __half l1) {
  const int hpg = a.out_hpg, K = hpg * a.d, g = h / hpg;
  uint8_t* row = a.out_a8 + ((int64_t)g * a.T + t) * 2 * K + (h - g * hpg) * a.d + col;
  const __nv_fp8x2_storage_t hi8 = __nv_cvt_float2_to_fp8x2(
      make_float2(__half2float(h0) * 256.0f, __half2float(h1) * 256.0f), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t lo8 = __nv_cvt_float2_to_fp8x2(
      make_float2(__half2float(l0) * 524288.0f, __half2float(l1) * 524288.0f), __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<__nv_fp8x2_storage_t*>(row) = hi8;
  *reinterpret_cast<__nv_fp8x2_storage_t*>(row + K) = lo8;
}

// out_hi: the output (tile n at columns col_of(n) ..) as the o_a GEMM's float16 split, one scale per (query, group of out_hpg heads): s = the group's
// largest |y| (at least 1e-30), hi = half(y / s), lo = half(y / s - hi): weights.to_half's operations on each group's
// columns, so the GEMM needs no split pass over [T, H d]. The group maxima meet in shared memory (atomicMax on the
// bits of non-negative floats orders them as floats).
// y / s correctly rounded (to_half's division) without __fdiv_rn's per-element range checks and slow path (v26:
// ~16% of the session launch's samples): q = y r from the correctly rounded reciprocal r, then one Markstein step
// q + (y - s q) r, the residual exact by the fma; then hi = half(y / s), lo = half(y / s - hi). |y| <= s, so the
// quotient neither overflows nor (where hi and lo are not both zero anyway) underflows.
__device__ __forceinline__ void ap_split_div(float y, float s, float r, __half& hi, __half& lo) {
  const float q = __fmul_rn(y, r);
  const float xn = __fmaf_rn(__fmaf_rn(-q, s, y), r, q);
  hi = __float2half_rn(xn);
  lo = __float2half_rn(__fsub_rn(xn, __half2float(hi)));
}

// Eight float16 values as e4m3 times sc (ap_store_a8's conversion, four pairs).
__device__ __forceinline__ uint2 ap_fp8x8(const __half (&x)[8], float sc) {
  uint32_t w[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t v = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __nv_fp8x2_storage_t p = __nv_cvt_float2_to_fp8x2(
          make_float2(__half2float(x[4 * k + 2 * j]) * sc, __half2float(x[4 * k + 2 * j + 1]) * sc), __NV_SATFINITE,
          __NV_E4M3);
      v |= (uint32_t)p << (16 * j);
    }
    w[k] = v;
  }
  return make_uint2(w[0], w[1]);
}

// Form 3's staged split (OST, v41): the scaled, de-rotated output rows are in shared memory as float32 (`st`, rows of
// d + 8 floats: ap_finish<.., STAGED> put them there), and each thread splits whole runs of 8 columns in one rolled
// loop and writes them out (out_hi and out_lo 16 bytes, the float8 planes 8 bytes per run). The same arithmetic per
// element as ap_store_split, so the same bits. Why: ap_store_split unrolled over the fragments, with its stage / global
// and float8 / float16 variants, is ~9,700 SASS instructions run once per CTA; ncu (v41) put ~20% of a ratio-128
// launch's samples on "no instruction" stalls there, the instruction cache missing on straight-line code.
constexpr int AP_F32_PAD = 8;  // floats of padding per staged float32 row (bank offset 8 words per row)
__host__ __device__ constexpr size_t ap_f32_stage_bytes(int HG, int d) { return (size_t)HG * (d + AP_F32_PAD) * 4; }

template <int HG>
__device__ __forceinline__ void ap_store_split_staged(const PrefillAttn& a, int t, int h_base, int h0, int h1, int i4,
                                                      float m0, float m1, float* gmax, const float* st) {
  const int hpg = a.out_hpg, d = a.d, tid = threadIdx.x, rs = d + AP_F32_PAD, runs = d / 8;
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
  if (i4 == 0) {
    if (h0 < a.H) atomicMax((int*)&gmax[(h0 - h_base) / hpg], __float_as_int(m0));
    if (h1 < a.H) atomicMax((int*)&gmax[(h1 - h_base) / hpg], __float_as_int(m1));
  }
  __syncthreads();  // the group maxima are final and every warp's rows are staged
  const int K = hpg * d;
#pragma unroll 1
  for (int i = tid; i < HG * runs; i += AP_THREADS) {
    const int r = i / runs, c = 8 * (i - r * runs), h = h_base + r;
    if (h >= a.H) continue;
    const float s = fmaxf(gmax[r / hpg], 1e-30f), rc = __frcp_rn(s);
    const float4 v0 = *(const float4*)(st + r * rs + c), v1 = *(const float4*)(st + r * rs + c + 4);
    const float y[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    __align__(16) __half hh[8], ll[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) ap_split_div(y[j], s, rc, hh[j], ll[j]);
    const int64_t o = ((int64_t)t * a.H + h) * d + c;
    *(uint4*)(a.out_hi + o) = *(const uint4*)hh;
    if (a.out_a8) {
      const int g = h / hpg;
      uint8_t* row = a.out_a8 + ((int64_t)g * a.T + t) * 2 * K + (h - g * hpg) * d + c;
      *(uint2*)row = ap_fp8x8(hh, 256.0f);
      *(uint2*)(row + K) = ap_fp8x8(ll, 524288.0f);
    } else {
      *(uint4*)(a.out_lo + o) = *(const uint4*)ll;
    }
  }
  if (tid < HG / hpg && h_base + tid * hpg < a.H)
    a.out_s[(int64_t)t * (a.H / hpg) + h_base / hpg + tid] = fmaxf(gmax[tid], 1e-30f);
}

template <int NT, int HG, typename ColOf>
__device__ __forceinline__ void ap_store_split(const PrefillAttn& a, int t, int h_base, int h0, int h1, ColOf col_of,
                                               int ntw, int i4, const float (&acc)[NT][4], float m0, float m1,
                                               float* gmax) {
  const int hpg = a.out_hpg, d = a.d;
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
  if (i4 == 0) {
    if (h0 < a.H) atomicMax((int*)&gmax[(h0 - h_base) / hpg], __float_as_int(m0));
    if (h1 < a.H) atomicMax((int*)&gmax[(h1 - h_base) / hpg], __float_as_int(m1));
  }
  __syncthreads();
  const float s0 = fmaxf(gmax[(h0 - h_base) / hpg], 1e-30f), s1 = fmaxf(gmax[(h1 - h_base) / hpg], 1e-30f);
  const float r0 = __frcp_rn(s0), r1 = __frcp_rn(s1);
  const auto split = ap_split_div;  // y / s, then hi + lo
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    if (n >= ntw) break;
    const int col = col_of(n) + 2 * i4;
    __half h[4], l[4];
    split(acc[n][0], s0, r0, h[0], l[0]);
    split(acc[n][1], s0, r0, h[1], l[1]);
    split(acc[n][2], s1, r1, h[2], l[2]);
    split(acc[n][3], s1, r1, h[3], l[3]);
    if (h0 < a.H) {
      const int64_t o = ((int64_t)t * a.H + h0) * d + col;
      *(__half2*)(a.out_hi + o) = __halves2half2(h[0], h[1]);
      if (a.out_a8) ap_store_a8(a, t, h0, col, h[0], h[1], l[0], l[1]);
      else *(__half2*)(a.out_lo + o) = __halves2half2(l[0], l[1]);
    }
    if (h1 < a.H) {
      const int64_t o = ((int64_t)t * a.H + h1) * d + col;
      *(__half2*)(a.out_hi + o) = __halves2half2(h[2], h[3]);
      if (a.out_a8) ap_store_a8(a, t, h1, col, h[2], h[3], l[2], l[3]);
      else *(__half2*)(a.out_lo + o) = __halves2half2(l[2], l[3]);
    }
  }
  const int tid = threadIdx.x;
  if (tid < HG / hpg && h_base + tid * hpg < a.H)
    a.out_s[(int64_t)t * (a.H / hpg) + h_base / hpg + tid] = fmaxf(gmax[tid], 1e-30f);
}

// The online softmax of one key tile (after its scores' KS partial sums are in Ss): 4 threads per head row, keys
// 4 (tid % 4) .. + 3 each; the tile's weights replace the scores in Ss part 0, m_s and l_s advance, and f_s holds the
// factor that rescales the rows' output accumulators.
template <int HG, int KS>
__device__ __forceinline__ void ap_softmax(const PrefillAttn& a, int k0, int n_keys, const int* ok, float* Ss,
                                           float* m_s, float* l_s, float* f_s) {
  const int tid = threadIdx.x;
  if (tid < 4 * HG) {  // online softmax: head row tid / 4, keys 4 (tid % 4) .. + 3 of the tile
    const int row = tid >> 2, j0 = 4 * (tid & 3);
    float* srow = Ss + row * AP_SP + j0;
    float v[4], mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float sc = srow[j];
#pragma unroll
      for (int q = 1; q < KS; ++q) sc += srow[q * HG * AP_SP + j];
      v[j] = (k0 + j0 + j < n_keys && ok[j0 + j]) ? sc * a.scale : -INFINITY;
      mx = fmaxf(mx, v[j]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mo = m_s[row];
    mx = fmaxf(mx, mo);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float e = v[j] == -INFINITY ? 0.0f : expf(v[j] - mx);
      srow[j] = e;
      sum += e;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (j0 == 0) {
      const float alpha = mx == -INFINITY ? 1.0f : expf(mo - mx);
      l_s[row] = l_s[row] * alpha + sum;
      m_s[row] = mx;
      f_s[row] = alpha;
    }
  }
}

// After the last key tile: the sink as one more score, the output (acc tile n: columns col_of(n) .. + 7 of heads
// h_base + 16 mt_o + g and + 8) scaled by 1 / denominator, its RoPE tail undone (a.out_freq), then stored as float32
// or as the o_a GEMM's split (a.out_hi). gmax: HG floats of free shared memory (the scores' scratch).
// STAGED (form 3's OST): the split through float32 rows in `stage` (ap_store_split_staged; ap_f32_stage_bytes of it).
// ROPE_TILE0: tiles below it hold no RoPE column (form 3: its exact tiles; the launch checks out_rope_dim), so their
// inverse-RoPE test and its cosf / sinf are not compiled.
template <int NT, int HG, bool STAGED = false, int ROPE_TILE0 = 0, typename ColOf>
__device__ __forceinline__ void ap_finish(const PrefillAttn& a, int t, int64_t p, int h_base, int mt_o, int ntw,
                                          ColOf col_of, float (&acc)[NT][4], const float* m_s, const float* l_s,
                                          float* f_s, float* gmax, uint8_t* stage = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, i4 = lane & 3, d = a.d;
  __syncthreads();
  if (tid < HG) {  // the sink: one more score, then 1 / denominator
    const int h = h_base + tid;
    const float sink = h < a.H ? a.sinks[h] : 0.0f;
    const float m = m_s[tid], M = fmaxf(m, sink);
    const float fac = m == -INFINITY ? 0.0f : expf(m - M);
    f_s[tid] = fac / (l_s[tid] * fac + expf(sink - M));
    gmax[tid] = 0.0f;
  }
  __syncthreads();
  const int h0 = h_base + 16 * mt_o + g, h1 = h0 + 8;
  const float f0 = f_s[16 * mt_o + g], f1 = f_s[16 * mt_o + g + 8];
  const int rope_from = d - a.out_rope_dim;
  float m0 = 0.0f, m1 = 0.0f;
#pragma unroll
  for (int n = 0; n < NT; ++n) {  // the output in acc: y0 = (acc[n][0], acc[n][1]) of head h0, y1 of head h1
    if (n >= ntw) break;
    const int col = col_of(n) + 2 * i4;
    float2 y0 = make_float2(acc[n][0] * f0, acc[n][1] * f0), y1 = make_float2(acc[n][2] * f1, acc[n][3] * f1);
    if (n >= ROPE_TILE0 && a.out_freq && col >= rope_from) {  // inverse RoPE of the pair (col, col + 1), as norm_rope_warp_kernel does it
      const float ang = (float)p * a.out_freq[(col - rope_from) / 2];
      const float c = cosf(ang), sn = -sinf(ang);
      y0 = make_float2(__fsub_rn(__fmul_rn(y0.x, c), __fmul_rn(y0.y, sn)),
                       __fadd_rn(__fmul_rn(y0.x, sn), __fmul_rn(y0.y, c)));
      y1 = make_float2(__fsub_rn(__fmul_rn(y1.x, c), __fmul_rn(y1.y, sn)),
                       __fadd_rn(__fmul_rn(y1.x, sn), __fmul_rn(y1.y, c)));
    }
    if (STAGED || a.out_hi) {  // STAGED: launched with out_hi only
      if constexpr (STAGED) {
        float* st = reinterpret_cast<float*>(stage);
        *(float2*)(st + (h0 - h_base) * (d + AP_F32_PAD) + col) = y0;
        *(float2*)(st + (h1 - h_base) * (d + AP_F32_PAD) + col) = y1;
      } else {
        acc[n][0] = y0.x, acc[n][1] = y0.y, acc[n][2] = y1.x, acc[n][3] = y1.y;
      }
      m0 = fmaxf(m0, fmaxf(fabsf(y0.x), fabsf(y0.y)));
      m1 = fmaxf(m1, fmaxf(fabsf(y1.x), fabsf(y1.y)));
      continue;
    }
    if (h0 < a.H) *(float2*)(a.out + ((int64_t)t * a.H + h0) * d + col) = y0;
    if (h1 < a.H) *(float2*)(a.out + ((int64_t)t * a.H + h1) * d + col) = y1;
  }
  if (!STAGED && !a.out_hi) return;
  if constexpr (STAGED) ap_store_split_staged<HG>(a, t, h_base, h0, h1, i4, m0, m1, gmax, reinterpret_cast<const float*>(stage));
  else ap_store_split<NT, HG>(a, t, h_base, h0, h1, col_of, ntw, i4, acc, m0, m1, gmax);
}

}  // namespace

// attn_prefill_bf16.cu: form 3 where it takes the shapes (true), else false.
bool launch_prefill_attn_bf16(const PrefillAttn& a, cudaStream_t s);

}  // namespace ds4gpu
