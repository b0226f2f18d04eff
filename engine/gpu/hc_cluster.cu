// Decode's mHC pre in one thread block cluster per token (hc_cluster_kernel, $DS4_GPU_HC_CLUSTER) and its launcher;
// the arrival-count form it replaces and the prefill forms are in hc.cu.
#include <math.h>

#include <cooperative_groups.h>

#include <cstdlib>

#include "block_ops.cuh"
#include "common.cuh"
#include "hc.cuh"

namespace ds4gpu {

namespace {

// mHC pre in one cluster (decode, n = 4; $DS4_GPU_HC_CLUSTER, default 1): HCC_CTAS CTAs of one thread block cluster share a
// token; CTA c owns columns d in [c D / 16, (c + 1) D / 16) of all four streams, one column per thread. Why: the
// one-launch kernel above ends in a serial tail (fence, arrival count, the last block's L2 reads of every partial
// and of X', then out over all D columns in one block): ~10-11 us per call in the session, 87 calls per token. Here
// the partials go through distributed shared memory and one cluster barrier, and every CTA forms out for its own
// columns. out's norm needs sum_d u_d^2 with u = sum_i pre_i X'_i before pre is known; it is pre^T G pre with the
// 4 x 4 Gram matrix G_ij = sum_d X'_i[d] X'_j[d], which the partials carry (10 values) beside the M mix rows and
// sum X'^2. The mix weights (M x 4 per thread) are loaded before griddepcontrol.wait. Sums in another order than
// the kernel above (and u^2 through G): the same values to float rounding, not the same bits. X' is hc_post_cols'.
constexpr int HCC_CTAS = 16;                  // a non-portable cluster size (H100 / H200 GPCs hold 16+ SMs)
constexpr int HCC_MAX_M = 24;                 // (2 + n) n for n = 4
constexpr int HCC_Q = HCC_MAX_M + 1 + 10;     // partials: mix rows, sum X'^2, the Gram matrix's upper triangle
constexpr int HCC_MAX_THREADS = 256;          // D / 16 columns per CTA: D <= 4096

// One halving step of warp_reduce_scatter32: lanes with bit O keep values O .. 2 O - 1, the others 0 .. O - 1, each
// adding its partner's copy; static indices only (a loop over O left v in local memory).
template <int O>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[32]) {
  const bool up = threadIdx.x & O;
#pragma unroll
  for (int j = 0; j < O; ++j) {
    const float send = up ? v[j] : v[j + O], keep = up ? v[j + O] : v[j];
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
}
// v[0 .. 32) summed over the warp's lanes by recursive halving (31 shuffles for 32 values): lane L returns value L's sum.
__device__ __forceinline__ float warp_reduce_scatter32(float (&v)[32]) {
  reduce_scatter_step<16>(v);
  reduce_scatter_step<8>(v);
  reduce_scatter_step<4>(v);
  reduce_scatter_step<2>(v);
  reduce_scatter_step<1>(v);
  return v[0];
}

__global__ void __cluster_dims__(HCC_CTAS, 1, 1) __launch_bounds__(HCC_MAX_THREADS, 1)
    hc_cluster_kernel(const float* X, const float* Wf, int M, const float* scale, const float* base,
                      const float* norm_w, int D, int iters, float eps_rms, float eps_hc, bool head, float* out,
                      float* post_out, float* comb_out, HcPost hp, bool rcp, float* logits_out, bool early) {
  namespace cg = cooperative_groups;
  constexpr int n = 4;
  __shared__ float s_warp[HCC_MAX_THREADS / 32][HCC_Q];
  __shared__ float s_all[HCC_CTAS][HCC_Q];  // every CTA's partials, written by each CTA into every CTA
  __shared__ float s_tot[HCC_Q];
  __shared__ float s_base[HCC_MAX_M], s_scale[3];  // early: the weights read after the cluster barrier, staged early
  cg::cluster_group cluster = cg::this_cluster();
  const int c = (int)cluster.block_rank(), t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int dc = D / HCC_CTAS, d = c * dc + tid;
  const int64_t nD = (int64_t)n * D;
  pdl_trigger();
  float w[HCC_MAX_M][n];  // the mix weights at this thread's column of each stream: independent of earlier kernels
#pragma unroll
  for (int m = 0; m < HCC_MAX_M; ++m)
#pragma unroll
    for (int i = 0; i < n; ++i) w[m][i] = m < M ? __ldg(Wf + m * nD + (int64_t)i * D + d) : 0.0f;
  // early ($DS4_GPU_PREWAIT=2): scale, base and the norm weight are weights too, read here instead of after the cluster
  // barrier (their round trip was on the chain there); the same values, so the same bits. The head has one scale.
  float nw = 1.0f;
  if (early) {
    for (int k = tid; k < M; k += blockDim.x) s_base[k] = base[k];
    if (tid < (head ? 1 : 3)) s_scale[tid] = scale[tid];
    if (norm_w) nw = __ldg(norm_w + d);
    scale = s_scale;  // read after the __syncthreads below
    base = s_base;
  }
  pdl_wait();
  float x[n];
  const float* Xt = X + (int64_t)t * nD;
#pragma unroll
  for (int i = 0; i < n; ++i) x[i] = __ldg(Xt + (int64_t)i * D + d);
  if (hp.y1) {  // X' = post_b (y1 + y2) + sum_a comb[a, b] X[a], hc_post_cols' operations
    float y = __ldg(hp.y1 + (int64_t)t * D + d);
    if (hp.y2) y += __ldg(hp.y2 + (int64_t)t * D + d);
    float xn[n];
#pragma unroll
    for (int i = 0; i < n; ++i) {
      float sum = 0.0f;
#pragma unroll
      for (int a = 0; a < n; ++a) sum += hp.comb[((int64_t)t * n + a) * n + i] * x[a];
      xn[i] = hp.post[(int64_t)t * n + i] * y + sum;
    }
#pragma unroll
    for (int i = 0; i < n; ++i) {
      x[i] = xn[i];
      hp.Xo[(int64_t)t * nD + (int64_t)i * D + d] = x[i];
    }
  }
  float v[32], v2[HCC_Q - 32 > 0 ? HCC_Q - 32 : 1];
#pragma unroll
  for (int m = 0; m < HCC_MAX_M; ++m) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < n; ++i) sum += w[m][i] * x[i];
    v[m] = sum;
  }
  v[HCC_MAX_M] = (x[0] * x[0] + x[1] * x[1]) + (x[2] * x[2] + x[3] * x[3]);
  // the Gram matrix's upper triangle in the order (0,0) (0,1) (0,2) (0,3) (1,1) (1,2) (1,3) (2,2) (2,3) (3,3)
  v[25] = x[0] * x[0], v[26] = x[0] * x[1], v[27] = x[0] * x[2], v[28] = x[0] * x[3], v[29] = x[1] * x[1];
  v[30] = x[1] * x[2], v[31] = x[1] * x[3], v2[0] = x[2] * x[2], v2[1] = x[2] * x[3], v2[2] = x[3] * x[3];
  const float mine = warp_reduce_scatter32(v);
  s_warp[warp][lane] = mine;
#pragma unroll
  for (int k = 0; k < HCC_Q - 32; ++k) {
    const float e = warp_sum_f(v2[k]);
    if (lane == 0) s_warp[warp][32 + k] = e;
  }
  __syncthreads();
  for (int k = tid; k < HCC_Q; k += blockDim.x) {  // a loop: a CTA of one warp (D = 512) has fewer threads than HCC_Q
    float sum = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) sum += s_warp[w][k];
#pragma unroll
    for (int r = 0; r < HCC_CTAS; ++r) cluster.map_shared_rank(&s_all[0][0], r)[c * HCC_Q + k] = sum;
  }
  cluster.sync();  // every CTA's partials are in every CTA (release / acquire at cluster scope)
  for (int k = tid; k < HCC_Q; k += blockDim.x) {
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < HCC_CTAS; ++r) sum += s_all[r][k];  // the same order in every CTA: the same totals
    s_tot[k] = sum;
  }
  __syncthreads();
  const float r = rsqrtf(s_tot[HCC_MAX_M] / (float)nD + eps_rms);
  float pre[n];
