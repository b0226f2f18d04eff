// Prefill products straight from the quantized codes on the int8 tensor cores (llama.cpp's "mmq" idea):
// y[t, r] = W[r] . x[t] for many activation rows, with the activations quantized as the decode kernels quantize
// them (quantize_x_kernel: x ~= s (254 hi + lo) per 32 columns) and, per 32 columns of a row, the exact int32 sum
// 254 (codes . hi) + (codes . lo) turned into a float as the batch-1 kernels do (mv_core.cuh mv_block):
//   row . x  =  dscale xs T  -  (min0 sum16_0 + min1 sum16_1)        (the min terms: Q2_K and Q4_K)
// so prefill and decode agree to the order of float sums. Q2_K's 4-bit multipliers of the two 16-column halves are
// folded into the codes (3 x 15 = 45 fits an int8), so one 32-column mma sum serves every type.
// What it replaces (weights.py `_gemm`, moe_gemm.py, the default): a dequant pass writing each weight as float16
// hi + lo (4 bytes per weight) and three float16 GEMMs (hi.hi + hi.lo + lo.hi) for ~22 bits of the activations;
// here two int8 products per block (hi and lo) at twice the float16 rate, and no weight copy.
//
// Tiles: a CTA computes 64 weight rows x NT = 64 (or 128) activation rows with 4 warps (2 x 2; 32 x NT / 2 each:
// 2 m16 x NT / 16 n8 tiles of mma.m16n8k32.s8) over stages of 128 columns (4 blocks of 32), double-buffered: the activation planes by cp.async,
// the weights' raw blocks through registers, decoded into shared memory (decode_xb, the batch-1 kernels' decode)
// while the previous stage is multiplied. Shared rows are padded to 144 bytes, so the ldmatrix phases (8 rows x 16
// bytes) hit 32 different banks.
// Activation tiles: dense (grid.y tiles of T rows, grid.z = group of a block-diagonal weight: weight rows g rows_g..,
// activation columns g K.., output columns g rows_g..) or a table of (first row, rows, expert) for the routed experts,
// whose activation rows are sorted by expert (weight rows expert rows_g..).
// Measured (NOTES.md v11): issue-bound at ~18 instructions per mma (the per-32-column epilogue and the weights'
// decode), ~120 T float32-equivalent products/s; slower than the dequant + f16 GEMM path for large dense matrices,
// faster end to end for the routed experts (the default there: no dequant pass, no padding). Tests:
// tests/test_gpu_mmq.py; benchmark against the f16 GEMM path: python -m ds4.engine.gpu.bench_mmq.
#include <cstddef>
#include <cstdlib>
#include <cuda_fp16.h>

#include "common.cuh"
#include "mma_ops.cuh"
#include "moe_mma.cuh"
#include "mv_core.cuh"

