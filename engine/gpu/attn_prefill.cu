// Prefill attention in one kernel (model-spec §3.5; session prefill.attend_rows is the torch form): for query t,
// the keys are its raw window (rows t .. t + Wn - 1 of win, valid from position 0 on) and its compressed rows
// (sel[t] of comp, or all n_comp rows, visible below (pos + 1) / ratio); scores q_h . k / sqrt(d), a softmax with
// the head's sink as one more score, output sum_j p_j k_j (the keys are the values).
//
// One CTA per (query, group of up to 64 heads), keys in tiles of 16, online softmax over the tiles. Products on
// the tensor cores as three TF32 products (hi.hi + hi.lo + lo.hi of x = hi + lo, each part rounded to TF32: ~22
// bits, float32-level like the prefill GEMMs' f16 splits, with float32's range), mma.sync.m16n8k8:
//   scores [16 heads x 8 keys] per warp over the head dimension, P.V [16 heads x 8 columns] tiles per warp.
// Shared memory: the group's queries, two key tiles (the next one loading), the tile's scores (rows padded by 4
// floats: conflict-free fragment reads). One CTA per SM (~200 KB for 64 heads of 512).
#include <math.h>

#include <algorithm>

#include "block_ops.cuh"
#include "common.cuh"

namespace ds4gpu {

namespace {

constexpr int AP_THREADS = 256, AP_WARPS = AP_THREADS / 32;
constexpr int AP_KT = 16;            // keys per tile
constexpr int AP_PAD = 8;            // floats of padding per shared row (d + 8 = 8 mod 32 for d % 32 == 0)
constexpr int AP_SP = AP_KT + 4;     // score row stride
constexpr int AP_PVC = 4;            // form 2: output tiles per P.V chunk (independent accumulators in flight)

// x = hi + lo: hi is x truncated to TF32 (one AND), lo = x - hi exactly (one FADD), passed as float32 bits: the
// tensor core reads a .tf32 operand's top 19 bits, so lo is truncated there (~21 bits in all). v1 rounded both
// parts with cvt.rna (several instructions each): ncu counted ~46k instructions per 16-key tile, half the issue slots.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

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

// out_hi: the output as the o_a GEMM's float16 split, one scale per (query, group of out_hpg heads): s = the group's
// largest |y| (at least 1e-30), hi = half(y / s), lo = half(y / s - hi): weights.to_half's operations on each group's
// columns, so the GEMM needs no split pass over [T, H d]. The group maxima meet in shared memory (atomicMax on the
// bits of non-negative floats orders them as floats).
template <int NT, int HG>
__device__ __forceinline__ void ap_store_split(const PrefillAttn& a, int t, int h_base, int h0, int h1, int tile0, int ntw,
                                               int i4, const float (&acc)[NT][4], float m0, float m1, float* gmax) {
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
  const auto split = [](float y, float s, __half& hi, __half& lo) {
    const float xn = __fdiv_rn(y, s);
    hi = __float2half_rn(xn);
    lo = __float2half_rn(__fsub_rn(xn, __half2float(hi)));
  };
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    if (n >= ntw) break;
    const int col = (tile0 + n) * 8 + 2 * i4;
    __half h[4], l[4];
    split(acc[n][0], s0, h[0], l[0]);
    split(acc[n][1], s0, h[1], l[1]);
    split(acc[n][2], s1, h[2], l[2]);
    split(acc[n][3], s1, h[3], l[3]);
    if (h0 < a.H) {
      const int64_t o = ((int64_t)t * a.H + h0) * d + col;
      *(__half2*)(a.out_hi + o) = __halves2half2(h[0], h[1]);
      *(__half2*)(a.out_lo + o) = __halves2half2(l[0], l[1]);
    }
    if (h1 < a.H) {
      const int64_t o = ((int64_t)t * a.H + h1) * d + col;
      *(__half2*)(a.out_hi + o) = __halves2half2(h[2], h[3]);
      *(__half2*)(a.out_lo + o) = __halves2half2(l[2], l[3]);
    }
  }
  const int tid = threadIdx.x;
  if (tid < HG / hpg && h_base + tid * hpg < a.H)
    a.out_s[(int64_t)t * (a.H / hpg) + h_base / hpg + tid] = fmaxf(gmax[tid], 1e-30f);
}

template <int MT, int NBUF, int MINB, bool PK>
__global__ void __launch_bounds__(AP_THREADS, MINB) prefill_attn_kernel(PrefillAttn a) {
  constexpr int HG = 16 * MT;          // heads of this CTA (rows past H are zeros)
  constexpr int CP = AP_WARPS / MT;    // column parts of the output per m-tile
  constexpr int KS = AP_WARPS / (2 * MT);  // head-dimension parts of each score job
  constexpr int NT = 8 * MT;           // output tiles of 8 columns per warp, at most (d <= 512)
  constexpr int KC = 4;                // independent score chains
  extern __shared__ __align__(16) float sh[];
  const int d = a.d, ds = d + AP_PAD, d4 = d / 4, pk = PK ? a.pk_dims : 0, dsb = ap_smem_row_bytes<PK>(d, pk);
  float* Qs = sh;                      // [HG][ds]
  uint8_t* Kbuf = (uint8_t*)(Qs + HG * ds);  // [NBUF][AP_KT] rows of dsb bytes
  float* Ss = (float*)(Kbuf + NBUF * AP_KT * dsb);  // [KS][HG][AP_SP] partial scores; part 0 then the tile's weights
  float* m_s = Ss + KS * HG * AP_SP;   // [HG] running max
  float* l_s = m_s + HG;               // [HG] running sum
  float* f_s = l_s + HG;               // [HG] this tile's rescale, then the final factor
  int* ok_s = (int*)(f_s + HG);        // [NBUF][AP_KT] key present and visible
  int* sel_stage = ok_s + NBUF * AP_KT;  // [n_sel] with a.prefetch: the query's selected rows
  const int t = blockIdx.x, h_base = blockIdx.y * HG;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, i4 = lane & 3;
  const int64_t p = a.pos0 + t;
  const int n_cmp = a.comp ? (a.sel ? a.n_sel : a.n_comp) : 0;
  const int n_keys = a.Wn + n_cmp;
  const int64_t n_vis = a.ratio > 0 ? (p + 1) / a.ratio : 0;
  const int* sel_s = nullptr;
  if (a.prefetch && a.sel && a.comp) {
    ap_stage_sel(a, t, n_vis, sel_stage);
    __syncthreads();
    sel_s = sel_stage;
  }
  ap_load_tile<PK>(a, t, p, n_vis, n_keys, 0, Kbuf, ok_s, dsb, sel_s);  // the first tile loads while Q is staged
  for (int i = tid; i < HG * d4; i += AP_THREADS) {
    const int r = i / d4, c = i - r * d4, h = h_base + r;
    const float4 v = h < a.H ? __ldg((const float4*)(a.q + ((int64_t)t * a.H + h) * d) + c)
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    *(float4*)(Qs + r * ds + 4 * c) = v;
  }
  if (a.q_post_on) {
    __syncthreads();  // rows staged by other warps
    ap_q_post<HG>(a, t, (float)p, h_base, Qs, ds);
  }
  if (tid < HG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  const int mt_o = warp % MT, cp = warp / MT, ntw = d / 8 / CP;  // this warp's output tiles
  const int kpart = d / KS, k_lo = (warp / (2 * MT)) * kpart, k_hi = k_lo + kpart;  // this warp's score columns
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  // form 2's P.V: whole chunks of AP_PVC tiles, each on one side of exact_dims
  const bool pv_straight = a.form == 2 && ntw == NT && a.exact_dims % (8 * AP_PVC) == 0;

  for (int k0 = 0, buf = 0; k0 < n_keys; k0 += AP_KT, buf = NBUF == 2 ? buf ^ 1 : 0) {
    __syncthreads();  // the previous tile's reads of its buffer, Ss and f_s are done
    if constexpr (NBUF == 2) {
      if (k0 + AP_KT < n_keys) {
        ap_load_tile<PK>(a, t, p, n_vis, n_keys, k0 + AP_KT, Kbuf + (buf ^ 1) * AP_KT * dsb, ok_s + (buf ^ 1) * AP_KT,
                         dsb, sel_s);
        asm volatile("cp.async.wait_group 1;\n" ::);
      } else {
        asm volatile("cp.async.wait_group 0;\n" ::);
      }
    } else {
      if (k0 > 0) ap_load_tile<PK>(a, t, p, n_vis, n_keys, k0, Kbuf, ok_s, dsb, sel_s);
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();  // this tile is in shared memory for every thread
    // one buffer: the next tile's rows head for L2 while this one is used, so its load waits on L2, not DRAM
    if (NBUF == 1 && a.prefetch >= 2 && k0 + AP_KT < n_keys)
      ap_prefetch_tile<PK>(a, t, p, n_vis, n_keys, k0 + AP_KT, sel_s);
    const uint8_t* Ks = Kbuf + buf * AP_KT * dsb;
    const int* ok = ok_s + buf * AP_KT;
    {  // scores: m-tile warp % MT, keys 8 ((warp / MT) % 2) .. + 7 of the tile, columns k_lo .. k_hi - 1
      const int mt = warp % MT, n0 = 8 * ((warp / MT) % 2);
      const float* q0 = Qs + (16 * mt + g) * ds + 2 * i4;
      const float* q1 = q0 + 8 * ds;
      const uint8_t* kr = Ks + (n0 + g) * dsb;
      float cm[KC][4], cc[KC][4];
#pragma unroll
      for (int j = 0; j < KC; ++j)
        cm[j][0] = cm[j][1] = cm[j][2] = cm[j][3] = cc[j][0] = cc[j][1] = cc[j][2] = cc[j][3] = 0.0f;
      const int e_hi = min(max(a.exact_dims, k_lo), k_hi);  // columns [k_lo, e_hi) need no key split
      if (a.form == 2 && (k_hi - k_lo) % (8 * KC) == 0 && (e_hi - k_lo) % (8 * KC) == 0) {
        int k = k_lo;
        for (; k < e_hi; k += 8 * KC) ap_score_steps<false, PK, KC>(q0, q1, kr, k, i4, pk, cm, cc);
        for (; k < k_hi; k += 8 * KC) ap_score_steps<true, PK, KC>(q0, q1, kr, k, i4, pk, cm, cc);
      } else
      for (int k = k_lo; k < k_hi; k += 8 * KC) {
#pragma unroll
        for (int j = 0; j < KC; ++j) {
          const int kk = k + 8 * j;
          if (kk >= k_hi) break;  // uniform: d / KS may not be a multiple of 32
          const float2 x0 = *(const float2*)(q0 + kk), x1 = *(const float2*)(q1 + kk);
          const float2 y = ap_key_pair<PK>(kr, kk + 2 * i4, pk);  // kk < pk: uniform (pk a multiple of 8)
          uint32_t ah[4], al[4], bh[2], bl[2];
          split_tf32(x0.x, ah[0], al[0]);
          split_tf32(x1.x, ah[1], al[1]);
          split_tf32(x0.y, ah[2], al[2]);
          split_tf32(x1.y, ah[3], al[3]);
          const bool split_k = kk + 8 > a.exact_dims;  // uniform; else the keys are their own TF32 hi, lo is zero
          bh[0] = __float_as_uint(y.x);
          bh[1] = __float_as_uint(y.y);
          if (split_k) {
            split_tf32(y.x, bh[0], bl[0]);
            split_tf32(y.y, bh[1], bl[1]);
          }
          mma_tf32(cc[j], al, bh);
          if (split_k) mma_tf32(cc[j], ah, bl);
          mma_tf32(cm[j], ah, bh);
        }
      }
      float c[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        c[e] = ((cc[0][e] + cc[1][e]) + (cc[2][e] + cc[3][e])) + ((cm[0][e] + cm[1][e]) + (cm[2][e] + cm[3][e]));
      float* sp = Ss + (warp / (2 * MT)) * HG * AP_SP + (16 * mt + g) * AP_SP + n0 + 2 * i4;
      sp[0] = c[0];
      sp[1] = c[1];
      sp[8 * AP_SP] = c[2];
      sp[8 * AP_SP + 1] = c[3];
    }
    __syncthreads();
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
    __syncthreads();
    const float r0 = f_s[16 * mt_o + g], r1 = f_s[16 * mt_o + g + 8];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] *= r0;
      acc[n][1] *= r0;
      acc[n][2] *= r1;
      acc[n][3] *= r1;
    }
#pragma unroll
    for (int ks = 0; ks < AP_KT; ks += 8) {  // P [16 heads x 8 keys] . V [8 keys x 8 columns] per output tile
      const float* p0 = Ss + (16 * mt_o + g) * AP_SP + ks;
      uint32_t ah[4], al[4];
      split_tf32(p0[i4], ah[0], al[0]);
      split_tf32(p0[8 * AP_SP + i4], ah[1], al[1]);
      split_tf32(p0[i4 + 4], ah[2], al[2]);
      split_tf32(p0[8 * AP_SP + i4 + 4], ah[3], al[3]);
      const uint8_t* v0 = Ks + (ks + i4) * dsb;
      if (pv_straight) {
#pragma unroll
        for (int c = 0; c < NT; c += AP_PVC) {
          const int col0 = (cp * NT + c) * 8;  // ntw == NT here
          if (col0 + 8 * AP_PVC > a.exact_dims) ap_pv_chunk<true, PK, AP_PVC, NT>(v0, dsb, col0, g, pk, ah, al, acc, c);
          else ap_pv_chunk<false, PK, AP_PVC, NT>(v0, dsb, col0, g, pk, ah, al, acc, c);
        }
        continue;
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (n >= ntw) break;
        const int col = (cp * ntw + n) * 8;
        uint32_t bh[2], bl[2];
        const bool split_v = col + 8 > a.exact_dims;  // uniform; else the values are exact in TF32 (lo = 0)
        const float v_0 = ap_key_value<PK>(v0, col + g, pk), v_1 = ap_key_value<PK>(v0 + 4 * dsb, col + g, pk);
        bh[0] = __float_as_uint(v_0);
        bh[1] = __float_as_uint(v_1);
        if (split_v) {
          split_tf32(v_0, bh[0], bl[0]);
          split_tf32(v_1, bh[1], bl[1]);
        }
        // the split product's order (al . bh, ah . bl, ah . bh; no lo . lo: below float32 rounding), without the
        // zero product where the values are exact
        mma_tf32(acc[n], al, bh);
        if (split_v) mma_tf32(acc[n], ah, bl);
        mma_tf32(acc[n], ah, bh);
      }
    }
  }
  __syncthreads();
  float* gmax = Ss;  // out_hi: the largest |y| of each head group of this CTA (the scores' scratch is free now)
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
    const int col = (cp * ntw + n) * 8 + 2 * i4;
    float2 y0 = make_float2(acc[n][0] * f0, acc[n][1] * f0), y1 = make_float2(acc[n][2] * f1, acc[n][3] * f1);
    if (a.out_freq && col >= rope_from) {  // inverse RoPE of the pair (col, col + 1), as norm_rope_warp_kernel does it
      const float ang = (float)p * a.out_freq[(col - rope_from) / 2];
      const float c = cosf(ang), sn = -sinf(ang);
      y0 = make_float2(__fsub_rn(__fmul_rn(y0.x, c), __fmul_rn(y0.y, sn)),
                       __fadd_rn(__fmul_rn(y0.x, sn), __fmul_rn(y0.y, c)));
      y1 = make_float2(__fsub_rn(__fmul_rn(y1.x, c), __fmul_rn(y1.y, sn)),
                       __fadd_rn(__fmul_rn(y1.x, sn), __fmul_rn(y1.y, c)));
    }
    if (a.out_hi) {
      acc[n][0] = y0.x, acc[n][1] = y0.y, acc[n][2] = y1.x, acc[n][3] = y1.y;
      m0 = fmaxf(m0, fmaxf(fabsf(y0.x), fabsf(y0.y)));
      m1 = fmaxf(m1, fmaxf(fabsf(y1.x), fabsf(y1.y)));
      continue;
    }
    if (h0 < a.H) *(float2*)(a.out + ((int64_t)t * a.H + h0) * d + col) = y0;
    if (h1 < a.H) *(float2*)(a.out + ((int64_t)t * a.H + h1) * d + col) = y1;
  }
  if (a.out_hi) ap_store_split<NT, HG>(a, t, h_base, h0, h1, cp * ntw, ntw, i4, acc, m0, m1, gmax);
}

template <int MT, int NBUF, int MINB, bool PK = false>
void launch_mt(const PrefillAttn& a, cudaStream_t s) {
  constexpr int HG = 16 * MT, KS = AP_WARPS / (2 * MT);
  if (a.out_hi && HG % a.out_hpg)
    throw std::invalid_argument("prefill_attn: a head group of the split output spans two CTAs");
  const int ds = a.d + AP_PAD;
  const size_t shm = sizeof(float) * ((size_t)HG * ds + (size_t)KS * HG * AP_SP + 3 * HG) +
                     (size_t)NBUF * AP_KT * ap_smem_row_bytes<PK>(a.d, a.pk_dims) +
                     sizeof(int) * (NBUF * AP_KT + (a.prefetch && a.sel && a.comp ? a.n_sel : 0));
  static size_t shm_set = 0;
  if (shm > shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(prefill_attn_kernel<MT, NBUF, MINB, PK>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = shm;
  }
  prefill_attn_kernel<MT, NBUF, MINB, PK><<<dim3(a.T, (a.H + HG - 1) / HG), AP_THREADS, shm, s>>>(a);
}

// $DS4_GPU_ATTN_PREFETCH: 1 (default since v13: 8192-token prefill 3316/3344 -> 3398/3395 t/s) the selected rows
// staged once per query; 0 the v12 form (an index load before each key row's copy); 2 also the L2 prefetch of the
// next key tile in the single-buffered form (v13: no gain over 1, the keys are already in L2). Read once.
int attn_prefetch_mode() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_ATTN_PREFETCH");
    return e && *e ? std::max(0, std::min(2, atoi(e))) : 1;
  }();
  return v;
}