#pragma unroll
  for (int i = 0; i < n; ++i) pre[i] = sigmoidf_(s_tot[i] * r * scale[0] + base[i]) + eps_hc;
  float u = 0.0f;
#pragma unroll
  for (int i = 0; i < n; ++i) u += pre[i] * x[i];
  const float* G = s_tot + HCC_MAX_M + 1;  // pre^T G pre = sum_d u_d^2
  const float su = (pre[0] * pre[0] * G[0] + pre[1] * pre[1] * G[4]) + (pre[2] * pre[2] * G[7] + pre[3] * pre[3] * G[9]) +
                   2.0f * ((pre[0] * pre[1] * G[1] + pre[0] * pre[2] * G[2]) + (pre[0] * pre[3] * G[3] + pre[1] * pre[2] * G[5]) +
                           (pre[1] * pre[3] * G[6] + pre[2] * pre[3] * G[8]));
  const float r2 = rsqrtf(su / (float)D + eps_rms);
  const float o = u * r2 * (early ? nw : (norm_w ? __ldg(norm_w + d) : 1.0f));
  out[(int64_t)t * D + d] = o;
  if (hp.ring) hp.ring[(*hp.ring_pos % hp.ring_r) * D + d] = o;  // T = 1 (the launcher checks); after the wait
  if (c == 0 && warp == 0 && !head) {  // post and comb, after this warp's out columns
    if (lane < n) post_out[(int64_t)t * n + lane] = 2.0f * sigmoidf_(s_tot[n + lane] * r * scale[1] + base[n + lane]);
    if (logits_out) {  // deferred: sinkhorn4_kernel runs Sinkhorn from these
      if (lane < 16) logits_out[(int64_t)t * 16 + lane] = comb_logit(s_tot, r, scale[2], base, lane);
    } else if (lane == 0) {
      sinkhorn4(s_tot, r, scale[2], base, iters, eps_hc, comb_out + (int64_t)t * 16, rcp);
    }
  }
}

}  // namespace