namespace ds4gpu {

namespace {

constexpr int MQ_M = 64;           // weight rows per CTA; NT (64 or 128) activation rows, 4 warps
constexpr int MQ_KS = 128;         // columns per stage
constexpr int MQ_NB = MQ_KS / 32;  // 32-column blocks per stage
constexpr int MQ_LD = MQ_KS + 16;  // padded bytes per shared row
template <int NT>
__host__ __device__ constexpr int mq_threads() { return 128; }  // 2 x 2 warps of 32 weight rows x NT / 2 activation rows
template <int NT>
__host__ __device__ constexpr int mq_pairs() { return MQ_M * MQ_NB / mq_threads<NT>(); }  // (row, block) decodes per thread and stage

struct MmqArgs {
  Packed w;
  int K, nb;          // columns of one weight matrix; its 256-column super-blocks
  XQ x;               // activation rows, x.n columns each
  float* y;
  int64_t ldy;
  int T, rows_g;      // dense: activation rows; rows per group (experts: per expert)
  const int4* tiles;  // experts: (first activation row, rows, expert, 0) per grid.y; null: dense
  int skip_rows;      // warps skip the n8 fragments past a partial tile's rows (mmq_skip_rows())
  int straight;       // full fragments without a test between them (mmq_straight())
  const int64_t* x_rows;  // experts: activation row i is x's row x_rows[i] (x quantized once per token); null: row i
};

// S256 (Q2_K, x quantized per 256 columns): the hi and lo products accumulate in the mma's int32 registers over the
// eight 32-column blocks of each super-block (Q2_K's scale is one d per 256 columns once its 4-bit multipliers are in
// the codes; |sum| <= 8 * 32 * 45 * 127, far from overflow), and the float epilogue runs once per super-block:
//   y += (d xs) (254 H + L)  -  sum over blocks of (min0 sum16_0 + min1 sum16_1)
// where the per-32 form pays I2FP, FMUL and FFMA for every block. Prefill then rounds the routed experts' down-projection
// input per 256 columns instead of decode's 32 (DS4_GPU_MMQ_S256, prepared in v13).

// A stage in shared memory: the weights' decoded part and the activations' part (both 16-byte multiples). Two of
// each (double-buffered), or with ONEW one weights' part (mmq_kernel: decoded after a barrier).
struct MmqWStage {
  int8_t w[MQ_M][MQ_LD];
  float ds[MQ_M][MQ_NB];      // dscale per (weight row, block)
  float mn[MQ_M][2 * MQ_NB];  // min0, min1 per (weight row, block): K-quants
};
template <int NT>
struct MmqXStage {
  int8_t hi[NT][MQ_LD];
  int8_t lo[NT][MQ_LD];
  float xs[NT][MQ_NB];        // activation scale per (row, block)
  float s16[NT][2 * MQ_NB];   // activation sums per 16 columns: K-quants
};
template <int NT, bool ONEW>
__host__ __device__ constexpr size_t mq_stage_bytes() { return (ONEW ? 1 : 2) * sizeof(MmqWStage) + 2 * sizeof(MmqXStage<NT>); }

template <int QT>
__host__ __device__ constexpr bool has_mins() { return QT == QT_Q2_K || QT == QT_Q4_K; }




// This CTA's tile: activation rows a0 .. a0 + an - 1, weight rows wrow0 + r0 .., activation columns xcol0 ..,
// output columns ycol0 + r0 ..
struct MmqTile {
  int64_t a0, wrow0, xcol0, ycol0;
  int an, r0;
  int an_mma;  // activation rows the products cover: an, or NT with DS4_GPU_MMQ_SKIP=0 (the v12 kernel, an A/B)
};

template <int NT>
__device__ __forceinline__ MmqTile mmq_tile(const MmqArgs& a) {
  MmqTile t;
  t.r0 = blockIdx.x * MQ_M;
  if (a.tiles) {
    const int4 e = a.tiles[blockIdx.y];
    t.a0 = e.x;
    t.an = min(e.y, NT);  // a longer tile would overrun the shared planes: its extra rows are not computed
    t.wrow0 = (int64_t)e.z * a.rows_g;
    t.xcol0 = 0;
    t.ycol0 = 0;
  } else {
    const int g = blockIdx.z;
    t.a0 = (int64_t)blockIdx.y * NT;
    t.an = min(NT, a.T - (int)t.a0);
    t.wrow0 = (int64_t)g * a.rows_g;
    t.xcol0 = (int64_t)g * a.K;
    t.ycol0 = (int64_t)g * a.rows_g;
  }
  t.an_mma = a.skip_rows ? t.an : NT;
  return t;
}

// Activation planes of stage k0 into st (cp.async; rows past the tile are zero-filled, so they add nothing); X8: hi only.
template <int QT, int NT, bool X8 = false>
__device__ __forceinline__ void mmq_load_x(const MmqArgs& a, const MmqTile& tl, int k0, MmqXStage<NT>& st) {
  const int tid = threadIdx.x;
  const int64_t col = tl.xcol0 + k0;
  for (int i = tid; i < NT * (MQ_KS / 16); i += mq_threads<NT>()) {
    const int t = i >> 3, c = (i & 7) * 16;
    const bool ok = t < tl.an;
    const int64_t r = tl.a0 + (ok ? t : 0);
    const int64_t off = (a.x_rows ? __ldg(a.x_rows + r) : r) * a.x.n + col + c;
    cp16(&st.hi[t][c], a.x.hi + off, ok);
    if constexpr (!X8) cp16(&st.lo[t][c], a.x.lo + off, ok);
  }
  if (tid < NT) {
    const bool ok = tid < tl.an;
    const int64_t r = tl.a0 + (ok ? tid : 0), row = a.x_rows ? __ldg(a.x_rows + r) : r;
    cp16(&st.xs[tid][0], a.x.scale + row * (a.x.n / 32) + col / 32, ok);
    if constexpr (has_mins<QT>()) {
      cp16(&st.s16[tid][0], a.x.sum16 + row * (a.x.n / 16) + col / 16, ok);
      cp16(&st.s16[tid][4], a.x.sum16 + row * (a.x.n / 16) + col / 16 + 4, ok);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// XP ($DS4_GPU_MMQ_XPTR, v29, prepared): this thread's activation rows found once per CTA, not per stage. A thread
// loads rows (tid / 8) + 16 j (j < NT / 16) at columns 16 (tid % 8) of every stage, and, for tid < NT, the scales of
// row tid. mmq_load_x recomputed each row's offset per stage, the routed experts' row table read again (LDG) and
// 64-bit multiplies: 97 instructions for its 8 cp.async at NT = 64 (SASS, v29), of ~1470 in a Q2_K stage. Offsets are
// 32-bit element offsets into the planes (mmq's launch checks rows x n < 2^31).
template <int NT>
struct MmqXRows {
  static constexpr int J = NT * (MQ_KS / 16) / mq_threads<NT>();  // rows per thread: NT / 16
  int off[J];     // x row times x.n, plus the tile's first column and this thread's 16 (tid % 8)
  uint32_t ok;    // bit j: row j is inside the tile (else zero-filled)
  int soff;       // tid < NT: the row's offset in the scale plane, x row times x.n / 32 plus the tile's column / 32
  int s16off;     // the same in the K-quants' sums plane (x.n / 16 per row)
  bool sok;
};

template <int NT>
__device__ __forceinline__ MmqXRows<NT> mmq_x_rows(const MmqArgs& a, const MmqTile& tl) {
  MmqXRows<NT> xr;
  const int tid = threadIdx.x, c = (tid & 7) * 16;
  xr.ok = 0;
#pragma unroll
  for (int j = 0; j < MmqXRows<NT>::J; ++j) {
    const int t = (tid >> 3) + 16 * j;
    const bool ok = t < tl.an;
    const int64_t r = tl.a0 + (ok ? t : 0), row = a.x_rows ? __ldg(a.x_rows + r) : r;
    xr.off[j] = (int)(row * a.x.n + tl.xcol0 + c);
    xr.ok |= (uint32_t)ok << j;
  }
  xr.sok = tid < tl.an;
  const int64_t r = tl.a0 + (xr.sok ? tid : 0), row = tid < NT ? (a.x_rows ? __ldg(a.x_rows + r) : r) : 0;
  xr.soff = (int)(row * (a.x.n / 32) + tl.xcol0 / 32);
  xr.s16off = (int)(row * (a.x.n / 16) + tl.xcol0 / 16);
  return xr;
}

// mmq_load_x's loads from the rows found by mmq_x_rows (the same bytes to the same places).
template <int QT, int NT, bool X8 = false>
__device__ __forceinline__ void mmq_load_x_rows(const MmqArgs& a, const MmqXRows<NT>& xr, int k0, MmqXStage<NT>& st) {
  const int tid = threadIdx.x, t0 = tid >> 3, c = (tid & 7) * 16;
#pragma unroll
  for (int j = 0; j < MmqXRows<NT>::J; ++j) {
    const bool ok = (xr.ok >> j) & 1u;
    const unsigned o = (unsigned)(xr.off[j] + k0);
    cp16(&st.hi[t0 + 16 * j][c], a.x.hi + o, ok);
    if constexpr (!X8) cp16(&st.lo[t0 + 16 * j][c], a.x.lo + o, ok);
  }
  if (tid < NT) {
    cp16(&st.xs[tid][0], a.x.scale + (unsigned)(xr.soff + k0 / 32), xr.sok);
    if constexpr (has_mins<QT>()) {
      const unsigned o = (unsigned)(xr.s16off + k0 / 16);
      cp16(&st.s16[tid][0], a.x.sum16 + o, xr.sok);
      cp16(&st.s16[tid][4], a.x.sum16 + o + 4, xr.sok);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Raw blocks of this thread's (weight row, block) pairs of stage k0: pair p = tid + threads i, row p / 4, block p % 4.
template <int QT, int NT>
__device__ __forceinline__ void mmq_load_w(const MmqArgs& a, const MmqTile& tl, int k0, RawXb (&raw)[mq_pairs<NT>()]) {
#pragma unroll
  for (int i = 0; i < mq_pairs<NT>(); ++i) {
    const int p = threadIdx.x + mq_threads<NT>() * i, row = p >> 2, b = p & 3;
    const int64_t wr = tl.wrow0 + min(tl.r0 + row, a.rows_g - 1);  // rows past the matrix: any row, zeroed below
    load_xb<QT, false>(a.w.qs + wr * a.w.qs_row, a.w.sc + wr * a.w.sc_row, k0 / 32 + b, a.nb, raw[i]);
  }
}

// XP: this thread's weight rows' byte offsets in the codes' and scales' planes, found once per CTA (mmq_load_w
// recomputed the row, its clamp and two 64-bit products per pair and stage). 32-bit: mmq's launch takes XP only for
// planes under 4 GiB.
template <int NT>
struct MmqWRows {
  uint32_t q[mq_pairs<NT>()], s[mq_pairs<NT>()];
};

template <int NT>
__device__ __forceinline__ MmqWRows<NT> mmq_w_rows(const MmqArgs& a, const MmqTile& tl) {
  MmqWRows<NT> wr;
#pragma unroll
  for (int i = 0; i < mq_pairs<NT>(); ++i) {
    const int p = threadIdx.x + mq_threads<NT>() * i, row = p >> 2;
    const int64_t r = tl.wrow0 + min(tl.r0 + row, a.rows_g - 1);  // rows past the matrix: any row, zeroed on decode
    wr.q[i] = (uint32_t)(r * a.w.qs_row);
    wr.s[i] = (uint32_t)(r * a.w.sc_row);
  }
  return wr;
}

template <int QT, int NT>
__device__ __forceinline__ void mmq_load_w_rows(const MmqArgs& a, const MmqWRows<NT>& wr, int k0,
                                                RawXb (&raw)[mq_pairs<NT>()]) {
#pragma unroll
  for (int i = 0; i < mq_pairs<NT>(); ++i)
    load_xb<QT, false>(a.w.qs + wr.q[i], a.w.sc + wr.s[i], k0 / 32 + (threadIdx.x & 3), a.nb, raw[i]);
}

template <int QT, int NT>
__device__ __forceinline__ void mmq_decode_w(const MmqArgs& a, const MmqTile& tl, const RawXb (&raw)[mq_pairs<NT>()],
                                             const unsigned long long* grid, MmqWStage& st) {
#pragma unroll
  for (int i = 0; i < mq_pairs<NT>(); ++i) {
    const int p = threadIdx.x + mq_threads<NT>() * i, row = p >> 2, b = p & 3;
    XbCodes d;
    decode_xb<QT>(raw[i], Iq2Tables{grid}, d);
    const bool ok = tl.r0 + row < a.rows_g;
    uint32_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t v = d.c[j];
      if constexpr (QT == QT_Q2_K) v *= (uint32_t)(j < 4 ? d.mul0 : d.mul1);  // bytes <= 3 x 15: no carries
      c[j] = ok ? v : 0u;
    }
    *(uint4*)&st.w[row][32 * b] = make_uint4(c[0], c[1], c[2], c[3]);
    *(uint4*)&st.w[row][32 * b + 16] = make_uint4(c[4], c[5], c[6], c[7]);
    st.ds[row][b] = ok ? d.dscale : 0.0f;
    if constexpr (has_mins<QT>()) {
      st.mn[row][2 * b] = ok ? d.min0 : 0.0f;
      st.mn[row][2 * b + 1] = ok ? d.min1 : 0.0f;
    }
  }
}

// MMIN (mmq_min_mma()): the K-quants' min terms of a whole stage as TF32 tensor-core products, acc -= mn . s16 over
// the stage's 8 sub-blocks of 16 columns (A = -mn [weight rows, 8], B = s16 [8, activation rows]), each operand split
// hi + lo (split_tf32, ~21 bits; three m16n8k8 products per fragment: lo.hi, hi.lo, hi.hi). In place of two FFMAs
// per output element and 32-column block and the shared loads of both operands per block: the Q2_K down product's
// epilogue was 6 of its ~7 instructions per element and block. Not the bits of the per-block FFMAs (another order).
template <int NT, int NN>
__device__ __forceinline__ void mmq_min_products(const MmqWStage& W, const MmqXStage<NT>& S, int wm, int wn, int lane,
                                                 int an_mma, float (&acc)[2][NN][4]) {
  const int g = lane >> 2, q = lane & 3;
  uint32_t ah[2][4], al[2][4];  // A fragments (m16 x k8, tf32): (g, q), (g + 8, q), (g, q + 4), (g + 8, q + 4)
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const int r = wm + 16 * m + g;
    split_tf32(-W.mn[r][q], ah[m][0], al[m][0]);
    split_tf32(-W.mn[r + 8][q], ah[m][1], al[m][1]);
    split_tf32(-W.mn[r][q + 4], ah[m][2], al[m][2]);
    split_tf32(-W.mn[r + 8][q + 4], ah[m][3], al[m][3]);
  }
#pragma unroll
  for (int n = 0; n < NN; ++n) {
    if (wn + 8 * n >= an_mma) break;  // as the main products: fragments past the tile's rows are never stored
    const int t = wn + 8 * n + g;
    uint32_t bh[2], bl[2];  // B fragment (k8 x n8): (k = q, n = g), (k = q + 4, n = g)
    split_tf32(S.s16[t][q], bh[0], bl[0]);
    split_tf32(S.s16[t][q + 4], bh[1], bl[1]);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      mma_tf32(acc[m][n], al[m], bh);
      mma_tf32(acc[m][n], ah[m], bl);
      mma_tf32(acc[m][n], ah[m], bh);
    }
  }
}

// CTAs per SM: K-quants and 128-row tiles (twice the accumulators) need more registers. ONEW (one weights' buffer: 54
// KB of shared memory at NT = 64, 56 with IQ2_XXS's grid table): 4, which caps registers at 128 (the MMIN form needs
// 120; IQ2_XXS's straight form 168, so 20 bytes spill there).
template <int QT, int NT, bool ONEW = false>
__host__ __device__ constexpr int mq_min_ctas() { return ONEW ? 4 : NT == 128 || has_mins<QT>() ? 2 : 3; }

// X8 (moe_x8(): the routed experts' 8-bit activations): the lo plane is neither loaded nor multiplied, one mma per
// fragment instead of two, and the 254 is folded into the activation scale (I2FP of the hi sum, which is exact: |sum|
// <= 32 x 127 x 45 < 2^24), so the per-element epilogue is FMUL, I2FP, FFMA. Within float rounding of the full form on
// planes whose lo is zero (not bitwise: 254 hi is rounded to float there before the scale multiplies).
//
// ONEW: one buffer for the decoded weights (the activations stay double-buffered): the next stage is decoded after a
// barrier that ends this stage's products, so a CTA needs ~20% less shared memory and four fit an SM (16 warps).
// PAIRS ($DS4_GPU_MMQ_PAIRS, the K-quants): the partial form's fragments in pairs, one tile-rows test per pair.
// XROW ($DS4_GPU_MMQ_XROW; IQ2_XXS, the routed gate and up; with mode 3 also the MMIN Q2_K down): the activations
// quantized with one scale per row (quantize_x group 0), so the per-block epilogue is IMAD, I2FP, FFMA by the
// weight's block scale alone (no FMUL of the two scales) and the row's scale multiplies each sum once, at the store.
// The K-quants' min terms (MMIN) then take the 16-column sums in units of that scale (quantize_x's sums_per_scale).
template <int QT, int NT, bool S256 = false, bool X8 = false, bool MMIN = false, bool ONEW = false, bool XP = false,
          bool PAIRS = false, bool XROW = false>
__global__ void __launch_bounds__(mq_threads<NT>(), mq_min_ctas<QT, NT, ONEW>()) mmq_kernel(MmqArgs a) {
  static_assert(!S256 || QT == QT_Q2_K, "the S256 form is for Q2_K");
  static_assert(!MMIN || (has_mins<QT>() && !S256), "MMIN: the K-quants' per-32-column form");
  static_assert(!PAIRS || (NT / 16) % 2 == 0, "PAIRS: an even number of fragments per warp");
  static_assert(!XROW || ((QT == QT_IQ2_XXS || (QT == QT_Q2_K && MMIN)) && !X8 && !S256),
                "XROW: IQ2_XXS or the MMIN Q2_K form, on 16-bit activations");
  constexpr bool BLOCK_MINS = has_mins<QT>() && !MMIN;  // the min terms per block in the epilogue (FFMAs)
  extern __shared__ __align__(16) unsigned char mq_smem[];
  static_assert(!ONEW || MMIN || QT == QT_IQ2_XXS, "ONEW: the MMIN form (118 registers) or IQ2_XXS (128, spills)");
  MmqWStage* stw = reinterpret_cast<MmqWStage*>(mq_smem);
  MmqXStage<NT>* stx = reinterpret_cast<MmqXStage<NT>*>(mq_smem + (ONEW ? 1 : 2) * sizeof(MmqWStage));
  unsigned long long* grid = reinterpret_cast<unsigned long long*>(mq_smem + mq_stage_bytes<NT, ONEW>());
  const MmqTile tl = mmq_tile<NT>(a);
  if (tl.an <= 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  static_assert(offsetof(MmqXStage<NT>, lo) == NT * MQ_LD, "XP: the lo plane follows the hi plane");
  const int wm = (warp & 1) * 32, wn = (warp >> 1) * (NT / 2);  // this warp's weight rows and activation rows in the tile
  // XP: this lane's B fragment row (activation row wn + lane % 8 of the hi plane, or of lo for lanes 16-31)
  const int x_lane = ((lane & 16) ? NT * MQ_LD : 0) + (wn + (lane & 7)) * MQ_LD + 16 * ((lane >> 3) & 1);
  constexpr int NN = NT / 16;  // n8 fragments per warp: a warp's activation rows over 8
  if constexpr (QT == QT_IQ2_XXS) iq2_tables_init(grid);
  float acc[2][NN][4];
  int ih[S256 ? 2 : 1][S256 ? NN : 1][4], il[S256 ? 2 : 1][S256 ? NN : 1][4];  // S256: the super-block's int32 sums
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < NN; ++n) {
      acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
      if constexpr (S256)
#pragma unroll
        for (int e = 0; e < 4; ++e) ih[m][n][e] = il[m][n][e] = 0;
    }
  const int nstages = a.K / MQ_KS;
  // all of this warp's fragments hold tile rows (uniform per warp). Not for the K-quants: their straight form needs 202
  // registers (2 CTAs per SM), or 168 with spills, against v13's 136 (the Q2_K expert down measured 8.3 -> 9.4 ms per
  // 8192-token layer that way, v14 call 3)
  const bool full_n = !has_mins<QT>() && a.straight && wn + NT / 2 <= tl.an_mma;
  RawXb raw[mq_pairs<NT>()];
  MmqXRows<NT> xr;
  MmqWRows<NT> wr;
  if constexpr (XP) {
    xr = mmq_x_rows<NT>(a, tl);
    wr = mmq_w_rows<NT>(a, tl);
    mmq_load_x_rows<QT, NT, X8>(a, xr, 0, stx[0]);
    mmq_load_w_rows<QT, NT>(a, wr, 0, raw);
  } else {
    mmq_load_x<QT, NT, X8>(a, tl, 0, stx[0]);
    mmq_load_w<QT, NT>(a, tl, 0, raw);
  }
  if constexpr (QT == QT_IQ2_XXS) __syncthreads();  // the grid table
  mmq_decode_w<QT, NT>(a, tl, raw, grid, stw[0]);
  for (int s = 0; s < nstages; ++s) {
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // stage s is in shared memory; every warp is done with stage s - 1 (the other buffer)
    const bool next = s + 1 < nstages;
    if (next) {
      if constexpr (XP) {
        mmq_load_x_rows<QT, NT, X8>(a, xr, (s + 1) * MQ_KS, stx[(s + 1) & 1]);
        mmq_load_w_rows<QT, NT>(a, wr, (s + 1) * MQ_KS, raw);
      } else {
        mmq_load_x<QT, NT, X8>(a, tl, (s + 1) * MQ_KS, stx[(s + 1) & 1]);
        mmq_load_w<QT, NT>(a, tl, (s + 1) * MQ_KS, raw);
      }
    }
    const MmqXStage<NT>& S = stx[s & 1];
    const MmqWStage& W = stw[ONEW ? 0 : s & 1];
#pragma unroll
    for (int b = 0; b < MQ_NB; ++b) {
      uint32_t af[2][4];
      float wd[2][2], m0[2][2], m1[2][2];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int r = wm + 16 * m + g;
        ldsm_x4(af[m], &W.w[wm + 16 * m + (lane & 15)][32 * b + 16 * (lane >> 4)]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wd[m][h] = W.ds[r + 8 * h][b];
          if constexpr (BLOCK_MINS) {
            m0[m][h] = W.mn[r + 8 * h][2 * b];
            m1[m][h] = W.mn[r + 8 * h][2 * b + 1];
          }
        }
      }
      // One n8 fragment of activation rows: its products and their epilogue.
      auto frag = [&](const int n) {
        const int tc = wn + 8 * n + 2 * q;
        // hi k 0-15, hi k 16-31, lo k 0-15, lo k 16-31 of activation rows wn + 8n .. + 7
        uint32_t bf[4];
        const int tr = wn + 8 * n + (lane & 7), kb = 32 * b + 16 * ((lane >> 3) & 1);
        if constexpr (X8) {
          uint32_t b2[2];
          ldsm_x2(b2, &S.hi[tr][kb]);
          bf[0] = b2[0], bf[1] = b2[1], bf[2] = bf[3] = 0u;
        } else if constexpr (XP) {
          // lanes 16-31 read the lo plane, which follows hi (the kernel's static_assert): a per-lane offset fixed for the
          // kernel, so the address is one register plus immediates, not two sums and a select per fragment
          ldsm_x4(bf, &S.hi[0][0] + x_lane + 8 * n * MQ_LD + 32 * b);
        } else {
          ldsm_x4(bf, (lane & 16) ? &S.lo[tr][kb] : &S.hi[tr][kb]);
        }
        float xs[2] = {1.0f, 1.0f}, s0[2] = {0.0f, 0.0f}, s1[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if constexpr (!XROW) xs[j] = X8 && !S256 ? 254.0f * S.xs[tc + j][b] : S.xs[tc + j][b];
          if constexpr (BLOCK_MINS) {
            s0[j] = S.s16[tc + j][2 * b];
            s1[j] = S.s16[tc + j][2 * b + 1];
          }
        }
        if constexpr (S256) {
          // the last block of a super-block: stage s covers columns 128 s .., so odd stages end one
          const bool flush = b == MQ_NB - 1 && (s & 1);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            mma_s8_acc(ih[m][n], af[m], bf[0], bf[1]);
            if constexpr (!X8) mma_s8_acc(il[m][n], af[m], bf[2], bf[3]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int h = e >> 1, j = e & 1;
              float& y = acc[m][n][e];
              y = fmaf(-m1[m][h], s1[j], fmaf(-m0[m][h], s0[j], y));
              if (flush) {
                y = fmaf(wd[m][h] * xs[j], fmaf(254.0f, (float)ih[m][n][e], (float)il[m][n][e]), y);
                ih[m][n][e] = il[m][n][e] = 0;
              }
            }
          }
        } else {
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            int ch[4], cl[4] = {0, 0, 0, 0};
            mma_s8(ch, af[m], bf[0], bf[1]);
            if constexpr (!X8) mma_s8(cl, af[m], bf[2], bf[3]);
            // C: c0 (weight row g, activation row 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int h = e >> 1, j = e & 1;
              // the batch-1 kernels' arithmetic: the exact int32 254 hi + lo, one rounding to float (I2FP: full rate)
              float& y = acc[m][n][e];
              if constexpr (X8) y = fmaf(wd[m][h] * xs[j], (float)ch[e], y);  // xs[j] holds 254 xs here
              else if constexpr (XROW) y = fmaf(wd[m][h], (float)(254 * ch[e] + cl[e]), y);  // xs at the store
              else y = fmaf(wd[m][h] * xs[j], (float)(254 * ch[e] + cl[e]), y);
              if constexpr (BLOCK_MINS) y = fmaf(-m1[m][h], s1[j], fmaf(-m0[m][h], s0[j], y));
            }
          }
        }
      };
      if (full_n) {
        // every fragment of the warp holds tile rows: no test between fragments, so the compiler can start the next
        // fragment's products under this one's epilogue (v13's per-fragment test put a branch and a WARPSYNC there)
#pragma unroll
        for (int n = 0; n < NN; ++n) frag(n);
      } else if constexpr (PAIRS) {
        // the fragments two at a time, one test per pair: between two tests the code is straight, so the compiler can
        // load the second fragment's operands and start its products under the first one's epilogue (v30's ncu of the
        // Q2_K down: its IMMA wait on their ldmatrix, short scoreboard 1.30 cycles per instruction against the straight
        // IQ2_XXS gate's 0.65). A pair's second fragment may lie past the tile: computed, never stored
#pragma unroll
        for (int n = 0; n < NN; n += 2) {
          if (wn + 8 * n >= tl.an_mma) break;
          frag(n);
          frag(n + 1);
        }
      } else {
#pragma unroll
        for (int n = 0; n < NN; ++n) {
          // activation rows past the tile (an expert's last, partial tile): their products are never stored, so the
          // warp skips the fragment (uniform per warp; the kernel is issue-bound, so the SM's other warps gain)
          if (wn + 8 * n >= tl.an_mma) break;
          frag(n);
        }
      }
    }
    if constexpr (MMIN) mmq_min_products<NT, NN>(W, S, wm, wn, lane, tl.an_mma, acc);
    if constexpr (ONEW) {
      if (next) {
        __syncthreads();  // every warp is done with this stage's weights
        mmq_decode_w<QT, NT>(a, tl, raw, grid, stw[0]);
      }
    } else if (next) {
      mmq_decode_w<QT, NT>(a, tl, raw, grid, stw[(s + 1) & 1]);  // its last reader was stage s - 1
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < NN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = tl.r0 + wm + 16 * m + g + 8 * (e >> 1), t = wn + 8 * n + 2 * q + (e & 1);
        // XROW: the row's scale from the last stage's planes (every block of a row holds it; nothing overwrote them)
        const float v = XROW ? acc[m][n][e] * stx[(nstages - 1) & 1].xs[t][0] : acc[m][n][e];
        if (r < a.rows_g && t < tl.an) a.y[(tl.a0 + t) * a.ldy + tl.ycol0 + r] = v;
      }
}

template <int QT, int NT, bool S256 = false, bool X8 = false, bool MMIN = false, bool ONEW = false, bool XP = false,
          bool PAIRS = false, bool XROW = false>
void launch_as(const MmqArgs& a, dim3 grid, cudaStream_t stream) {
  const size_t shm = mq_stage_bytes<NT, ONEW>() + (QT == QT_IQ2_XXS ? 256 * sizeof(unsigned long long) : 0);
  static bool shm_set = false;
  if (!shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(mmq_kernel<QT, NT, S256, X8, MMIN, ONEW, XP, PAIRS, XROW>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = true;
  }
  mmq_kernel<QT, NT, S256, X8, MMIN, ONEW, XP, PAIRS, XROW><<<grid, mq_threads<NT>(), shm, stream>>>(a);
}

// $DS4_GPU_MMQ_MINMMA (v27, default 2): 1 the K-quants' min terms on the TF32 tensor cores (MMIN); 2 also one
// weights' buffer and four CTAs per SM (ONEW, at 64-row tiles); 0 the per-block FFMAs (v26). set_mmq_min_mma
// overrides it (0-2; -1 the environment).
static EnvSwitch mmq_min_mma_switch{"DS4_GPU_MMQ_MINMMA", 2, 2};
// $DS4_GPU_MMQ_FOUR (v27, default 1): 1 the IQ2_XXS products (the routed gate and up) with one weights' buffer and four
// CTAs per SM at 64-row tiles (ONEW; 128 registers, 20 bytes of spills); 0 three CTAs, double-buffered weights (v26).
// The same bits. set_mmq_four overrides it (0, 1; -1 the environment).
static EnvSwitch mmq_four_switch{"DS4_GPU_MMQ_FOUR", 1, 1};

// $DS4_GPU_MMQ_XPTR (v29; default 1 since v30): 1 the four-CTA forms (ONEW: the default Q2_K,
// Q4_K and IQ2_XXS kernels) find their activation and weight rows once per CTA (XP: mmq_x_rows, mmq_w_rows) instead
// of per stage, and the B fragments' shared addresses from one per-lane offset (x_lane). SASS per 128-column stage and
// warp: Q2_K 1475 -> 1070 instructions (64 IMMA; 120 -> 128 registers), IQ2_XXS ~1420 -> ~1070 (its loop holds the
// straight and the tested fragment forms, one of which runs; the spills, 20 bytes in the loop, now 8 outside it). If
// mmq is issue-bound (v11's ncu; ~80% issue-busy at v28's 6.31 ms per gate launch by this count), up to ~25% off its
// ~860 ms per 8192-token prefill. Measured (v30, bench_mmq --experts): the gate 6.31 -> 5.51 ms, the down 7.69 ->
// 7.77 (not issue-bound: ncu puts it on fixed-latency and shared-load waits at 4 warps per scheduler); an 8192-token
// prefill 4728 -> 4852 t/s. The same bits. set_mmq_xptr overrides it (0, 1; -1 the environment).
static EnvSwitch mmq_xptr_switch{"DS4_GPU_MMQ_XPTR", 1, 1};
// $DS4_GPU_MMQ_PAIRS (v30; default 1): 1 the K-quants' four-CTA row-pointer forms (XP; the routed Q2_K down) take the
// tile's fragments in pairs, one tile-rows test per pair instead of per fragment (PAIRS). SASS of the Q2_K down's stage
// loop: 1060 instructions against 1070, the median IMMA 14 instructions after the ldmatrix of its operand against 5,
// 127 registers and 16 bytes reloaded from the stack per stage. Measured (bench_mmq --experts, v30 call 8): the down
// 7.69 -> 7.49 ms; IQ2_XXS's gate went 5.47 -> 5.60 that way (its partial tiles' warps), so IQ2_XXS keeps one
// fragment at a time. The same bits. set_mmq_pairs overrides it (0, 1; -1 the environment).
static EnvSwitch mmq_pairs_switch{"DS4_GPU_MMQ_PAIRS", 1, 1};
// $DS4_GPU_MMQ_XROW (v44): 1 the routed gate and up (IQ2_XXS) on activations quantized with one scale per row
// (mmq_experts quantizes them with group 0), multiplied by the XROW kernel: per element and 32-column block IMAD,
// I2FP, FFMA instead of IMAD, I2FP, FMUL, FFMA (the loop's 128 FMUL of ~1070 dynamic instructions per stage); 3 also
// the Q2_K down (its SwiGLU source quantized per row, the min terms' sums in units of the row's scale); 2 the row
// planes through the per-block kernels (the tests' reference: the same sums to float rounding); 0 decode's 32-column
// scales. Measured (v44, H100, Flash's first 20 layers): bench_mmq --experts at 6144 tokens, the gate 4.35 -> 3.84 ms
// and the down 6.05 -> 5.68; ds4-bench's 2048 -> 8192 row 10389 / 10347 -> 10831 / 10597 t/s (+3.3%); the default 3.
// mmq_xrow_mode() reads it; set_mmq_xrow overrides it (0-3; -1 the environment).
static EnvSwitch mmq_xrow_switch{"DS4_GPU_MMQ_XROW", 3, 3};

// The PAIRS forms exist for the K-quants' four-CTA tiles only (NT = 64: ONEW); other NT never call this.
template <int QT, int NT, bool X8, bool MMIN>
void launch_pairs(const MmqArgs& a, dim3 grid, cudaStream_t stream) {
  if constexpr (NT == 64) launch_as<QT, NT, false, X8, MMIN, true, true, true>(a, grid, stream);
}

template <int NT, bool X8>
void launch_nt(const MmqArgs& a, int qtype, dim3 grid, cudaStream_t stream, bool s256) {
  const int mmin = mmq_min_mma_switch.get();
  // XP's 32-bit offsets: activation planes of fewer than 2^31 elements (far more than a prefill chunk's) and weight
  // planes under 4 GiB, else the per-stage form
  const bool xp = mmq_xptr_switch.get() != 0 && a.x.rows > 0 && a.x.rows * a.x.n < (int64_t{1} << 31) &&
                  a.w.nrows * a.w.qs_row < (int64_t{1} << 32) && a.w.nrows * a.w.sc_row < (int64_t{1} << 32);
  const bool pairs = xp && mmq_pairs_switch.get() != 0;
  switch (qtype) {
    case QT_Q8_0: launch_as<QT_Q8_0, NT, false, X8>(a, grid, stream); break;
    case QT_Q2_K:
      if (a.x.row_scale) {  // the sums in units of the row's scale: only the XROW form reads them right
        if (!(mmin == 2 && NT == 64 && pairs && !X8 && !s256)) throw std::logic_error("mmq: row-scale planes, no XROW form");
        if constexpr (NT == 64) launch_as<QT_Q2_K, NT, false, false, true, true, true, true, true>(a, grid, stream);
      } else if (s256) launch_as<QT_Q2_K, NT, true, X8>(a, grid, stream);
      else if (mmin == 2 && NT == 64 && pairs) launch_pairs<QT_Q2_K, NT, X8, true>(a, grid, stream);
      else if (mmin == 2 && NT == 64 && xp) launch_as<QT_Q2_K, NT, false, X8, true, true, true>(a, grid, stream);
      else if (mmin == 2 && NT == 64) launch_as<QT_Q2_K, NT, false, X8, true, true>(a, grid, stream);
      else if (mmin) launch_as<QT_Q2_K, NT, false, X8, true>(a, grid, stream);
      else launch_as<QT_Q2_K, NT, false, X8>(a, grid, stream);
      break;
    case QT_Q4_K:
      if (mmin == 2 && NT == 64 && pairs) launch_pairs<QT_Q4_K, NT, X8, true>(a, grid, stream);
      else if (mmin == 2 && NT == 64 && xp) launch_as<QT_Q4_K, NT, false, X8, true, true, true>(a, grid, stream);
      else if (mmin == 2 && NT == 64) launch_as<QT_Q4_K, NT, false, X8, true, true>(a, grid, stream);
      else if (mmin) launch_as<QT_Q4_K, NT, false, X8, true>(a, grid, stream);
      else launch_as<QT_Q4_K, NT, false, X8>(a, grid, stream);
      break;
    case QT_IQ2_XXS:
      if (a.x.row_scale) {  // mmq_xrow_plan chose the planes for this form
        if (!(NT == 64 && mmq_four_switch.get() && xp && !X8)) throw std::logic_error("mmq: row-scale planes, no XROW form");
        if constexpr (NT == 64) launch_as<QT_IQ2_XXS, NT, false, false, false, true, true, false, true>(a, grid, stream);
      } else if (NT == 64 && mmq_four_switch.get() && xp)
        launch_as<QT_IQ2_XXS, NT, false, X8, false, true, true>(a, grid, stream);
      else if (NT == 64 && mmq_four_switch.get()) launch_as<QT_IQ2_XXS, NT, false, X8, false, true>(a, grid, stream);
      else launch_as<QT_IQ2_XXS, NT, false, X8>(a, grid, stream);
      break;
    default: throw std::invalid_argument("mmq: unsupported weight type " + std::to_string(qtype));
  }
}

// x8: 8-bit activations (the routed experts under moe_x8()).
void launch(const MmqArgs& a, int qtype, dim3 grid, cudaStream_t stream, bool s256 = false, bool x8 = false) {
  if (s256 && qtype != QT_Q2_K) throw std::invalid_argument("mmq: the S256 form is for Q2_K weights");
  const bool big = mmq_tile_rows() == 128;
  if (x8) big ? launch_nt<128, true>(a, qtype, grid, stream, s256) : launch_nt<64, true>(a, qtype, grid, stream, s256);
  else big ? launch_nt<128, false>(a, qtype, grid, stream, s256) : launch_nt<64, false>(a, qtype, grid, stream, s256);
  DS4_CHECK_LAUNCH("mmq");
}

// $DS4_GPU_MMQ_SKIP (default 1): a partial tile's warps skip their products past its rows (v13); 0: every tile
// multiplies all NT rows (v12). The same bits either way (those rows are never stored); read once, an A/B switch.
bool mmq_skip_rows() {
  static const bool v = [] {
    const char* e = std::getenv("DS4_GPU_MMQ_SKIP");
    return !(e && *e && std::atoi(e) == 0);
  }();
  return v;
}

// $DS4_GPU_MMQ_STRAIGHT (default 1): a warp whose fragments all hold tile rows runs them without the per-fragment test
// (v14); 0: the test before every fragment (v13). The same bits; read once, an A/B switch.
// set_mmq_straight (0 or 1; -1: the environment again) overrides it for the launches that follow (the tests' A/B).
int& mmq_straight_override() {
  static int v = -1;
  return v;
}
bool mmq_straight() {
  static const bool v = [] {
    const char* e = std::getenv("DS4_GPU_MMQ_STRAIGHT");
    return !(e && *e && std::atoi(e) == 0);
  }();
  return mmq_straight_override() >= 0 ? mmq_straight_override() != 0 : v;
}

MmqArgs make_args(const Packed& w, const XQ& x, float* y, int64_t ldy, int T, int rows_g) {
  MmqArgs a;
  a.w = w;
  a.K = (int)w.ncols;
  a.nb = (int)(w.ncols / 256);
  a.x = x;
  a.y = y;
  a.ldy = ldy;
  a.T = T;
  a.rows_g = rows_g;
  a.tiles = nullptr;
  a.x_rows = nullptr;
  a.skip_rows = mmq_skip_rows() ? 1 : 0;
  a.straight = mmq_straight() ? 1 : 0;
  return a;
}

}  // namespace

void set_mmq_straight(int v) { mmq_straight_override() = v < 0 ? -1 : (v != 0); }
void set_mmq_min_mma(int mode) { mmq_min_mma_switch.set(mode); }
void set_mmq_four(int mode) { mmq_four_switch.set(mode); }
void set_mmq_xptr(int mode) { mmq_xptr_switch.set(mode); }
void set_mmq_pairs(int mode) { mmq_pairs_switch.set(mode); }
void set_mmq_xrow(int mode) { mmq_xrow_switch.set(mode); }
int mmq_xrow_mode() { return mmq_xrow_switch.get(); }

XrowPlan mmq_xrow_plan(const Packed& w, int64_t rows, int64_t n, bool swiglu_source, bool x8) {
  const int mode = mmq_xrow_switch.get();
  const bool iq2 = w.qtype == QT_IQ2_XXS && !swiglu_source && (mode == 1 || mode == 3);
  const bool q2k = w.qtype == QT_Q2_K && swiglu_source && mode == 3;
  const bool shape = quantize_x_row_takes(n) && rows > 0 && rows * n < (int64_t{1} << 31) && !x8 &&
                     mmq_tile_rows() == 64 && mmq_xptr_switch.get() != 0 && w.nrows * w.qs_row < (int64_t{1} << 32) &&
                     w.nrows * w.sc_row < (int64_t{1} << 32);
  XrowPlan p;
  if (!shape) return p;
  if ((iq2 && mmq_four_switch.get()) || (q2k && mmq_min_mma_switch.get() == 2 && mmq_pairs_switch.get())) {
    p.row_planes = p.xrow_kernel = true;
  } else if (mode == 2 && (w.qtype == QT_IQ2_XXS || w.qtype == QT_Q2_K)) {
    p.row_planes = true;  // the per-block kernels on the same planes (their sums as they are)
  }
  return p;
}

int mmq_tile_rows() {
  static const int rows = [] {
    const char* v = std::getenv("DS4_GPU_MMQ_ROWS");
    if (!v || !*v) return 64;
    const int r = std::atoi(v);
    if (r != 64 && r != 128) throw std::invalid_argument("DS4_GPU_MMQ_ROWS must be 64 or 128");
    return r;
  }();
  return rows;
}

bool mmq_takes(const Packed& w, int groups) {
  const bool type = w.qtype == QT_Q8_0 || w.qtype == QT_Q2_K || w.qtype == QT_Q4_K || w.qtype == QT_IQ2_XXS;
  return type && groups >= 1 && groups <= 65535 && w.nrows % groups == 0 && w.ncols % MQ_KS == 0;
}

void launch_mmq(const Packed& w, const XQ& x, int T, int groups, float* y, cudaStream_t stream) {
  if (!mmq_takes(w, groups)) throw std::invalid_argument("mmq: quantized weights with columns a multiple of 128 only");
  if (x.n != w.ncols * groups) throw std::invalid_argument("mmq: activation width is not groups x weight columns");
  if (T <= 0) return;
  const int rows_g = (int)(w.nrows / groups);
  const MmqArgs a = make_args(w, x, y, w.nrows, T, rows_g);
  const int nt = mmq_tile_rows();
  launch(a, w.qtype, dim3((rows_g + MQ_M - 1) / MQ_M, (T + nt - 1) / nt, groups), stream);
}

bool mmq_xrows_default() {
  static const bool v = [] {
    const char* e = std::getenv("DS4_GPU_MMQ_XROWS");
    return !(e && *e && std::atoi(e) == 0);
  }();
  return v;
}

bool mmq_s256_default() {
  static const bool v = [] {
    const char* e = std::getenv("DS4_GPU_MMQ_S256");
    return e && *e && std::atoi(e) != 0;
  }();
  return v;
}

// The routed experts' tile table on the device, so no host sync waits for the expert counts: counts [E] (int64, as
// torch.bincount gives them) of the activation rows sorted by expert -> tiles[i] = (first row, rows <= nt, expert, 0)
// in the order of moe_gemm.expert_tiles, then (0, 0, 0, 0) up to max_tiles: those CTAs exit at once (mmq_kernel's
// an <= 0). One block, one thread per expert; the two exclusive scans by warp shuffles.
__global__ void __launch_bounds__(1024) expert_tiles_kernel(const int64_t* counts, int E, int nt, int4* tiles,
                                                            int max_tiles) {
  __shared__ int s_rows[32], s_tiles[32];
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const int c = e < E ? (int)counts[e] : 0, n = (c + nt - 1) / nt;
  int rows = c, tl = n;  // inclusive scans within the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, rows, o), b = __shfl_up_sync(0xffffffffu, tl, o);
    if (lane >= o) rows += a, tl += b;
  }
  if (lane == 31) s_rows[warp] = rows, s_tiles[warp] = tl;
  __syncthreads();
  if (warp == 0) {  // the warps' totals, scanned
    int wr = lane < (int)(blockDim.x >> 5) ? s_rows[lane] : 0, wt = lane < (int)(blockDim.x >> 5) ? s_tiles[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, wr, o), b = __shfl_up_sync(0xffffffffu, wt, o);
      if (lane >= o) wr += a, wt += b;
    }
    s_rows[lane] = wr, s_tiles[lane] = wt;
  }
  __syncthreads();
  const int row0 = rows - c + (warp ? s_rows[warp - 1] : 0), tile0 = tl - n + (warp ? s_tiles[warp - 1] : 0);
  for (int j = 0; j < n && tile0 + j < max_tiles; ++j)
    tiles[tile0 + j] = make_int4(row0 + j * nt, min(nt, c - j * nt), e, 0);
  const int total = s_tiles[(blockDim.x >> 5) - 1];
  for (int i = total + threadIdx.x; i < max_tiles; i += blockDim.x) tiles[i] = make_int4(0, 0, 0, 0);
}

