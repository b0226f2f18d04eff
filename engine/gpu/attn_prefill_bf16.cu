// Prefill attention, form 3 ($DS4_GPU_ATTN_FORM=3, v25): every product on the bfloat16 tensor cores. The
// FP8-simulated key columns are exact in bfloat16 (e4m3 values; pack_keys truncates them so); the RoPE columns come
// packed as bfloat16 hi + lo (PrefillAttn::pk_split); the queries and the softmax weights are split once as hi + lo.
// Each split is |x - hi - lo| <= 2^-18 |x|; the products are lo.k then hi.k (and hi.k_lo on the RoPE columns), 16
// columns per mma where the TF32 forms (attn_prefill.cu) take 8, split the queries again at every key tile and spend
// three TF32 products on each RoPE column. Not the TF32 forms' bits; within float32 rounding of them
// (tests/test_gpu_prefill_attn.py).
//
// Why (v15's profile of an 8192-token Flash prefill): the attention took ~0.43 s of 2.1, issue-bound on the TF32
// splits (8 of ~17 instructions per score step) and on twice the mma count.
//
// One CTA per (query, 32 heads), 8 warps, two CTAs per SM, keys in tiles of 16 as in the TF32 forms (the same tile
// loads, online softmax and epilogue: attn_prefill.cuh). Shared memory: the queries as bfloat16 hi and lo rows, then a
// region that first stages 16 float32 query rows at a time (read, post-processed, split) and then holds the two key
// buffers and the scores.
#include <cuda_bf16.h>

#include "attn_prefill.cuh"
#include "mbarrier.cuh"
#include "mma_ops.cuh"

