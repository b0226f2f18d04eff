// Prefill products straight from Q8_0 codes on the int8 tensor cores (llama.cpp's "mmq" idea): y[t, r] = W[r] . x[t]
// for T activation rows, with the activations quantized as the decode kernels quantize them (quantize_x_kernel:
// x ~= s * (254 hi + lo) per 32 columns) and, per 32 columns, the exact int32 sum 254 (codes . hi) + (codes . lo)
// times d_w s, accumulated in float32: the arithmetic of the batch-1 matvec (mv_stream.cuh), so prefill and decode
// agree to the order of float sums. What it replaces (weights.py `_gemm`, the default): a dequant pass writing the
// weight as float16 hi + lo (4 bytes per weight) and three float16 GEMMs (hi.hi + hi.lo + lo.hi) for ~22 bits; here
// two int8 products per 32-column block (hi and lo) at twice the float16 rate, no weight copy.
//
// Tiles: a CTA computes 64 weight rows x 64 activation rows with 4 warps (2 x 2, 32 x 32 each: 2 m16 x 4 n8 tiles of
// mma.m16n8k32.s8), over stages of 128 columns (4 blocks of 32) double-buffered in shared memory with cp.async.
// Rows of a stage are padded to 144 bytes, so the fragment loads (row g, bytes 4q..4q+3) hit 32 different banks.
// Grouped weights (the attention output's first projection: groups block-diagonal matrices) take blockIdx.z as the
// group: weight rows g rows_g.., activation columns g K.., output columns g rows_g.. .
// Written without a device (v10): compiled for sm_90a, GPU tests in tests/test_gpu_mmq.py; not yet run.
#include <cuda_fp16.h>

#include "common.cuh"
#include "mv_core.cuh"

