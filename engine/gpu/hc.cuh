// mHC pieces shared by hc.cu (the arrival-count and prefill kernels) and hc_cluster.cu (decode's cluster kernel): the
// previous sublayer's post as the pre kernels take it, Sinkhorn in one thread, and the host switches both read.
#pragma once

#include "common.cuh"

namespace ds4gpu {

// The previous sublayer's mHC post, applied by hc_mix_pre_kernel while it reads X (y1 null: none).
struct HcPost {
  const float* y1 = nullptr;
  const float* y2 = nullptr;
  const float* post = nullptr;
  const float* comb = nullptr;
  float* Xo = nullptr;  // X' = post(X), [T, n, D]
  // decode (T = 1): out also into row pos % ring_r of ring [ring_r, D] (comp_defer's ring of the layer's compressor
  // inputs), so no launch of its own copies it there; only hc_cluster_kernel writes it
  float* ring = nullptr;
  const int64_t* ring_pos = nullptr;
  int ring_r = 0;
};

#if defined(__CUDACC__)
// comb = Sinkhorn(softmax rows of the 4 x 4 logits) with hc_pre_kernel's arithmetic, in one thread.
// rcp ($DS4_GPU_HC_RCP, default 1 since v22): each row / column sum's reciprocal by rcp.approx (one MUFU.RCP) and four
// multiplies. __fdividef(v, y) is div.approx.f32, v * (1 / y) with that approximate reciprocal plus a range check for
// |y| >= 2^126 (FSETP, FSEL and two more multiplies per sum in the SASS); the sums here are normal floats near 1, so the
// products are the same bits. Why: this one thread is the last CTA's tail (v21 SASS: ~128 instructions per iteration,
// 20 iterations, one dependent chain), and the next kernel waits for the whole grid; python -m ds4.engine.gpu.bench_hc
// times the kernel at 0, 1 and 20 iterations.
__device__ __forceinline__ float rcp_approx(float y) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
}
// Comb logit i (entry 4 a + b) of the mix, and all 16.
__device__ __forceinline__ float comb_logit(const float* mixs, float r, float sc, const float* base, int i) {
  return mixs[8 + i] * r * sc + base[8 + i];
}
__device__ __forceinline__ void comb_logits(const float* mixs, float r, float sc, const float* base, float (&l)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) l[i] = comb_logit(mixs, r, sc, base, i);
}
__device__ __forceinline__ void sinkhorn4_of(const float (&lg)[16], int iters, float eps, float* comb, bool rcp) {
  float v[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    float l[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) l[b] = lg[4 * a + b];
    const float mx = fmaxf(fmaxf(l[0], l[1]), fmaxf(l[2], l[3]));
    float e[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) e[b] = expf(l[b] - mx);
    const float s = (e[0] + e[1]) + (e[2] + e[3]);
#pragma unroll
    for (int b = 0; b < 4; ++b) v[a][b] = e[b] / s + eps;
  }
  for (int it = 0; it < iters && rcp; ++it) {
    if (it > 0) {
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const float inv = rcp_approx((v[a][0] + v[a][1]) + (v[a][2] + v[a][3]) + eps);
#pragma unroll
        for (int b = 0; b < 4; ++b) v[a][b] *= inv;
      }
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float inv = rcp_approx((v[0][b] + v[1][b]) + (v[2][b] + v[3][b]) + eps);
#pragma unroll
      for (int a = 0; a < 4; ++a) v[a][b] *= inv;
    }
  }
  for (int it = 0; it < iters && !rcp; ++it) {
    if (it > 0) {
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const float s = (v[a][0] + v[a][1]) + (v[a][2] + v[a][3]);
#pragma unroll
        for (int b = 0; b < 4; ++b) v[a][b] = __fdividef(v[a][b], s + eps);
      }
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float s = (v[0][b] + v[1][b]) + (v[2][b] + v[3][b]);
#pragma unroll
      for (int a = 0; a < 4; ++a) v[a][b] = __fdividef(v[a][b], s + eps);
    }
  }
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) comb[4 * a + b] = v[a][b];
}
__device__ __forceinline__ void sinkhorn4(const float* mixs, float r, float sc, const float* base, int iters,
                                          float eps, float* comb, bool rcp) {
  float l[16];
  comb_logits(mixs, r, sc, base, l);
  sinkhorn4_of(l, iters, eps, comb, rcp);
}
#endif

// hc.cu: $DS4_GPU_HC_RCP as set_hc_rcp left it (the one-thread Sinkhorn by reciprocals).
bool hc_rcp();
// hc_cluster.cu: decode's one-launch mHC pre as one cluster of 16 CTAs per token (hc_cluster_takes: whether it runs).
void launch_hc_cluster(const float* X, const float* Wf, int M, const float* scale, const float* base,
                       const float* norm_w, int T, int D, int iters, float eps_rms, float eps_hc, bool head, float* out,
                       float* post, float* comb, const HcPost& hp, cudaStream_t s, float* logits = nullptr);

}  // namespace ds4gpu