namespace ds4gpu {

namespace {

constexpr int A3_MT = 2;                     // m-tiles of 16 heads per CTA
constexpr int A3_HG = 16 * A3_MT;            // heads per CTA
constexpr int A3_KS = AP_WARPS / (2 * A3_MT);  // head-dimension parts of each score job
constexpr int A3_KC = 4;                     // independent score chains

// x = hi + lo for a pair, both rounded to bfloat16 (the lower address in the low half, as the fragments want it)
__device__ __forceinline__ void split_bf16_pair(float2 x, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __float22bfloat162_rn(x);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __float22bfloat162_rn(make_float2(x.x - hf.x, x.y - hf.y));
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// Shared layout (bytes from the start): the two key buffers' mbarriers (TMA form), Qh, Ql [HG][d + 8] bfloat16 (rows
// 1040 bytes apart for d = 512: ldmatrix's 8 rows hit distinct 16-byte bank groups), then the union region.
struct A3Layout {
  int qb, dsb;
  size_t qh, ql, uni, kbuf_bytes, tail_bytes, stage_bytes, total;
  __host__ __device__ A3Layout(int d, int pk, int n_sel_staged) {
    qb = d + 8;
    dsb = ap_smem_row_bytes<true>(d, pk);
    qh = 16;
    ql = qh + 2 * (size_t)A3_HG * qb;
    uni = ql + 2 * (size_t)A3_HG * qb;
    kbuf_bytes = 2 * (size_t)AP_KT * dsb;
    tail_bytes = 4 * ((size_t)A3_KS * A3_HG * AP_SP + 3 * A3_HG + 2 * AP_KT + n_sel_staged);
    stage_bytes = 4 * (size_t)16 * (d + AP_PAD);
    total = uni + (kbuf_bytes + tail_bytes > stage_bytes ? kbuf_bytes + tail_bytes : stage_bytes);
  }
};

// The CTA's 32 query rows, 16 at a time: staged as float32 in `stage` (post-processed there as the TF32 forms do it),
// then split into Qh + Ql.
__device__ __forceinline__ void a3_stage_queries(const PrefillAttn& a, int t, int64_t p, int h_base, float* stage,
                                                 __nv_bfloat16* Qh, __nv_bfloat16* Ql, int qb) {
  const int d = a.d, ds = d + AP_PAD, d4 = d / 4, d2 = d / 2, tid = threadIdx.x;
  for (int half = 0; half < A3_MT; ++half) {
    const int hb = h_base + 16 * half;
    if (half) __syncthreads();  // the previous half's rows are split
    for (int i = tid; i < 16 * d4; i += AP_THREADS) {
      const int r = i / d4, c = i - r * d4, h = hb + r;
      const float4 v = h < a.H ? __ldg((const float4*)(a.q + ((int64_t)t * a.H + h) * d) + c)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      *(float4*)(stage + r * ds + 4 * c) = v;
    }
    if (a.q_post_on) {
      __syncthreads();  // rows staged by other warps
      ap_q_post<16>(a, t, (float)p, hb, stage, ds);
    }
    __syncthreads();
    for (int i = tid; i < 16 * d2; i += AP_THREADS) {
      const int r = i / d2, c = 2 * (i - r * d2), row = 16 * half + r;
      uint32_t hi, lo;
      split_bf16_pair(*(const float2*)(stage + r * ds + c), hi, lo);
      *(uint32_t*)(Qh + row * qb + c) = hi;
      *(uint32_t*)(Ql + row * qb + c) = lo;
    }
  }
  __syncthreads();  // the stage region is free for the key buffers
}

// QREGS form ($DS4_GPU_ATTN_QREGS, v27): each warp takes whole query rows (rows warp, warp + 8, ..; lane holds columns
// lane + 32 k) from global memory into registers, applies q_post there and writes the rows' bfloat16 split: no float32
// stage in shared memory, no barrier between the passes. ap_q_post's arithmetic in its order (the per-lane sums of
// squares over k, the same butterfly, the products in the same association, one cosf/sinf per (lane, k)), and
// split_bf16_pair on the same column pairs: the same bits as a3_stage_queries. d = 32 NK; a RoPE tail of at most
// 32 RK columns (a3_qregs_takes).
constexpr int A3_QREGS_RK = 2;
template <int NK>
__device__ __forceinline__ void a3_stage_queries_regs(const PrefillAttn& a, int t, int64_t p, int h_base,
                                                      __nv_bfloat16* Qh, __nv_bfloat16* Ql, int qb) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const RowPost& o = a.q_post;
  const float in_s = a.q_in_scale ? a.q_in_scale[t] : 1.0f;
  constexpr int RK = A3_QREGS_RK, K0 = NK - RK;
  const int n_nope = a.d - o.rope_dim, k_rope = a.q_post_on && o.freq ? n_nope / 32 : NK;
  float cs[RK], sn[RK];  // RoPE factors of this lane's columns lane + 32 (K0 + j) (k_rope >= K0: a3_qregs_takes)
#pragma unroll
  for (int j = 0; j < RK; ++j) {
    cs[j] = 1.0f, sn[j] = 0.0f;
    const int k = K0 + j, e = lane + 32 * k;
    if (k >= k_rope && e >= n_nope) {
      const float ang = (float)p * o.freq[(e - n_nope) / 2];
      cs[j] = cosf(ang);
      sn[j] = o.inverse ? -sinf(ang) : sinf(ang);
    }
  }
  for (int r = warp; r < A3_HG; r += AP_WARPS) {
    const int h = h_base + r;
    const bool live = h < a.H;  // rows past H stay zero
    float x[NK];
    const float* src = a.q + ((int64_t)t * a.H + (live ? h : 0)) * a.d + lane;
#pragma unroll
    for (int k = 0; k < NK; ++k) x[k] = live ? __ldg(src + 32 * k) : 0.0f;
    if (a.q_post_on && live) {
      float ss = 0.0f;
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        if (a.q_in_scale) x[k] = x[k] * in_s;
        ss += x[k] * x[k];
      }
      if (o.norm) {
        const float rn = rsqrtf(warp_sum_f(ss) / (float)a.d + o.eps);
#pragma unroll
        for (int k = 0; k < NK; ++k) x[k] = o.w ? x[k] * rn * o.w[lane + 32 * k] : x[k] * rn;
      }
#pragma unroll
      for (int j = 0; j < RK; ++j) {
        const int k = K0 + j;
        if (k < k_rope) continue;
        const float v = x[k], partner = __shfl_xor_sync(0xffffffffu, v, 1);
        if (lane + 32 * k >= n_nope)
          x[k] = (lane & 1) ? __fadd_rn(__fmul_rn(partner, sn[j]), __fmul_rn(v, cs[j]))
                            : __fsub_rn(__fmul_rn(v, cs[j]), __fmul_rn(partner, sn[j]));
      }
    }
#pragma unroll
    for (int k = 0; k < NK; ++k) {  // columns (c, c + 1) of an even lane's c = lane + 32 k
      const float next = __shfl_down_sync(0xffffffffu, x[k], 1);
      if (!(lane & 1)) {
        uint32_t hi, lo;
        split_bf16_pair(make_float2(x[k], next), hi, lo);
        *(uint32_t*)(Qh + r * qb + 32 * k + lane) = hi;
        *(uint32_t*)(Ql + r * qb + 32 * k + lane) = lo;
      }
    }
  }
  __syncthreads();
}

// TMA form ($DS4_GPU_ATTN_TMA, v25): key tile k0 into Kb by bulk copies, one per key row (1152 bytes for Flash)
// issued by lane r < AP_KT of warp 0 for row r, counted on bar; rows that are not keys are not copied (the buffer keeps
// finite values there: zeros or an earlier tile's keys, which the zero weights of the softmax cancel). v25's profile
// of the cp.async loads (ap_load_tile: 16-byte pieces over the warps, an address per piece): ~30% of the kernel's
// instructions. Called by warp 0 only.
__device__ __forceinline__ void a3_load_tile_tma(const PrefillAttn& a, int t, int64_t p, int64_t n_vis, int n_keys,
                                                 int k0, uint8_t* Kb, int* ok, int dsb, const int* sel_s,
                                                 uint64_t* bar) {
  const int lane = threadIdx.x & 31;
  const uint8_t* src = lane < AP_KT ? ap_key_src<true>(a, t, p, n_vis, n_keys, k0 + lane, sel_s) : nullptr;
  const uint32_t rb = (uint32_t)ap_row_bytes<true>(a);
  const int n = __popc(__ballot_sync(0xffffffffu, src != nullptr));
  if (lane == 0) mbar_arrive_expect_tx(bar, (uint32_t)n * rb);
  __syncwarp();
  if (src) bulk_copy_g2s(Kb + lane * dsb, src, rb, bar);
  if (lane < AP_KT) ok[lane] = src != nullptr;
}

// NB output tiles (8 columns each) of exact columns and NR of RoPE columns per warp: warp part cp owns the exact tiles
// NB cp .. + NB - 1 and the RoPE tiles NR cp .. + NR - 1 (so every warp has the same mix of work). Key rows: pk
// bfloat16 columns, then the RoPE columns' hi, then their lo (byte 2 c is column c's value or hi, 2 c + 2 (d - pk) its
// lo).
// OST ($DS4_GPU_ATTN_OSTAGE): the split output staged in the query planes' shared memory (free after the last tile:
// ap_split_stage_bytes fits them exactly at d = 512) and written out in whole runs (ap_split_flush).
template <int NB, int NR, bool TMA, bool QREGS = false, bool OST = false>
__global__ void __launch_bounds__(AP_THREADS, 2) prefill_attn_bf16_kernel(const __grid_constant__ PrefillAttn a) {
  constexpr int MT = A3_MT, HG = A3_HG, KS = A3_KS, KC = A3_KC, NT = NB + NR;
  static_assert(NB % 2 == 0 && NR == 2, "output tiles go in pairs (one transposed ldmatrix.x4 each)");
  extern __shared__ __align__(16) float sh[];
  const int t = blockIdx.x, h_base = blockIdx.y * HG;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, i4 = lane & 3;
  const int d = a.d, pk = a.pk_dims, lo_off = 2 * (d - pk);  // bytes from a RoPE column's hi to its lo
  const int64_t p = a.pos0 + t;
  const int n_cmp = a.comp ? (a.sel ? a.n_sel : a.n_comp) : 0;
  const int n_keys = a.Wn + n_cmp;
  const int64_t n_vis = a.ratio > 0 ? (p + 1) / a.ratio : 0;
  const bool stage_sel = a.prefetch && a.sel && a.comp;
  const A3Layout lay(d, pk, stage_sel ? a.n_sel : 0);
  uint8_t* base = (uint8_t*)sh;
  uint64_t* kbar = (uint64_t*)base;  // TMA: one mbarrier per key buffer
  __nv_bfloat16* Qh = (__nv_bfloat16*)(base + lay.qh);
  __nv_bfloat16* Ql = (__nv_bfloat16*)(base + lay.ql);
  uint8_t* Kbuf = base + lay.uni;  // [2][AP_KT] key rows of dsb bytes, after the queries are split
  float* Ss = (float*)(Kbuf + lay.kbuf_bytes);  // [KS][HG][AP_SP] partial scores; part 0 then the tile's weights
  float* m_s = Ss + KS * HG * AP_SP;
  float* l_s = m_s + HG;
  float* f_s = l_s + HG;
  int* ok_s = (int*)(f_s + HG);    // [2][AP_KT]
  int* sel_stage = ok_s + 2 * AP_KT;
  const int qb = lay.qb, dsb = lay.dsb;

  if (TMA && tid == 0) {
    mbar_init(&kbar[0], 1);
    mbar_init(&kbar[1], 1);
    mbar_init_fence();
  }
  if constexpr (QREGS) a3_stage_queries_regs<16>(a, t, p, h_base, Qh, Ql, qb);  // d = 512 (launch_prefill_attn_bf16)
  else a3_stage_queries(a, t, p, h_base, (float*)(base + lay.uni), Qh, Ql, qb);
  if (TMA) {  // finite values where a tile has no key row (the stage left floats in part of it, the rest is unset)
    for (int i = tid; i < (int)(lay.kbuf_bytes / 16); i += AP_THREADS) ((uint4*)Kbuf)[i] = make_uint4(0, 0, 0, 0);
    fence_async_smem();  // these stores and the stage's accesses before the bulk copies into the same bytes
  }
  const int* sel_s = nullptr;
  if (TMA || stage_sel) {
    if (stage_sel) ap_stage_sel(a, t, n_vis, sel_stage);
    __syncthreads();
    if (stage_sel) sel_s = sel_stage;
  }
  if (!TMA) ap_load_tile<true>(a, t, p, n_vis, n_keys, 0, Kbuf, ok_s, dsb, sel_s);
  else if (warp == 0) a3_load_tile_tma(a, t, p, n_vis, n_keys, 0, Kbuf, ok_s, dsb, sel_s, &kbar[0]);
  if (tid < HG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  const int mt_o = warp % MT, cp = warp / MT;  // this warp's output: m-tile mt_o, column part cp
  // scores: m-tile warp % MT, keys n0 .. n0 + 7 of the tile, head columns k_lo .. k_hi - 1 (exact below e_hi)
  const int mt = warp % MT, n0 = 8 * ((warp / MT) % 2);
  const int kpart = d / KS, k_lo = (warp / (2 * MT)) * kpart, k_hi = k_lo + kpart;
  const int e_hi = min(max(pk, k_lo), k_hi);
  const __nv_bfloat16* qh_row = Qh + (16 * mt + (lane & 15)) * qb + 8 * (lane >> 4);  // ldmatrix.x4: the A fragment
  const __nv_bfloat16* ql_row = Ql + (16 * mt + (lane & 15)) * qb + 8 * (lane >> 4);
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  for (int k0 = 0, buf = 0; k0 < n_keys; k0 += AP_KT, buf ^= 1) {
    if (TMA) {
      fence_async_smem();  // this thread's reads of the buffer the next copies refill, before them
      __syncthreads();     // the previous tile's reads of its buffer, Ss and f_s are done
      if (warp == 0 && k0 + AP_KT < n_keys)
        a3_load_tile_tma(a, t, p, n_vis, n_keys, k0 + AP_KT, Kbuf + (buf ^ 1) * AP_KT * dsb, ok_s + (buf ^ 1) * AP_KT,
                         dsb, sel_s, &kbar[buf ^ 1]);
      mbar_wait(&kbar[buf], (k0 / AP_KT >> 1) & 1);  // this tile's rows (its ok flags: the barrier above)
    } else {
    __syncthreads();  // the previous tile's reads of its buffer, Ss and f_s are done
    if (k0 + AP_KT < n_keys) {
      ap_load_tile<true>(a, t, p, n_vis, n_keys, k0 + AP_KT, Kbuf + (buf ^ 1) * AP_KT * dsb, ok_s + (buf ^ 1) * AP_KT,
                         dsb, sel_s);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();  // this tile is in shared memory for every thread
    }
    const uint8_t* Ks = Kbuf + buf * AP_KT * dsb;
    const int* ok = ok_s + buf * AP_KT;
    {
      float cm[KC][4], cc[KC][4];
#pragma unroll
      for (int j = 0; j < KC; ++j)
        cm[j][0] = cm[j][1] = cm[j][2] = cm[j][3] = cc[j][0] = cc[j][1] = cc[j][2] = cc[j][3] = 0.0f;
      // ldmatrix.x4 on 8 key rows: matrices at columns k, k + 8, k + 16, k + 24 = B fragments of two 16-column steps
      const uint8_t* kb_row = Ks + (n0 + (lane & 7)) * dsb + 16 * (lane >> 3);
      for (int k = k_lo; k < e_hi; k += 16 * KC) {  // exact columns: lo.k, hi.k
#pragma unroll
        for (int j = 0; j < KC; j += 2) {
          uint32_t b[4], ah[2][4], al[2][4];
          ldsm_x4(b, kb_row + 2 * (k + 16 * j));
          ldsm_x4(al[0], ql_row + k + 16 * j);
          ldsm_x4(al[1], ql_row + k + 16 * (j + 1));
          ldsm_x4(ah[0], qh_row + k + 16 * j);
          ldsm_x4(ah[1], qh_row + k + 16 * (j + 1));
          mma_bf16(cc[j], al[0], b[0], b[1]);
          mma_bf16(cc[j + 1], al[1], b[2], b[3]);
          mma_bf16(cm[j], ah[0], b[0], b[1]);
          mma_bf16(cm[j + 1], ah[1], b[2], b[3]);
        }
      }
      for (int k = e_hi; k < k_hi; k += 32) {  // RoPE columns: lo.k_hi, hi.k_lo, hi.k_hi (no lo.lo: below 2^-36)
        uint32_t bh[4], bl[4], ah[2][4], al[2][4];
        ldsm_x4(bh, kb_row + 2 * k);
        ldsm_x4(bl, kb_row + 2 * k + lo_off);
        ldsm_x4(al[0], ql_row + k);
        ldsm_x4(al[1], ql_row + k + 16);
        ldsm_x4(ah[0], qh_row + k);
        ldsm_x4(ah[1], qh_row + k + 16);
        mma_bf16(cc[0], al[0], bh[0], bh[1]);
        mma_bf16(cc[1], al[1], bh[2], bh[3]);
        mma_bf16(cc[2], ah[0], bl[0], bl[1]);
        mma_bf16(cc[3], ah[1], bl[2], bl[3]);
        mma_bf16(cm[0], ah[0], bh[0], bh[1]);
        mma_bf16(cm[1], ah[1], bh[2], bh[3]);
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
    ap_softmax<HG, KS>(a, k0, n_keys, ok, Ss, m_s, l_s, f_s);
    __syncthreads();
    const float r0 = f_s[16 * mt_o + g], r1 = f_s[16 * mt_o + g + 8];
    if (__any_sync(0xffffffffu, r0 != 1.0f || r1 != 1.0f)) {  // no new maximum in any of the warp's rows: x 1 skipped
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        acc[n][0] *= r0;
        acc[n][1] *= r0;
        acc[n][2] *= r1;
        acc[n][3] *= r1;
      }
    }
    // P [16 heads x 16 keys] . V [16 keys x 8 columns]: the weights split once per tile, the values as B fragments by
    // a transposed ldmatrix.x4 on the key rows, two output tiles per load
    const float* p0 = Ss + (16 * mt_o + g) * AP_SP;
    uint32_t ph[4], pl[4];
    split_bf16_pair(*(const float2*)(p0 + 2 * i4), ph[0], pl[0]);
    split_bf16_pair(*(const float2*)(p0 + 8 * AP_SP + 2 * i4), ph[1], pl[1]);
    split_bf16_pair(*(const float2*)(p0 + 8 + 2 * i4), ph[2], pl[2]);
    split_bf16_pair(*(const float2*)(p0 + 8 * AP_SP + 8 + 2 * i4), ph[3], pl[3]);
    const uint8_t* v_lane = Ks + (lane & 15) * dsb + 16 * (lane >> 4);
#pragma unroll
    for (int n = 0; n < NB; n += 2) {
      uint32_t v[4];
      ldsm_x4_trans(v, v_lane + 2 * 8 * (NB * cp + n));
      mma_bf16(acc[n], pl, v[0], v[1]);
      mma_bf16(acc[n + 1], pl, v[2], v[3]);
      mma_bf16(acc[n], ph, v[0], v[1]);
      mma_bf16(acc[n + 1], ph, v[2], v[3]);
    }
    {  // the RoPE tile pair: pl.v_hi, ph.v_lo, ph.v_hi
      uint32_t vh[4], vl[4];
      const uint8_t* vr = v_lane + 2 * (pk + 8 * NR * cp);
      ldsm_x4_trans(vh, vr);
      ldsm_x4_trans(vl, vr + lo_off);
      mma_bf16(acc[NB], pl, vh[0], vh[1]);
      mma_bf16(acc[NB + 1], pl, vh[2], vh[3]);
      mma_bf16(acc[NB], ph, vl[0], vl[1]);
      mma_bf16(acc[NB + 1], ph, vl[2], vl[3]);
      mma_bf16(acc[NB], ph, vh[0], vh[1]);
      mma_bf16(acc[NB + 1], ph, vh[2], vh[3]);
    }
  }
  static_assert(!OST || A3_HG == 32, "the staged split fills the query planes at 32 heads");
  ap_finish<NT, HG, OST, NB>(a, t, p, h_base, mt_o, NT,
                             [&](int n) { return n < NB ? 8 * (NB * cp + n) : pk + 8 * (NR * cp + n - NB); }, acc, m_s,
                             l_s, f_s, Ss, OST ? base + lay.qh : nullptr);
}

template <int NB, int NR, bool TMA, bool QREGS, bool OST = false>
void launch_bf16(const PrefillAttn& a, size_t shm, cudaStream_t s) {
  static size_t shm_set = 0;
  if (shm > shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(prefill_attn_bf16_kernel<NB, NR, TMA, QREGS, OST>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = shm;
  }
  prefill_attn_bf16_kernel<NB, NR, TMA, QREGS, OST><<<dim3(a.T, (a.H + A3_HG - 1) / A3_HG), AP_THREADS, shm, s>>>(a);
}


}  // namespace

// $DS4_GPU_ATTN_TMA (v25, default 1): form 3's key tiles by bulk copies (a3_load_tile_tma); 0: cp.async pieces
// (ap_load_tile). The same bits. set_attn_tma overrides it (0, 1; -1 the environment).
static EnvSwitch attn_tma_switch{"DS4_GPU_ATTN_TMA", 1, 1};
void set_attn_tma(int mode) { attn_tma_switch.set(mode); }
// $DS4_GPU_ATTN_QREGS (v27, default 1): 1 form 3 stages its query rows in registers (a3_stage_queries_regs), 0 through
// a float32 stage in shared memory (v26). The same bits. set_attn_qregs overrides it (0, 1; -1 the environment).
static EnvSwitch attn_qregs_switch{"DS4_GPU_ATTN_QREGS", 1, 1};
void set_attn_qregs(int mode) { attn_qregs_switch.set(mode); }
// $DS4_GPU_ATTN_OSTAGE (v27; default 1 since v28: session-like launch 2.97 -> 2.79 ms, 8192-token prefill +2.6%): 1 form
// 3's output (out_hi) staged in shared memory as float32 rows, then split and written in whole runs of 8 columns by one
// rolled loop (v41: ap_store_split_staged; v27-v40 staged the split from unrolled fragment code, ~9,700 instructions
// whose instruction-cache misses ncu counted); 0 split and stored from the fragments. The same bits. set_attn_ostage
// overrides it (0, 1; -1 the environment).
static EnvSwitch attn_ostage_switch{"DS4_GPU_ATTN_OSTAGE", 1, 1};
void set_attn_ostage(int mode) { attn_ostage_switch.set(mode); }

bool prefill_attn_bf16_takes(int d, int pk_dims, int out_hpg) {
  return d == 512 && pk_dims == 448 && (out_hpg <= 0 || A3_HG % out_hpg == 0);
}

// Form 3 where it takes the shapes (keys packed with a split tail, 448 exact columns of 512: DeepSeek V4's head; the
// split output's head groups within 32 heads): launched, true; else false (the caller runs a TF32 form).
bool launch_prefill_attn_bf16(const PrefillAttn& a, cudaStream_t s) {
  if (!a.win_pk || !a.pk_split || a.exact_dims != a.pk_dims) return false;
  if (a.out_freq && a.out_rope_dim > a.d - a.pk_dims) return false;  // the exact tiles hold no RoPE column (ap_finish)
  if (!prefill_attn_bf16_takes(a.d, a.pk_dims, a.out_hi ? a.out_hpg : 0)) return false;
  const bool stage_sel = a.prefetch && a.sel && a.comp;
  const A3Layout lay(a.d, a.pk_dims, stage_sel ? a.n_sel : 0);
  if (lay.total > 113 * 1024) return false;  // two CTAs per SM
  const bool tma = attn_tma_switch.get();
  const bool qregs = attn_qregs_switch.get() && (!a.q_post_on || !a.q_post.freq ||
                                                 a.q_post.rope_dim <= 32 * A3_QREGS_RK);  // per warp: 56 / 4 exact, 8 / 4 RoPE tiles
  const bool ost = a.out_hi && attn_ostage_switch.get() && ap_f32_stage_bytes(A3_HG, a.d) <= lay.uni - lay.qh;
  if (tma && qregs && ost) launch_bf16<14, 2, true, true, true>(a, lay.total, s);
  else if (tma && qregs) launch_bf16<14, 2, true, true>(a, lay.total, s);
  else if (tma) launch_bf16<14, 2, true, false>(a, lay.total, s);
  else launch_bf16<14, 2, false, false>(a, lay.total, s);
  DS4_CHECK_LAUNCH("prefill_attn (form 3, bfloat16)");
  return true;
}

}  // namespace ds4gpu
