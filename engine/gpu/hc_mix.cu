// The mHC's mix for prefill rows ($DS4_GPU_HC_MIX=1): out [T, M] = X [T, K] . Wf [M, K]^T in float32, K = n D (16384
// on Flash), M <= 24. Why not cuBLAS: for M = 24 its float32 GEMM reads X (0.5 GB at 8192 tokens) at ~1.9 TB/s, 0.27
// ms per call and 86 calls per prefill (v26/v27 profiles, 23 ms); this kernel streams X once with the sums in registers.
// CTA: 64 rows, 256 threads; thread (tid / 8, tid % 8) keeps rows r and r + 32 times outputs 3 (tid % 8) .. + 2 (24
// sums; outputs past M multiply zero-filled rows of Wf). Stages of 128 columns of X and Wf by cp.async, three in the
// ring (two in flight while one is multiplied: ~64 KB per SM on the way, enough for the copy rate). Shared rows of 132
// floats: the 8 output groups' float4 loads start 12 banks apart (all 32 banks once), the 4 row pairs broadcast.
#include "common.cuh"
#include "mma_ops.cuh"

namespace ds4gpu {

namespace {

constexpr int HM_ROWS = 64, HM_KC = 128, HM_LD = HM_KC + 4, HM_M = 24, HM_NS = 3, HM_THREADS = 256;

struct HmStage {
  float x[HM_ROWS][HM_LD];
  float w[HM_M][HM_LD];
};

__device__ __forceinline__ void hm_load(const float* X, const float* Wf, int64_t T, int64_t K, int M, int64_t row0,
                                        int64_t k0, HmStage& st) {
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

__global__ void __launch_bounds__(HM_THREADS, 1) hc_mix_rows_kernel(const float* X, const float* Wf, int64_t T,
                                                                    int64_t K, int M, float* out) {
  extern __shared__ __align__(16) unsigned char hm_smem[];
  HmStage* st = reinterpret_cast<HmStage*>(hm_smem);
  const int tid = threadIdx.x, r = tid >> 3, og = tid & 7;
  const int64_t row0 = (int64_t)blockIdx.x * HM_ROWS;
  const int ns = (int)(K / HM_KC);
  float acc[2][3] = {{0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f}};
  for (int s = 0; s < HM_NS - 1 && s < ns; ++s) hm_load(X, Wf, T, K, M, row0, (int64_t)s * HM_KC, st[s]);
  for (int s = 0; s < ns; ++s) {
    if (s + 1 < ns) asm volatile("cp.async.wait_group %0;\n" ::"n"(HM_NS - 2));  // stage s has landed
    else asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // stage s for every thread; every thread is done with stage s - 1, whose buffer is refilled next
    if (s + HM_NS - 1 < ns) hm_load(X, Wf, T, K, M, row0, (int64_t)(s + HM_NS - 1) * HM_KC, st[(s + HM_NS - 1) % HM_NS]);
    const HmStage& S = st[s % HM_NS];
#pragma unroll 4
    for (int k = 0; k < HM_KC; k += 4) {
      const float4 x0 = *reinterpret_cast<const float4*>(&S.x[r][k]);
      const float4 x1 = *reinterpret_cast<const float4*>(&S.x[r + 32][k]);
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const float4 w = *reinterpret_cast<const float4*>(&S.w[3 * og + j][k]);
        acc[0][j] = fmaf(x0.w, w.w, fmaf(x0.z, w.z, fmaf(x0.y, w.y, fmaf(x0.x, w.x, acc[0][j]))));
        acc[1][j] = fmaf(x1.w, w.w, fmaf(x1.z, w.z, fmaf(x1.y, w.y, fmaf(x1.x, w.x, acc[1][j]))));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int64_t row = row0 + r + 32 * i;
      const int o = 3 * og + j;
      if (row < T && o < M) out[row * M + o] = acc[i][j];
    }
}

}  // namespace

bool hc_mix_rows_takes(int64_t K, int M) { return K >= HM_KC && K % HM_KC == 0 && M >= 1 && M <= HM_M; }

void launch_hc_mix_rows(const float* X, const float* Wf, int64_t T, int64_t K, int M, float* out, cudaStream_t s) {
  if (!hc_mix_rows_takes(K, M)) throw std::invalid_argument("hc_mix_rows: K a multiple of 128, 1 <= M <= 24");
  if (((uintptr_t)X | (uintptr_t)Wf) & 15) throw std::invalid_argument("hc_mix_rows: X and Wf 16-byte aligned");
  if (T <= 0) return;
  const size_t shm = HM_NS * sizeof(HmStage);
  static bool shm_set = false;
  if (!shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(hc_mix_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = true;
  }
  hc_mix_rows_kernel<<<(unsigned)((T + HM_ROWS - 1) / HM_ROWS), HM_THREADS, shm, s>>>(X, Wf, T, K, M, out);
  DS4_CHECK_LAUNCH("hc_mix_rows");
}

}  // namespace ds4gpu
