// The routed experts' prefill products on the float16 tensor cores, with the weights' codes as exact float16 integers:
// y[i, r] = W_e[r] . x[i] for activation rows sorted by expert (the tile table of mmq.cu).
//
// Why (NOTES.md v11): mmq.cu multiplies int8 codes by the activations' int8 hi/lo planes, and because both the weight
// and the activation scale change every 32 columns, each output element needs ~4 instructions per 32 columns: that
// kernel is issue-bound at ~18 instructions per mma. Here the per-32 and per-16 multipliers go into the codes
// instead, which stay exact in float16:
//   IQ2_XXS  w = d/8 (2s + 1) grid sign        codes (2s + 1) grid sign, |.| <= 31 x 43 = 1333
//   Q2_K     w = d sc q - dmin m               codes sc q <= 15 x 3 = 45
//   Q4_K     w = d sc q - dmin m               codes sc q <= 63 x 15 = 945
// (float16 holds every integer up to 2048), so one scale d per 256 columns (a super-block) remains: the epilogue is one
// FMA per output element per 256 columns. The activations are the exact path's float16 split (split_half: x / s =
// hi + lo, s the row's largest magnitude, ~22 bits), two mma.m16n8k16 per 16 columns with float32 accumulation.
// The K-quants' min terms, dmin sum_j m_j sum_{k in group j} x_k, are one more k16 product per super-block: the mins
// as float16 integers (16 groups of 16 columns for Q2_K; 8 of 32 and 8 zeros for Q4_K) against the activations' group
// sums (split like x; moe_gemm.py computes them).
//
// Tiles: a CTA computes 64 weight rows x 128 activation rows with 8 warps (2 x 4; 32 x 32 each: 2 m16 x 4 n8) over
// stages of 128 columns (half a super-block; 203 KB of shared memory, one CTA per SM), double-buffered: activation
// planes by cp.async, the weights' raw blocks through registers, decoded into shared memory as float16 while the
// previous stage multiplies. 128 activation rows per weight tile keep the decode at ~1 instruction per mma (with 64
// rows and 64-column stages the SASS loop had ~10 per mma). Shared rows are padded to 272 bytes, so every ldmatrix
// phase (8 rows x 16 bytes) hits 32 different banks. Per super-block (double-buffered too): d (and dmin), the min
// tile and the activation sums' tile.
// v11 on the H200: every kernel test passed (4e-6 from the f16 GEMM path, against mmq's 2e-5), but 1.34 ms for the
// 8192-row IQ2_XXS expert gate (mmq 1.12): the next stage's decode ran after the products, in every warp at once.
// v12 (written without a device): the decode within the products; the hi and lo products in separate
// accumulators (twice the independent mma per warp).
#include <cuda_fp16.h>

#include "common.cuh"
#include "mma_ops.cuh"
#include "mf_common.cuh"
#include "mv_core.cuh"