namespace ds4gpu {

namespace {

constexpr int MQ_THREADS = 128;
constexpr int MQ_M = 64;      // weight rows per CTA
constexpr int MQ_N = 64;      // activation rows per CTA
constexpr int MQ_KS = 128;    // columns per stage
constexpr int MQ_LD = MQ_KS + 16;  // padded bytes per shared row
constexpr int MQ_NB = MQ_KS / 32;  // 32-column blocks per stage

struct MmqArgs {
  const uint8_t* qs;  // weight codes, row r at qs + r qs_row
  const uint8_t* sc;  // f16 block scales, row r at sc + r sc_row
  int64_t qs_row, sc_row;
  XQ x;               // T rows of groups K columns
  float* y;           // [T, groups rows_g]
  int T, K, rows_g, groups;
};

struct MmqStage {
  int8_t w[MQ_M][MQ_LD];
  int8_t hi[MQ_N][MQ_LD];
  int8_t lo[MQ_N][MQ_LD];
  uint16_t ws[MQ_M][MQ_NB];  // f16 weight scales
  float xs[MQ_N][MQ_NB];     // activation scales
};

__device__ __forceinline__ void cp16(void* dst, const void* src, bool valid) {
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp8(void* dst, const void* src, bool valid) {
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 8 : 0));
}

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Stage `k0` (columns k0 .. k0 + 127 of the group) of this CTA's weight and activation rows into st. Rows past the
// matrix or past T are zero-filled (their products are 0 and never stored).
__device__ __forceinline__ void mmq_load(const MmqArgs& a, int r0, int t0, int grp, int k0, MmqStage& st) {
  const int tid = threadIdx.x;
  const int64_t xcol = (int64_t)grp * a.K + k0;  // column in the activation rows
  for (int i = tid; i < MQ_M * (MQ_KS / 16); i += MQ_THREADS) {  // weight codes: 8 pieces of 16 bytes per row
    const int r = i >> 3, c = (i & 7) * 16;
    const bool ok = r0 + r < a.rows_g;
    const int64_t row = (int64_t)grp * a.rows_g + (ok ? r0 + r : 0);
    cp16(&st.w[r][c], a.qs + row * a.qs_row + k0 + c, ok);
  }
  for (int i = tid; i < MQ_N * (MQ_KS / 16); i += MQ_THREADS) {  // activation planes
    const int t = i >> 3, c = (i & 7) * 16;
    const bool ok = t0 + t < a.T;
    const int64_t off = (int64_t)(ok ? t0 + t : 0) * a.x.n + xcol + c;
    cp16(&st.hi[t][c], a.x.hi + off, ok);
    cp16(&st.lo[t][c], a.x.lo + off, ok);
  }
  if (tid < MQ_M) {  // 4 f16 scales (8 bytes) per weight row
    const bool ok = r0 + tid < a.rows_g;
    const int64_t row = (int64_t)grp * a.rows_g + (ok ? r0 + tid : 0);
    cp8(&st.ws[tid][0], a.sc + row * a.sc_row + 2 * (k0 / 32), ok);
  } else {  // 4 float scales (16 bytes) per activation row
    const int t = tid - MQ_M;
    const bool ok = t0 + t < a.T;
    cp16(&st.xs[t][0], a.x.scale + (int64_t)(ok ? t0 + t : 0) * (a.x.n / 32) + xcol / 32, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

__global__ void __launch_bounds__(MQ_THREADS) mmq_q8_kernel(MmqArgs a) {
  extern __shared__ __align__(16) unsigned char mq_smem[];
  MmqStage* st = reinterpret_cast<MmqStage*>(mq_smem);
  const int r0 = blockIdx.x * MQ_M, t0 = blockIdx.y * MQ_N, grp = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int wm = (warp & 1) * 32, wn = (warp >> 1) * 32;  // this warp's rows and activation rows in the tile
  float acc[2][4][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
  const int nstages = a.K / MQ_KS;
  mmq_load(a, r0, t0, grp, 0, st[0]);
  for (int s = 0; s < nstages; ++s) {
    if (s + 1 < nstages) {
      mmq_load(a, r0, t0, grp, (s + 1) * MQ_KS, st[(s + 1) & 1]);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();
    const MmqStage& S = st[s & 1];
#pragma unroll
    for (int b = 0; b < MQ_NB; ++b) {
      const int kc = 32 * b + 4 * q;
      uint32_t af[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int r = wm + 16 * m + g;
        af[m][0] = *(const uint32_t*)&S.w[r][kc];
        af[m][1] = *(const uint32_t*)&S.w[r + 8][kc];
        af[m][2] = *(const uint32_t*)&S.w[r][kc + 16];
        af[m][3] = *(const uint32_t*)&S.w[r + 8][kc + 16];
      }
      float wsc[2][2];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        wsc[m][0] = half_bits(S.ws[wm + 16 * m + g][b]);
        wsc[m][1] = half_bits(S.ws[wm + 16 * m + g + 8][b]);
      }
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int t = wn + 8 * n + g;
        const uint32_t h0 = *(const uint32_t*)&S.hi[t][kc], h1 = *(const uint32_t*)&S.hi[t][kc + 16];
        const uint32_t l0 = *(const uint32_t*)&S.lo[t][kc], l1 = *(const uint32_t*)&S.lo[t][kc + 16];
        const float xs0 = S.xs[wn + 8 * n + 2 * q][b], xs1 = S.xs[wn + 8 * n + 2 * q + 1][b];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          int ch[4] = {0, 0, 0, 0}, cl[4] = {0, 0, 0, 0};
          mma_s8(ch, af[m], h0, h1);
          mma_s8(cl, af[m], l0, l1);
          // C: c0 (row g, act 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1); the matvec's FMA per block
          acc[m][n][0] = fmaf(wsc[m][0] * xs0, (float)(254 * ch[0] + cl[0]), acc[m][n][0]);
          acc[m][n][1] = fmaf(wsc[m][0] * xs1, (float)(254 * ch[1] + cl[1]), acc[m][n][1]);
          acc[m][n][2] = fmaf(wsc[m][1] * xs0, (float)(254 * ch[2] + cl[2]), acc[m][n][2]);
          acc[m][n][3] = fmaf(wsc[m][1] * xs1, (float)(254 * ch[3] + cl[3]), acc[m][n][3]);
        }
      }
    }
    __syncthreads();  // the next load overwrites this buffer
  }
  const int64_t ldy = (int64_t)a.groups * a.rows_g;
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int ra = r0 + wm + 16 * m + g, ta = t0 + wn + 8 * n + 2 * q;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = ra + (e >> 1) * 8, t = ta + (e & 1);
        if (r < a.rows_g && t < a.T) a.y[(int64_t)t * ldy + (int64_t)grp * a.rows_g + r] = acc[m][n][e];
      }
    }
}

}  // namespace

bool mmq_takes(const Packed& w, int groups) {
  return w.qtype == QT_Q8_0 && groups >= 1 && w.nrows % groups == 0 && w.ncols % MQ_KS == 0 && groups <= 65535;
}

void launch_mmq(const Packed& w, const XQ& x, int T, int groups, float* y, cudaStream_t stream) {
  if (!mmq_takes(w, groups)) throw std::invalid_argument("mmq: Q8_0 weights with columns a multiple of 128 only");
  if (x.n != w.ncols * groups) throw std::invalid_argument("mmq: activation width is not groups x weight columns");
  if (T <= 0) return;
  MmqArgs a{w.qs, w.sc, w.qs_row, w.sc_row, x, y, T, (int)w.ncols, (int)(w.nrows / groups), groups};
  const size_t shm = 2 * sizeof(MmqStage);
  static bool shm_set = false;
  if (!shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(mmq_q8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = true;
  }
  const dim3 grid((a.rows_g + MQ_M - 1) / MQ_M, (T + MQ_N - 1) / MQ_N, groups);
  mmq_q8_kernel<<<grid, MQ_THREADS, shm, stream>>>(a);
  DS4_CHECK_LAUNCH("mmq");
}

}  // namespace ds4gpu