// $DS4_GPU_ATTN_FORM: 2 (default) the inner loops without per-step branches and with each step's dependent products
// apart (ap_score_step, ap_pv_chunk); 1 the v13 loops. The same bits. Read once.
int attn_form() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_ATTN_FORM");
    return e && *e && atoi(e) == 1 ? 1 : 2;
  }();
  return v;
}

// Heads per CTA for more than 32 heads ($DS4_GPU_ATTN_HEADS, read once): 32 (default: two CTAs per query, one key
// buffer, 2 CTAs per SM), 64 (one CTA per query, 1 per SM; v10, 2048 queries of a Flash top-k layer: 5.23 against
// 7.11 ms; v13 end to end 1.1x slower) or 16 (four CTAs per query, double-buffered keys, 2 CTAs per SM; each key row
// read from L2 four times).
int heads_per_cta() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_ATTN_HEADS");
    const int h = e ? atoi(e) : 32;
    return h == 64 || h == 16 ? h : 32;
  }();
  return v;
}

}  // namespace

namespace {
// One thread per 16 output bytes (8 bfloat16 values, or 4 floats) of a packed key row.
__global__ void pack_keys_kernel(const float* x, int64_t rows, int d, int pk, uint16_t* out) {
  const int per_row = pk / 8 + (d - pk) / 4;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * per_row) return;
  const int64_t r = i / per_row;
  const int u = (int)(i - r * per_row);
  const float* xr = x + r * d;
  uint4* dst = (uint4*)(out + r * (pk + 2 * (int64_t)(d - pk))) + u;
  if (u < pk / 8) {  // bfloat16 by truncation: exact for the FP8-simulated values these columns hold
    const float4 a = ((const float4*)xr)[2 * u], b = ((const float4*)xr)[2 * u + 1];
    auto two = [](float lo, float hi) { return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u); };
    *dst = make_uint4(two(a.x, a.y), two(a.z, a.w), two(b.x, b.y), two(b.z, b.w));
  } else {
    const float4 v = ((const float4*)(xr + pk))[u - pk / 8];
    *dst = make_uint4(__float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z), __float_as_uint(v.w));
  }
}
}  // namespace

