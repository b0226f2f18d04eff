// The mHC's mix for prefill rows ($DS4_GPU_HC_MIX): out [T, M] = X [T, K] . Wf [M, K]^T in float32, K = n D (16384 on
// Flash), M <= 24. Why not cuBLAS: for M = 24 its float32 GEMM reads X (0.5 GB at 8192 tokens) at ~1.9 TB/s, 0.27 ms
// per call and 86 calls per prefill (v26/v27 profiles, 23 ms); this kernel streams X once with the sums in registers.
//
// CTA: 64 rows and one of S column slices (grid.y; S > 1 where the row blocks alone would leave SMs idle: each slice's
// sums go to a scratch [S, T, M] that hc_mix_sum_kernel adds in slice order, so the bits do not depend on timing).
// Stages of 128 columns of X and Wf by cp.async, three in the ring (two in flight while one is multiplied; a ring of four,
// v28's DS4_GPU_HC_MIX_RING, measured no faster in v30: 0.247 against 0.248 ms, 0.228 against 0.226 with PTRS).
// Warp w takes the stage's columns 16 w .. 16 w + 15, its half-warp h the 8 of them from 16 w + 8 h, and lane l rows
// l % 16 + 16 i (i < 4) with all 24 outputs: 96 sums in registers (outputs past M multiply zero-filled rows of Wf).
// The 16 half-warps' partial sums are added through shared memory at the end.
// Why this shape (v28, NOTES.md v28 item 3): v1 (2 rows x 3 outputs per thread: 5 shared loads of 16 bytes per 24 FMAs)
// ran 0.39 ms per 8192-row call, slower than the GEMM; a first v28 form (2 rows x 24 outputs: 26 loads per 192 FMAs)
// 0.26 ms, and as long at 2048 rows (32 CTAs). Here 28 loads serve 384 FMAs and the column slices keep the SMs busy at
// 2048 rows: 0.248 / 0.070 ms at 8192 / 2048 rows (1.09x / 1.13x torch's GEMM). Predicted ~0.1 ms at 8192 (the FMA
// pipes; reading X ~0.12): both v28 forms take ~1.9 us per stage and CTA whatever their load counts, so the loads'
// issue is not the bound (about half the copy rate per SM; not yet profiled).
// v29 ($DS4_GPU_HC_MIX_PTRS=1, the default since v30): the loads' addresses from per-thread pointers and masks
// (HmLoader): the stage loop's SASS 939 instructions per thread (768 FFMA, 56 LDS.128) against ~1330, 180 registers
// against 204; 0.226 ms per 8192-row call against 0.248 (predicted ~0.18 if the stage were issue-bound: it is not).
// Shared rows of 132 floats: a quarter-warp's x loads (8 rows) start 4 banks apart, all 32 banks once.
#include <cstddef>

#include "common.cuh"
#include "mma_ops.cuh"