void launch_expert_tiles(const int64_t* counts, int E, int nt, int4* tiles, int max_tiles, cudaStream_t stream) {
  if (E < 1 || E > 1024) throw std::invalid_argument("expert_tiles: 1 .. 1024 experts");
  if (nt < 1 || max_tiles < 1) throw std::invalid_argument("expert_tiles: tile rows and max_tiles must be positive");
  expert_tiles_kernel<<<1, (E + 31) / 32 * 32, 0, stream>>>(counts, E, nt, tiles, max_tiles);
  DS4_CHECK_LAUNCH("expert_tiles");
}

void launch_mmq_experts(const Packed& w, int n_expert, const XQ& x, const int4* tiles, int ntiles, float* y,
                        cudaStream_t stream, bool s256, const int64_t* x_rows) {
  if (n_expert < 1 || !mmq_takes(w, n_expert)) throw std::invalid_argument("mmq_experts: unsupported expert tensor");
  if (x.n != w.ncols) throw std::invalid_argument("mmq_experts: activation width is not the experts' columns");
  if (ntiles <= 0) return;
  if (ntiles > 65535) throw std::invalid_argument("mmq_experts: more than 65535 activation tiles");
  const int rows_g = (int)(w.nrows / n_expert);
  MmqArgs a = make_args(w, x, y, rows_g, 0, rows_g);
  a.tiles = tiles;
  a.x_rows = x_rows;
  if (s256 && w.ncols % 256) throw std::invalid_argument("mmq_experts: S256 needs columns in whole 256-column blocks");
  launch(a, w.qtype, dim3((rows_g + MQ_M - 1) / MQ_M, ntiles, 1), stream, s256, moe_x8());
}

}  // namespace ds4gpu