// $DS4_GPU_HC_CLUSTER (default 1 since v22; 0 the arrival-count kernel): decode's one-launch mHC pre as hc_cluster_kernel
// (one cluster of 16 CTAs per token). v22: bench_hc 7.09 -> 5.52 us at 0 Sinkhorn iterations, 8.20 -> 6.94 at 20;
// decode 6.51 / 6.60 -> 6.40 / 6.48 ms at 2k / 8k. set_hc_cluster overrides it (0, 1; -1 the environment). Taken where the device can place a cluster
// of 16 (non-portable size) and n = 4, D / 16 a multiple of 32 of at most 256 columns, M <= 24.
static int& hc_cluster_override() {
  static int v = -1;
  return v;
}
void set_hc_cluster(int mode) { hc_cluster_override() = mode == 0 || mode == 1 ? mode : -1; }
static bool hc_cluster_available() {
  static const bool ok = cluster_fits(hc_cluster_kernel, HCC_CTAS, HCC_MAX_THREADS);
  return ok;
}
bool hc_cluster_takes(int n, int D, int M) {
  static const bool env = [] {
    const char* e = getenv("DS4_GPU_HC_CLUSTER");
    return !(e && e[0] == '0');
  }();
  const bool on = hc_cluster_override() >= 0 ? hc_cluster_override() == 1 : env;
  const int dc = D / HCC_CTAS;
  return on && n == 4 && M <= HCC_MAX_M && D % HCC_CTAS == 0 && dc % 32 == 0 && dc <= HCC_MAX_THREADS &&
         hc_cluster_available();
}
void launch_hc_cluster(const float* X, const float* Wf, int M, const float* scale, const float* base,
                       const float* norm_w, int T, int D, int iters, float eps_rms, float eps_hc, bool head,
                       float* out, float* post, float* comb, const HcPost& hp, cudaStream_t s, float* logits) {
  launch_k(hc_cluster_kernel, dim3(HCC_CTAS, T), dim3(D / HCC_CTAS), 0, s, X, Wf, M, scale, base, norm_w, D, iters,
           eps_rms, eps_hc, head, out, post, comb, hp, hc_rcp(), logits, prewait_mode() >= 2);
  DS4_CHECK_LAUNCH("hc_cluster");
}

}  // namespace ds4gpu