void launch_pack_keys(const float* x, int64_t rows, int d, int pk_dims, uint16_t* out, cudaStream_t s) {
  if (pk_dims <= 0 || pk_dims >= d || pk_dims % 8 || d % 4)
    throw std::invalid_argument("pack_keys: pk_dims must be a multiple of 8 in (0, d), d a multiple of 4");
  if ((uintptr_t)x % 16 || (uintptr_t)out % 16) throw std::invalid_argument("pack_keys: rows must be 16-byte aligned");
  if (rows <= 0) return;
  const int64_t n = rows * (pk_dims / 8 + (d - pk_dims) / 4);
  pack_keys_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(x, rows, d, pk_dims, out);
  DS4_CHECK_LAUNCH("pack_keys");
}

bool prefill_attn_takes(int H, int d) { return H > 0 && d > 0 && d % 64 == 0 && d <= 512; }

void launch_prefill_attn(const PrefillAttn& args, cudaStream_t s) {
  PrefillAttn a = args;
  if (a.prefetch < 0 || a.prefetch > 2) a.prefetch = attn_prefetch_mode();
  if (a.form != 1 && a.form != 2) a.form = attn_form();
  if (a.sel && a.n_sel > 1024) a.prefetch = 0;  // the staged rows (4 KB at most) keep two CTAs per SM where two fit
  if (!prefill_attn_takes(a.H, a.d)) throw std::invalid_argument("prefill_attn: head dim must be a multiple of 64, <= 512");
  if (a.T < 0 || a.Wn < 1 || a.n_comp < 0 || (a.sel && a.n_sel < 1) || (a.comp && a.ratio < 1))
    throw std::invalid_argument("prefill_attn: bad sizes");
  if (a.exact_dims < 0 || a.exact_dims % 8 || a.exact_dims > a.d)
    throw std::invalid_argument("prefill_attn: exact_dims must be a multiple of 8 in [0, d]");
  if (a.out_freq && (a.out_rope_dim <= 0 || a.out_rope_dim % 8 || a.out_rope_dim > a.d))
    throw std::invalid_argument("prefill_attn: out_rope_dim must be a multiple of 8 in (0, d]");
  for (const void* ptr : {(const void*)a.q, (const void*)a.win, (const void*)a.comp, (const void*)a.out})
    if ((uintptr_t)ptr % 16) throw std::invalid_argument("prefill_attn: rows must be 16-byte aligned");
  if (a.win_pk) {
    if ((a.comp && a.n_comp > 0 && !a.comp_pk) || a.pk_dims != a.exact_dims || a.pk_dims <= 0 || a.pk_dims >= a.d)
      throw std::invalid_argument("prefill_attn: packed keys need pk_dims == exact_dims in (0, d) and packed comp rows");
    for (const void* ptr : {(const void*)a.win_pk, (const void*)a.comp_pk})
      if ((uintptr_t)ptr % 16) throw std::invalid_argument("prefill_attn: packed rows must be 16-byte aligned");
  }
  if (a.out_hi && (!a.out_lo || !a.out_s || a.out_hpg < 1 || a.H % a.out_hpg || 16 % a.out_hpg != 0 && a.out_hpg % 16))
    throw std::invalid_argument("prefill_attn: the split output needs hi, lo, s and head groups that tile 16-head blocks");
  if (a.T == 0) return;
  if (a.win_pk) {  // packed keys: two key buffers in every form (the half-size rows leave room for them)
    if (a.H <= 16 || heads_per_cta() == 16) launch_mt<1, 2, 2, true>(a, s);
    else if (a.H <= 32 || heads_per_cta() == 32) launch_mt<2, 2, 2, true>(a, s);
    else launch_mt<4, 2, 1, true>(a, s);
    DS4_CHECK_LAUNCH("prefill_attn (packed keys)");
    return;
  }
  // heads per CTA: 16, 32 or 64 (d * MT / 64 output tiles of 8 columns per warp)
  if (a.H <= 16 || heads_per_cta() == 16) launch_mt<1, 2, 2>(a, s);
  else if (a.H <= 32 || heads_per_cta() == 32) launch_mt<2, 1, 2>(a, s);
  else launch_mt<4, 2, 1>(a, s);
  DS4_CHECK_LAUNCH("prefill_attn");
}

}  // namespace ds4gpu