namespace ds4gpu {

namespace {

constexpr int HM_ROWS = 64, HM_KC = 128, HM_LD = HM_KC + 4, HM_M = 24, HM_THREADS = 256;
constexpr int HM_HALVES = 2 * HM_THREADS / 32;  // half-warps, each a partial sum of every (row, output)
constexpr int HM_HCOLS = HM_KC / HM_HALVES;     // a half-warp's columns of a stage: 8
constexpr int HM_RPL = HM_ROWS / 16;            // rows per lane: 4
constexpr int HM_RLD = HM_M + 1;                // partial sums' row stride (odd: 16 lanes hit 16 banks)
constexpr int HM_MAX_SPLITS = 8;

struct HmStage {
  float x[HM_ROWS][HM_LD];
  float w[HM_M][HM_LD];
};
static_assert(HM_HALVES * HM_ROWS * HM_RLD * sizeof(float) <= 3 * sizeof(HmStage), "the partials fit the stages");
constexpr int HM_NS = 3;  // stages in the ring (two in flight)
static_assert(HM_NS * sizeof(HmStage) <= 227 * 1024, "the ring fits an SM");
static_assert(HM_THREADS == 256 && HM_KC == 128 && HM_ROWS % 8 == 0 && HM_M % 8 == 0,
              "hm_load: 32 threads cover a row's 128 columns, 8 rows per pass");

// Stage loads as v28 ran them (DS4_GPU_HC_MIX_PTRS=0): each element's row and column from its index, every stage.
__device__ __forceinline__ void hm_load_elements(const float* X, const float* Wf, int64_t T, int64_t K, int M,
                                                 int64_t row0, int64_t k0, HmStage& st) {
  const int tid = threadIdx.x;
  for (int i = tid; i < HM_ROWS * (HM_KC / 4); i += HM_THREADS) {
    const int r = i / (HM_KC / 4), c = 4 * (i % (HM_KC / 4));
    const bool ok = row0 + r < T;
    cp16(&st.x[r][c], X + (row0 + (ok ? r : 0)) * K + k0 + c, ok);
  }
  for (int i = tid; i < HM_M * (HM_KC / 4); i += HM_THREADS) {
    const int o = i / (HM_KC / 4), c = 4 * (i % (HM_KC / 4));
    const bool ok = o < M;
    cp16(&st.w[o][c], Wf + (int64_t)(ok ? o : 0) * K + k0 + c, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// DS4_GPU_HC_MIX_PTRS=1 (v29, prepared): a thread's share of a stage's loads, fixed for the whole kernel: X rows
// lr + 8 j (j < 8) and Wf rows lr + 8 j (j < 3) at columns lc .. lc + 3 of each stage, lr = tid / 32, lc = 4 (tid % 32).
// Why kept: computed per stage from the element index (64-bit row times K for each of 11 cp.async), the loads took
// ~300 of a thread's ~1200 instructions per stage (SASS, v29); from these pointers and masks each cp.async costs a
// 64-bit add and a select.
struct HmLoader {
  const float* x;  // X + (row0 + lr) K + lc + k_begin
  const float* w;  // Wf + lr K + lc + k_begin
  const float* safe;  // a readable address for the rows past T or M (zero-filled: nothing is read)
  int64_t step8;      // 8 K: from a thread's row to its next
  uint32_t xok, wok;  // bit j: X row row0 + lr + 8 j < T; Wf row lr + 8 j < M
  uint32_t sx, sw;    // shared offsets of this thread's first x and w element in stage 0
};

__device__ __forceinline__ HmLoader hm_loader(const float* X, const float* Wf, int64_t T, int64_t K, int M,
                                              int64_t row0, int64_t k_begin, const unsigned char* smem) {
  const int tid = threadIdx.x, lr = tid >> 5, lc = 4 * (tid & 31);
  HmLoader L;
  L.x = X + (row0 + lr) * K + lc + k_begin;
  L.w = Wf + (int64_t)lr * K + lc + k_begin;
  L.safe = X;
  L.step8 = 8 * K;
  L.xok = L.wok = 0;
  for (int j = 0; j < HM_ROWS / 8; ++j) L.xok |= (uint32_t)(row0 + lr + 8 * j < T) << j;
  for (int j = 0; j < HM_M / 8; ++j) L.wok |= (uint32_t)(lr + 8 * j < M) << j;
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  L.sx = base + (uint32_t)((lr * HM_LD + lc) * sizeof(float));
  L.sw = base + (uint32_t)(offsetof(HmStage, w) + (lr * HM_LD + lc) * sizeof(float));
  return L;
}

__device__ __forceinline__ float4 hm_scale4(float4 v, float r) {  // hc.cu's hc_scale4: the rescale's bits
  return make_float4(__fmul_rn(v.x, r), __fmul_rn(v.y, r), __fmul_rn(v.z, r), __fmul_rn(v.w, r));
}

__device__ __forceinline__ void cp16_at(uint32_t dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// Stage s of the CTA's columns (k_begin + s HM_KC ..) into ring buffer b.
__device__ __forceinline__ void hm_load(const HmLoader& L, int s, int b) {
  const int64_t k = (int64_t)s * HM_KC;
  const uint32_t sb = (uint32_t)(b * sizeof(HmStage)), row8 = (uint32_t)(8 * HM_LD * sizeof(float));
  const float* p = L.x + k;
#pragma unroll
  for (int j = 0; j < HM_ROWS / 8; ++j, p += L.step8) {
    const bool ok = (L.xok >> j) & 1u;
    cp16_at(L.sx + sb + j * row8, ok ? p : L.safe, ok);
  }
  p = L.w + k;
#pragma unroll
  for (int j = 0; j < HM_M / 8; ++j, p += L.step8) {
    const bool ok = (L.wok >> j) & 1u;
    cp16_at(L.sw + sb + j * row8, ok ? p : L.safe, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// One stage's products: the half-warp's 8 columns from c0 of the stage's x rows l16 + 16 i and w rows, into acc.
__device__ __forceinline__ void hm_fma_stage(const float (*x)[HM_LD], const float (*w)[HM_LD], int c0, int l16,
                                             float (&acc)[HM_RPL][HM_M]) {
#pragma unroll
  for (int k = c0; k < c0 + HM_HCOLS; k += 4) {
    float4 xv[HM_RPL];
#pragma unroll
    for (int i = 0; i < HM_RPL; ++i) xv[i] = *reinterpret_cast<const float4*>(&x[l16 + 16 * i][k]);
#pragma unroll
    for (int o = 0; o < HM_M; ++o) {
      const float4 wv = *reinterpret_cast<const float4*>(&w[o][k]);
#pragma unroll
      for (int i = 0; i < HM_RPL; ++i)
        acc[i][o] = fmaf(xv[i].w, wv.w, fmaf(xv[i].z, wv.z, fmaf(xv[i].y, wv.y, fmaf(xv[i].x, wv.x, acc[i][o]))));
    }
  }
}

// The 16 half-warps' partial sums added through shared memory (smem: the stages, no longer read), each (row, output)
// sum to dst[row * M + o].
__device__ __forceinline__ void hm_store_sums(const float (&acc)[HM_RPL][HM_M], unsigned char* smem, int half, int l16,
                                              int64_t row0, int64_t T, int M, float* dst) {
  __syncthreads();  // every warp is done with the stages: they hold the partial sums now
  float* part = reinterpret_cast<float*>(smem);  // [half][row][HM_RLD]
#pragma unroll
  for (int i = 0; i < HM_RPL; ++i)
#pragma unroll
    for (int o = 0; o < HM_M; ++o) part[(half * HM_ROWS + l16 + 16 * i) * HM_RLD + o] = acc[i][o];
  __syncthreads();
  for (int e = threadIdx.x; e < HM_ROWS * HM_M; e += HM_THREADS) {
    const int r = e / HM_M, o = e % HM_M;
    const int64_t row = row0 + r;
    if (row >= T || o >= M) continue;
    float sum = part[r * HM_RLD + o];
#pragma unroll
    for (int h = 1; h < HM_HALVES; ++h) sum += part[(h * HM_ROWS + r) * HM_RLD + o];
    dst[row * M + o] = sum;
  }
}

// Columns [k_begin, k_begin + ns HM_KC) of rows row0 .. row0 + 63: each (row, output) sum to dst[row * M + o].
template <bool PTRS>
__global__ void __launch_bounds__(HM_THREADS, 1) hc_mix_rows_kernel(const float* X, const float* Wf, int64_t T,
                                                                    int64_t K, int M, int ns, float* out,
                                                                    float* scratch) {
  static_assert(HM_NS == 3, "the waits below cover a ring of three stages");
  extern __shared__ __align__(16) unsigned char hm_smem[];
  HmStage* st = reinterpret_cast<HmStage*>(hm_smem);
  const int tid = threadIdx.x, lane = tid & 31, half = tid >> 4, l16 = lane & 15;
  const int c0 = half * HM_HCOLS;
  const int64_t row0 = (int64_t)blockIdx.x * HM_ROWS, k_begin = (int64_t)blockIdx.y * ns * HM_KC;
  float acc[HM_RPL][HM_M];
#pragma unroll
  for (int i = 0; i < HM_RPL; ++i)
#pragma unroll
    for (int o = 0; o < HM_M; ++o) acc[i][o] = 0.0f;
  const HmLoader L = hm_loader(X, Wf, T, K, M, row0, k_begin, hm_smem);
  auto load = [&](int s) {  // stage s into ring buffer s % HM_NS
    if constexpr (PTRS) hm_load(L, s, s % HM_NS);
    else hm_load_elements(X, Wf, T, K, M, row0, k_begin + (int64_t)s * HM_KC, st[s % HM_NS]);
  };
  for (int s = 0; s < HM_NS - 1 && s < ns; ++s) load(s);
  for (int s = 0; s < ns; ++s) {
    // stage s has landed: the group committed after it (none for the last stage) may still be in flight
    if (s + 1 < ns) asm volatile("cp.async.wait_group 1;\n" ::);
    else asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // stage s for every thread; every thread is done with stage s - 1, whose buffer is refilled next
    if (s + HM_NS - 1 < ns) load(s + HM_NS - 1);
    hm_fma_stage(st[s % HM_NS].x, st[s % HM_NS].w, c0, l16, acc);
  }
  hm_store_sums(acc, hm_smem, half, l16, row0, T, M, gridDim.y == 1 ? out : scratch + (int64_t)blockIdx.y * T * M);
}

// out[i] = the S slices' sums of element i, added in slice order.
__global__ void hc_mix_sum_kernel(const float* scratch, int64_t n, int S, float* out) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float sum = scratch[i];
  for (int s = 1; s < S; ++s) sum += scratch[s * n + i];
  out[i] = sum;
}

// ---- v31: the previous sublayer's mHC post and this one's mix in one pass ($DS4_GPU_HC_POST_MIX) ----
// Prefill ran hc_post4 (X read, X' written: 0.29 ms at 8192 rows on Flash) and then hc_mix_rows (X' read again: 0.23
// ms), 86 of each per 8192-token prefill. Here a stage holds 32 columns of each of the 4 streams (the 128 flattened
// columns c + 4096 h): X, y1 and y2 land by cp.async, the post is computed in shared memory in place with hc_post4's
// expressions (so X' has its bits; written out from there), then the mix's products run on the stage as in
// hc_mix_rows. The mix sums the columns in another order than hc_mix_rows (the same values to float rounding).
constexpr int PM_N = 4, PM_C = HM_KC / PM_N;  // streams; columns of each per stage
constexpr int PM_RC = 24;                      // per row: comb [4][4], post [4], r1, r2, two unused
struct PmStage {
  float x[HM_ROWS][HM_LD];  // [row][h * 32 + c]: X, then X' in place
  float w[HM_M][HM_LD];     // [output][h * 32 + c]
  float y1[HM_ROWS][PM_C];
  float y2[HM_ROWS][PM_C];
};
constexpr int PM_NS = 3;
constexpr size_t PM_SMEM = PM_NS * sizeof(PmStage) + HM_ROWS * PM_RC * sizeof(float);
static_assert(PM_SMEM <= 227 * 1024, "the ring and the row constants fit an SM");
static_assert(HM_HALVES * HM_ROWS * HM_RLD * sizeof(float) <= PM_NS * sizeof(PmStage), "the partials fit the stages");
static_assert(HM_ROWS * PM_C / 4 == 2 * HM_THREADS, "two float4 items of y (and of the post) per thread and stage");

struct PmArgs {
  const float* X;  // [T, 4, D]
  const float* y1;  // [T, D]
  const float* y2;  // [T, D] or null
  const float* post;  // [T, 4]
  const float* comb;  // [T, 4, 4]
  const float* r1;  // [T] or null: y1's per-row rescale
  const float* r2;
  const float* Wf;  // [M, 4 D]
  float* Xo;        // [T, 4, D]
  float* out;       // [T, M] (or the slice scratch)
  float* scratch;
  int64_t T, D;
  int M, ns;
};

// Stage s of the CTA's columns into ring buffer b: thread (lr, lc) copies X rows lr + 8 j (j < 8) and Wf rows lr + 8 j
// (j < 3) at stage column lc (stream lc / 32, column lc % 32), and y rows tid / 8 + 32 i (i < 2) at columns 4 (tid % 8).
__device__ __forceinline__ void pm_load(const PmArgs& a, PmStage& S, int64_t row0, int64_t c) {
  const int tid = threadIdx.x, lr = tid >> 5, lc = 4 * (tid & 31), h = lc / PM_C, cc = lc % PM_C;
#pragma unroll
  for (int j = 0; j < HM_ROWS / 8; ++j) {
    const int64_t row = row0 + lr + 8 * j;
    const bool ok = row < a.T;
    cp16(&S.x[lr + 8 * j][lc], a.X + ((ok ? row : 0) * PM_N + h) * a.D + c + cc, ok);
  }
#pragma unroll
  for (int j = 0; j < HM_M / 8; ++j) {
    const int o = lr + 8 * j;
    const bool ok = o < a.M;
    cp16(&S.w[o][lc], a.Wf + (int64_t)(ok ? o : 0) * PM_N * a.D + h * a.D + c + cc, ok);
  }
  const int yq = 4 * (tid & 7);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int yr = (tid >> 3) + 32 * i;
    const int64_t row = row0 + yr;
    const bool ok = row < a.T;
    cp16(&S.y1[yr][yq], a.y1 + (ok ? row : 0) * a.D + c + yq, ok);
    if (a.y2) cp16(&S.y2[yr][yq], a.y2 + (ok ? row : 0) * a.D + c + yq, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// The post on a landed stage, in place (the items of pm_load's y mapping), X' also stored to a.Xo.
__device__ __forceinline__ void pm_post(const PmArgs& a, PmStage& S, const float (*rc)[PM_RC], int64_t row0,
                                        int64_t c) {
  const int tid = threadIdx.x, q = 4 * (tid & 7);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = (tid >> 3) + 32 * i;
    float x[PM_N][4];
#pragma unroll
    for (int h = 0; h < PM_N; ++h) {
      const float4 v = *reinterpret_cast<const float4*>(&S.x[r][h * PM_C + q]);
      x[h][0] = v.x; x[h][1] = v.y; x[h][2] = v.z; x[h][3] = v.w;
    }
    float y[4];
    {
      float4 v = *reinterpret_cast<const float4*>(&S.y1[r][q]);
      if (a.r1) v = hm_scale4(v, rc[r][20]);
      y[0] = v.x; y[1] = v.y; y[2] = v.z; y[3] = v.w;
    }
    if (a.y2) {
      float4 v = *reinterpret_cast<const float4*>(&S.y2[r][q]);
      if (a.r2) v = hm_scale4(v, rc[r][21]);
      y[0] += v.x; y[1] += v.y; y[2] += v.z; y[3] += v.w;
    }
    const int64_t row = row0 + r;
#pragma unroll
    for (int b = 0; b < PM_N; ++b) {
      float o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // hc_post4's expressions, in its order
        float sum = 0.0f;
#pragma unroll
        for (int h = 0; h < PM_N; ++h) sum += rc[r][h * PM_N + b] * x[h][j];
        o[j] = rc[r][16 + b] * y[j] + sum;
      }
      const float4 v = make_float4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<float4*>(&S.x[r][b * PM_C + q]) = v;
      if (row < a.T) *reinterpret_cast<float4*>(a.Xo + (row * PM_N + b) * a.D + c + q) = v;
    }
  }
}

__global__ void __launch_bounds__(HM_THREADS, 1) hc_post_mix_kernel(const __grid_constant__ PmArgs a) {
  extern __shared__ __align__(16) unsigned char pm_smem[];
  PmStage* st = reinterpret_cast<PmStage*>(pm_smem);
  float (*rc)[PM_RC] = reinterpret_cast<float (*)[PM_RC]>(pm_smem + PM_NS * sizeof(PmStage));
  const int tid = threadIdx.x, lane = tid & 31, half = tid >> 4, l16 = lane & 15;
  const int c0 = half * HM_HCOLS;
  const int64_t row0 = (int64_t)blockIdx.x * HM_ROWS, c_begin = (int64_t)blockIdx.y * a.ns * PM_C;
  pdl_begin();
  for (int e = tid; e < HM_ROWS * PM_RC; e += HM_THREADS) {
    const int r = e / PM_RC, f = e % PM_RC;
    const int64_t row = row0 + r;
    float v = 0.0f;
    if (row < a.T) {
      if (f < 16) v = a.comb[row * 16 + f];
      else if (f < 20) v = a.post[row * PM_N + f - 16];
      else if (f == 20 && a.r1) v = a.r1[row];
      else if (f == 21 && a.r2) v = a.r2[row];
    }
    rc[r][f] = v;
  }
  float acc[HM_RPL][HM_M];
#pragma unroll
  for (int i = 0; i < HM_RPL; ++i)
#pragma unroll
    for (int o = 0; o < HM_M; ++o) acc[i][o] = 0.0f;
  for (int s = 0; s < PM_NS - 1 && s < a.ns; ++s) pm_load(a, st[s], row0, c_begin + (int64_t)s * PM_C);
  for (int s = 0; s < a.ns; ++s) {
    if (s + 1 < a.ns) asm volatile("cp.async.wait_group 1;\n" ::);
    else asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // stage s (and the row constants) for every thread; stage s - 1's products are done
    if (s + PM_NS - 1 < a.ns) pm_load(a, st[(s + PM_NS - 1) % PM_NS], row0, c_begin + (int64_t)(s + PM_NS - 1) * PM_C);
    PmStage& S = st[s % PM_NS];
    pm_post(a, S, rc, row0, c_begin + (int64_t)s * PM_C);
    __syncthreads();  // X' of the stage for every thread
    hm_fma_stage(S.x, S.w, c0, l16, acc);
  }
  hm_store_sums(acc, pm_smem, half, l16, row0, a.T, a.M,
                gridDim.y == 1 ? a.out : a.scratch + (int64_t)blockIdx.y * a.T * a.M);
}

template <bool PTRS>
void launch_rows(dim3 grid, cudaStream_t s, const float* X, const float* Wf, int64_t T, int64_t K, int M, int ns,
                 float* out, float* scratch) {
  const size_t shm = HM_NS * sizeof(HmStage);
  static bool shm_set = false;
  if (!shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(hc_mix_rows_kernel<PTRS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)shm));
    shm_set = true;
  }
  hc_mix_rows_kernel<PTRS><<<grid, HM_THREADS, shm, s>>>(X, Wf, T, K, M, ns, out, scratch);
}

// $DS4_GPU_HC_MIX_PTRS (v29; default 1 since v30): 1 the stage loads from per-thread pointers and masks (HmLoader), 0
// from each element's index (v28). Measured (v30, bench_hc --prefill-mix): 0.248 -> 0.226 ms at 8192 rows, 0.070 ->
// 0.065 at 2048. The same bits. set_hc_mix_ptrs overrides it (0, 1; -1 the environment).
EnvSwitch hc_mix_ptrs_switch{"DS4_GPU_HC_MIX_PTRS", 1, 1};

// $DS4_GPU_HC_SPLIT_WAVES (v34; default 1): 1 the slices S that run the fewest stages per SM, 0 the v30 doubling rule
// (S doubles while 2 S blocks still fit one wave). Both kernels hold one CTA per SM, so a launch of `blocks` S CTAs
// runs ceil(blocks S / SMs) waves of stages / S stages each. The doubling rule left a chunk of 6144 rows (96 blocks)
// at S = 1: one wave on 96 of 132 SMs, the same time as 8192 rows (v34 call 1: hc_post_mix 34.8 ms per 6144-row
// chunk, 35.5 per 8192); S = 4 runs it in 3 waves of a quarter. Ties go to the fewer slices (one sum pass less).
// Other slices sum the same products in another order: the mix to float rounding, not the same bits.
EnvSwitch hc_split_waves_switch{"DS4_GPU_HC_SPLIT_WAVES", 1, 1};

}  // namespace

void set_hc_mix_ptrs(int mode) { hc_mix_ptrs_switch.set(mode); }
void set_hc_split_waves(int mode) { hc_split_waves_switch.set(mode); }

bool hc_mix_rows_takes(int64_t K, int M) { return K >= HM_KC && K % HM_KC == 0 && M >= 1 && M <= HM_M; }

int hc_mix_rows_splits(int64_t T, int64_t K) {
  if (T <= 0 || K < HM_KC || K % HM_KC) return 1;
  const int64_t blocks = (T + HM_ROWS - 1) / HM_ROWS, stages = K / HM_KC, sms = sm_count();
  int S = 1;
  if (hc_split_waves_switch.get() == 0) {
    while (S < HM_MAX_SPLITS && blocks * 2 * S <= sms && stages % (2 * S) == 0) S *= 2;
    return S;
  }
  int64_t best = (blocks + sms - 1) / sms * stages;  // stage rounds per SM: waves x stages per CTA
  for (int s = 2; s <= HM_MAX_SPLITS && stages % s == 0; s *= 2) {
    const int64_t cost = (blocks * s + sms - 1) / sms * (stages / s);
    if (cost < best) best = cost, S = s;
  }
  return S;
}

void launch_hc_mix_rows(const float* X, const float* Wf, int64_t T, int64_t K, int M, float* out, float* scratch,
                        cudaStream_t s) {
  if (!hc_mix_rows_takes(K, M)) throw std::invalid_argument("hc_mix_rows: K a multiple of 128, 1 <= M <= 24");
  if (((uintptr_t)X | (uintptr_t)Wf) & 15) throw std::invalid_argument("hc_mix_rows: X and Wf 16-byte aligned");
  if (T <= 0) return;
  const int S = hc_mix_rows_splits(T, K);
  if (S > 1 && !scratch)
    throw std::invalid_argument("hc_mix_rows: " + std::to_string(T) + " rows take " + std::to_string(S) +
                                " column slices and need a scratch of S T M floats (hc_mix_rows_splits)");
  const int ns = (int)(K / HM_KC / S);
  const dim3 grid((unsigned)((T + HM_ROWS - 1) / HM_ROWS), S);
  if (hc_mix_ptrs_switch.get() != 0) launch_rows<true>(grid, s, X, Wf, T, K, M, ns, out, scratch);
  else launch_rows<false>(grid, s, X, Wf, T, K, M, ns, out, scratch);
  DS4_CHECK_LAUNCH("hc_mix_rows");
  if (S > 1) {
    const int64_t n = T * M;
    hc_mix_sum_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(scratch, n, S, out);
    DS4_CHECK_LAUNCH("hc_mix_rows (slice sums)");
  }
}

bool hc_post_mix_takes(int n, int64_t D, int M) { return n == PM_N && D >= PM_C && D % PM_C == 0 && M >= 1 && M <= HM_M; }

void launch_hc_post_mix(const float* X, const float* y1, const float* y2, const float* post, const float* comb,
                        const float* r1, const float* r2, const float* Wf, int64_t T, int64_t D, int M, float* Xo,
                        float* out, float* scratch, cudaStream_t s) {
  if (!hc_post_mix_takes(PM_N, D, M)) throw std::invalid_argument("hc_post_mix: 4 streams, D a multiple of 32, M <= 24");
  if (((uintptr_t)X | (uintptr_t)y1 | (uintptr_t)y2 | (uintptr_t)Wf | (uintptr_t)Xo) & 15)
    throw std::invalid_argument("hc_post_mix: X, y1, y2, Wf and Xo 16-byte aligned");
  if (T <= 0) return;
  const int64_t K = PM_N * D;
  const int S = hc_mix_rows_splits(T, K);
  if (S > 1 && !scratch)
    throw std::invalid_argument("hc_post_mix: " + std::to_string(T) + " rows take " + std::to_string(S) +
                                " column slices and need a scratch of S T M floats (hc_mix_rows_splits)");
  static bool shm_set = false;
  if (!shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(hc_post_mix_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PM_SMEM));
    shm_set = true;
  }
  const PmArgs a{X, y1, y2, post, comb, r1, r2, Wf, Xo, out, scratch, T, D, M, (int)(D / PM_C / S)};
  launch_k(hc_post_mix_kernel, dim3((unsigned)((T + HM_ROWS - 1) / HM_ROWS), S), dim3(HM_THREADS), PM_SMEM, s, a);
  DS4_CHECK_LAUNCH("hc_post_mix");
  if (S > 1) {
    const int64_t n = T * M;
    hc_mix_sum_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(scratch, n, S, out);
    DS4_CHECK_LAUNCH("hc_post_mix (slice sums)");
  }
}

}  // namespace ds4gpu