namespace ds4gpu {

namespace {

constexpr int MF_THREADS = 256;                           // 2 x 4 warps of 32 weight rows x 32 activation rows
constexpr int MF_M = 64;                                  // weight rows per CTA
constexpr int MF_N = 128;                                 // activation rows per CTA
constexpr int MF_KS = 128;                                // columns per stage: half a super-block
constexpr int MF_NB = MF_KS / 32;                         // 32-column blocks per stage
constexpr int MF_SPS = 256 / MF_KS;                       // stages per super-block
constexpr int MF_LD = MF_KS + 8;                          // halfs per shared row (272 bytes)
constexpr int MF_ML = 16 + 8;                             // halfs per row of the min tiles (48 bytes)
constexpr int MF_PAIRS = MF_M * MF_NB / MF_THREADS;      // (row, 32-column block) decodes per thread and stage

template <int QT>
__host__ __device__ constexpr bool mf_mins() { return QT == QT_Q2_K || QT == QT_Q4_K; }


struct MfStage {
  __half w[MF_M][MF_LD];
  __half xh[MF_N][MF_LD];
  __half xl[MF_N][MF_LD];
};

struct MfSuper {
  __half mw[MF_M][MF_ML];           // the mins as integers (K-quants)
  __half mh[MF_N][MF_ML], ml[MF_N][MF_ML];
  float d[MF_M], dmin[MF_M];
};




// Activation planes of stage k0 (and at a super-block's first stage, its group sums) by cp.async; rows past the
// tile are zero-filled, so they add nothing.
template <int QT>
__device__ __forceinline__ void mf_load_x(const MfArgs& a, const MfTile& tl, int k0, MfStage& st, MfSuper& sup) {
  const int tid = threadIdx.x;
  for (int i = tid; i < MF_N * (MF_KS / 8); i += MF_THREADS) {
    const int t = i / (MF_KS / 8), c = (i % (MF_KS / 8)) * 8;
    const bool ok = t < tl.an;
    const int64_t off = (tl.a0 + (ok ? t : 0)) * a.K + k0 + c;
    cp16(&st.xh[t][c], a.xh + off, ok);
    cp16(&st.xl[t][c], a.xl + off, ok);
  }
  if constexpr (mf_mins<QT>()) {
    if (k0 % 256 == 0 && tid < MF_N) {
      const bool ok = tid < tl.an;
      const int64_t off = ((tl.a0 + (ok ? tid : 0)) * a.nb + k0 / 256) * 16;
      cp16(&sup.mh[tid][0], a.mh + off, ok);
      cp16(&sup.mh[tid][8], a.mh + off + 8, ok);
      cp16(&sup.ml[tid][0], a.ml + off, ok);
      cp16(&sup.ml[tid][8], a.ml + off + 8, ok);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Raw blocks of this thread's (weight row, block) pairs of stage k0: pair p = tid + MF_THREADS i, row p / NB, block
// p % NB.
template <int QT>
__device__ __forceinline__ void mf_load_w(const MfArgs& a, const MfTile& tl, int k0, RawXb (&raw)[MF_PAIRS]) {
#pragma unroll
  for (int i = 0; i < MF_PAIRS; ++i) {
    const int p = threadIdx.x + MF_THREADS * i, row = p / MF_NB, b = p % MF_NB;
    const int64_t wr = tl.wrow0 + min(tl.r0 + row, a.rows_g - 1);  // rows past the matrix: any row, zeroed below
    load_xb<QT, false>(a.w.qs + wr * a.w.qs_row, a.w.sc + wr * a.w.sc_row, k0 / 32 + b, a.nb, raw[i]);
  }
}

// The pairs' codes as float16 integers into st, and at their super-block's first stage d, dmin; the mins into sup.
template <int QT>
__device__ __forceinline__ void mf_decode_w(const MfArgs& a, const MfTile& tl, int k0, const RawXb (&raw)[MF_PAIRS],
                                            const unsigned long long* grid, MfStage& st, MfSuper& sup) {
  const int part = (k0 / MF_KS) % MF_SPS;  // which stage of the super-block
#pragma unroll
  for (int i = 0; i < MF_PAIRS; ++i) {
    const int p = threadIdx.x + MF_THREADS * i, row = p / MF_NB, b = p % MF_NB, blk = MF_NB * part + b;
    const bool ok = tl.r0 + row < a.rows_g;
    XbCodes d;
    decode_xb<QT>(raw[i], Iq2Tables{grid}, d);
    float dsb = 0.0f, dmsb = 0.0f;
    __half2 m0, m1;
    if constexpr (QT == QT_IQ2_XXS) {
      m0 = m1 = __half2half2(__int2half_rn(2 * (int)(raw[i].q[1] >> 28) + 1));
      dsb = half_bits(raw[i].s0) * 0.125f;
    } else if constexpr (QT == QT_Q2_K) {
      m0 = __half2half2(__int2half_rn((int)(raw[i].s1 & 15)));
      m1 = __half2half2(__int2half_rn((int)((raw[i].s1 >> 8) & 15)));
      dsb = half_bits(raw[i].s0 & 0xffff);
      dmsb = half_bits(raw[i].s0 >> 16);
      const int g = 2 * blk;  // 16-column groups of the super-block
      sup.mw[row][g] = __int2half_rn(ok ? (int)((raw[i].s1 >> 4) & 15) : 0);
      sup.mw[row][g + 1] = __int2half_rn(ok ? (int)((raw[i].s1 >> 12) & 15) : 0);
    } else {  // Q4_K: 6-bit scale and min per 32 columns
      m0 = m1 = __half2half2(__int2half_rn((int)(raw[i].s1 & 255)));
      dsb = half_bits(raw[i].s0 & 0xffff);
      dmsb = half_bits(raw[i].s0 >> 16);
      sup.mw[row][blk] = __int2half_rn(ok ? (int)((raw[i].s1 >> 8) & 255) : 0);
      sup.mw[row][8 + blk] = __int2half_rn(0);
    }
    uint32_t c[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint2 h = codes_half<QT == QT_IQ2_XXS>(d.c[j], j < 4 ? m0 : m1);
      c[2 * j] = ok ? h.x : 0u;
      c[2 * j + 1] = ok ? h.y : 0u;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *(uint4*)&st.w[row][32 * b + 8 * j] = make_uint4(c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3]);
    if (blk == 0) {
      sup.d[row] = ok ? dsb : 0.0f;
      sup.dmin[row] = ok ? dmsb : 0.0f;
    }
  }
}

template <int QT>
__global__ void __launch_bounds__(MF_THREADS, 1) mmf_kernel(MfArgs a) {
  extern __shared__ __align__(16) unsigned char mf_smem[];
  MfStage* st = reinterpret_cast<MfStage*>(mf_smem);
  MfSuper* sup = reinterpret_cast<MfSuper*>(mf_smem + 2 * sizeof(MfStage));
  unsigned long long* grid = reinterpret_cast<unsigned long long*>(mf_smem + 2 * sizeof(MfStage) + 2 * sizeof(MfSuper));
  const MfTile tl = mf_tile<MF_M, MF_N>(a);
  if (tl.an <= 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int wm = (warp & 1) * 32, wn = (warp >> 1) * 32;  // this warp's weight rows and activation rows in the tile
  if constexpr (QT == QT_IQ2_XXS) iq2_tables_init(grid);
  // the super-block's sums of the hi and the lo products apart: 16 independent mma chains per warp, not 8 pairs
  float acc[2][4][4], blk[2][4][4], blo[2][4][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = blk[m][n][e] = blo[m][n][e] = 0.0f;
  const int nstages = a.K / MF_KS;
  RawXb raw[MF_PAIRS];
  mf_load_x<QT>(a, tl, 0, st[0], sup[0]);
  mf_load_w<QT>(a, tl, 0, raw);
  if constexpr (QT == QT_IQ2_XXS) __syncthreads();  // the grid table
  mf_decode_w<QT>(a, tl, 0, raw, grid, st[0], sup[0]);
  for (int s = 0; s < nstages; ++s) {
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // stage s is in shared memory; every warp is done with stage s - 1 (the other buffer)
    const bool next = s + 1 < nstages;
    const int sb = s / MF_SPS;
    if (next) {
      mf_load_x<QT>(a, tl, (s + 1) * MF_KS, st[(s + 1) & 1], sup[((s + 1) / MF_SPS) & 1]);
      mf_load_w<QT>(a, tl, (s + 1) * MF_KS, raw);
    }
    const MfStage& S = st[s & 1];
#pragma unroll
    for (int kk = 0; kk < MF_KS / 16; ++kk) {
      // The next stage's decode three quarters into this one's products (its raw loads, issued at the top, have had
      // most of a stage to arrive), so its instructions issue while the mma are in
      // flight (v11: after them, every warp decoded at once and the tensor cores idled: 1.34 ms against mmq's 1.12).
      // Its buffer was last read in stage s - 1; its super-block's tiles by the epilogue two super-blocks ago. After
      // the last stage it decodes that stage's blocks again into buffers nobody reads: no branch, so the compiler
      // can interleave the decode with the mma.
      if (kk == MF_KS / 16 - 2)
        mf_decode_w<QT>(a, tl, (s + 1) * MF_KS, raw, grid, st[(s + 1) & 1], sup[((s + 1) / MF_SPS) & 1]);
      uint32_t af[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) ldsm_x4(af[m], &S.w[wm + 16 * m + (lane & 15)][16 * kk + 8 * (lane >> 4)]);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        // hi k 0-7, hi k 8-15, lo k 0-7, lo k 8-15 of activation rows wn + 8n .. + 7
        uint32_t bf[4];
        const int t = wn + 8 * n + (lane & 7), kb = 16 * kk + 8 * ((lane >> 3) & 1);
        ldsm_x4(bf, (lane & 16) ? &S.xl[t][kb] : &S.xh[t][kb]);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_f16(blk[m][n], af[m], bf[0], bf[1]);
          mma_f16(blo[m][n], af[m], bf[2], bf[3]);
        }
      }
    }
    if (s % MF_SPS == MF_SPS - 1) {  // the super-block's last stage: its scale onto the sums, the min terms off them
      const MfSuper& U = sup[sb & 1];
      uint32_t am[2][4];
      if constexpr (mf_mins<QT>()) {
#pragma unroll
        for (int m = 0; m < 2; ++m) ldsm_x4(am[m], &U.mw[wm + 16 * m + (lane & 15)][8 * (lane >> 4)]);
      }
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        uint32_t bm[4] = {0u, 0u, 0u, 0u};
        if constexpr (mf_mins<QT>()) {
          const int t = wn + 8 * n + (lane & 7), kb = 8 * ((lane >> 3) & 1);
          ldsm_x4(bm, (lane & 16) ? &U.ml[t][kb] : &U.mh[t][kb]);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          float mins[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          if constexpr (mf_mins<QT>()) {
            mma_f16(mins, am[m], bm[0], bm[1]);
            mma_f16(mins, am[m], bm[2], bm[3]);
          }
          // C: c0 (weight row g, activation row 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = wm + 16 * m + g + 8 * (e >> 1);
            float v = fmaf(U.d[r], blk[m][n][e] + blo[m][n][e], acc[m][n][e]);
            if constexpr (mf_mins<QT>()) v = fmaf(-U.dmin[r], mins[e], v);
            acc[m][n][e] = v;
            blk[m][n][e] = blo[m][n][e] = 0.0f;
          }
        }
      }
    }
  }
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = wn + 8 * n + 2 * q + (e & 1);
      if (t >= tl.an) continue;
      const float sc = a.s[tl.a0 + t];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int r = tl.r0 + wm + 16 * m + g + 8 * (e >> 1);
        if (r < a.rows_g) a.y[(tl.a0 + t) * a.rows_g + r] = acc[m][n][e] * sc;
      }
    }
}

template <int QT>
void launch_as(const MfArgs& a, dim3 grid, cudaStream_t stream) {
  const size_t grid_bytes = QT == QT_IQ2_XXS ? 256 * sizeof(unsigned long long) : 0;
  const size_t shm = 2 * sizeof(MfStage) + 2 * sizeof(MfSuper) + grid_bytes;
  static bool shm_set = false;
  if (!shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(mmf_kernel<QT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = true;
  }
  mmf_kernel<QT><<<grid, MF_THREADS, shm, stream>>>(a);
}

}  // namespace

int mmf_tile_rows() { return MF_N; }

bool mmf_takes(const Packed& w, int n_expert) {
  const bool type = w.qtype == QT_Q2_K || w.qtype == QT_Q4_K || w.qtype == QT_IQ2_XXS;
  return type && n_expert >= 1 && w.nrows % n_expert == 0 && w.ncols % 256 == 0;
}

void launch_mmf_experts(const Packed& w, int n_expert, const MmfActivations& x, const int4* tiles, int ntiles,
                        float* y, cudaStream_t stream) {
  if (!mmf_takes(w, n_expert)) throw std::invalid_argument("mmf_experts: IQ2_XXS, Q2_K or Q4_K experts only");
  if (ntiles <= 0) return;
  if (ntiles > 65535) throw std::invalid_argument("mmf_experts: more than 65535 activation tiles");
  const MfArgs a = mf_args(w, n_expert, x, tiles, y);
  const dim3 grid((a.rows_g + MF_M - 1) / MF_M, ntiles, 1);
  switch (w.qtype) {
    case QT_Q2_K: launch_as<QT_Q2_K>(a, grid, stream); break;
    case QT_Q4_K: launch_as<QT_Q4_K>(a, grid, stream); break;
    default: launch_as<QT_IQ2_XXS>(a, grid, stream); break;
  }
  DS4_CHECK_LAUNCH("mmf");
}

}  // namespace ds4gpu
