// mHC kernels of a DeepSeek V4 layer (model-spec §3.3): the pre (mix of the n residual streams, Sinkhorn
// weights, weighted sum and RMS norm of a sublayer's input) and the post (streams updated from a sublayer's
// output). Each mirrors ds4.engine.gpu.ops operation for operation; only summation orders differ.
#include <math.h>

#include <cstdlib>

#include "block_ops.cuh"
#include "common.cuh"
#include "hc.cuh"

namespace ds4gpu {

namespace {

// mHC pre, pass 1 (model-spec §3.3): block (p, t) takes columns [256 p, 256 p + 256) of flatten(X_t)
// and writes the partial products of the M mix rows and the partial sum of squares:
// part[t][p][m] for m < M, part[t][p][M] = sum x^2. One block per 256 columns keeps ~P = nD / 256
// blocks streaming the 1.5 MB weight at once (one block streaming it ran ~10 us on one SM).
// Warp w owns rows w, w + 8, ...; lane l columns 8 l .. 8 l + 7 of the slice.
constexpr int HC_COLS = 256;
// Columns c0 .. c0 + 7 of flatten(X'_t) with X' = post_b (y1 + y2) + sum_a comb[a, b] X[a] (hc_post_kernel's
// arithmetic, operation for operation); warp 0 writes them to Xo. n <= 4, D a multiple of 8.
__device__ __forceinline__ void hc_post_cols(const float* X, const HcPost& hp, int n, int D, int t, int c0,
                                             float (&x)[8]) {
  const int i = c0 / D, d = c0 - i * D;
  const float* yr = hp.y1 + (int64_t)t * D + d;
  float y[8], xa[4][8];
  {
    const float4 a = __ldg((const float4*)yr), b = __ldg((const float4*)(yr + 4));
    y[0] = a.x; y[1] = a.y; y[2] = a.z; y[3] = a.w; y[4] = b.x; y[5] = b.y; y[6] = b.z; y[7] = b.w;
  }
  if (hp.y2) {
    const float* y2r = hp.y2 + (int64_t)t * D + d;
    const float4 a = __ldg((const float4*)y2r), b = __ldg((const float4*)(y2r + 4));
    y[0] += a.x; y[1] += a.y; y[2] += a.z; y[3] += a.w; y[4] += b.x; y[5] += b.y; y[6] += b.z; y[7] += b.w;
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (a < n) {
      const float* xr = X + ((int64_t)t * n + a) * D + d;
      const float4 u = __ldg((const float4*)xr), v = __ldg((const float4*)(xr + 4));
      xa[a][0] = u.x; xa[a][1] = u.y; xa[a][2] = u.z; xa[a][3] = u.w;
      xa[a][4] = v.x; xa[a][5] = v.y; xa[a][6] = v.z; xa[a][7] = v.w;
    }
  }
  const float pb = hp.post[(int64_t)t * n + i];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float s = 0.0f;
#pragma unroll
    for (int a = 0; a < 4; ++a)
      if (a < n) s += hp.comb[((int64_t)t * n + a) * n + i] * xa[a][j];
    x[j] = pb * y[j] + s;
  }
  if (threadIdx.x < 32) {
    float* o = hp.Xo + (int64_t)t * n * D + c0;
    *(float4*)o = make_float4(x[0], x[1], x[2], x[3]);
    *(float4*)(o + 4) = make_float4(x[4], x[5], x[6], x[7]);
  }
}

// Rows m0, m0 + 8, m0 + 16, m0 + 24 of the mix weights at this lane's 8 columns of slice p (0 past M or nD).
__device__ __forceinline__ void hc_mix_load_w(const float* Wf, int M, int nD, int p, int m0, float (&w)[4][8]) {
  const int c0 = p * HC_COLS + (threadIdx.x & 31) * 8;
  const bool full = c0 + 8 <= nD;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int m = m0 + 8 * j;
    const float* wr = Wf + (int64_t)m * nD + c0;
    if (m < M && full) {
      float4 a = __ldg((const float4*)wr), b = __ldg((const float4*)(wr + 4));
      w[j][0] = a.x; w[j][1] = a.y; w[j][2] = a.z; w[j][3] = a.w;
      w[j][4] = b.x; w[j][5] = b.y; w[j][6] = b.z; w[j][7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) w[j][i] = (m < M && c0 + i < nD) ? wr[i] : 0.0f;
    }
  }
}

// w0: the warp's first rows (m0 = warp), loaded by the caller (hc_mix_load_w); the mix weights never depend
// on earlier kernels, so the one-launch kernel issues those loads before it waits for its predecessor.
__device__ __forceinline__ void hc_mix_block(const float* X, const float* Wf, int M, int nD, int P, float* part,
                                             int p, int t, const float (&w0)[4][8], const HcPost& hp = HcPost(),
                                             int n = 0, int D = 0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = p * HC_COLS + lane * 8;
  const bool full = c0 + 8 <= nD;
  float x[8];
  const float* Xt = X + (int64_t)t * nD;
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = 0.0f;
  if (hp.y1) {
    if (full) hc_post_cols(X, hp, n, D, t, c0, x);
  } else if (full) {
    float4 a = __ldg((const float4*)(Xt + c0)), b = __ldg((const float4*)(Xt + c0 + 4));
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  } else {
    for (int i = 0; i < 8; ++i)
      if (c0 + i < nD) x[i] = Xt[c0 + i];
  }
  float* out = part + ((int64_t)t * P + p) * (M + 1);
  if (warp == 0) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += x[i] * x[i];
    ss = warp_sum_f(ss);
    if (lane == 0) out[M] = ss;
  }
  for (int m0 = warp; m0 < M; m0 += 32) {  // up to 4 rows per warp, all loads issued before use
    float w[4][8];
    if (m0 == warp) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) w[j][i] = w0[j][i];
    } else {
      hc_mix_load_w(Wf, M, nD, p, m0, w);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) s += w[j][i] * x[i];
      s = warp_sum_f(s);
      if (lane == 0 && m0 + 8 * j < M) out[m0 + 8 * j] = s;
    }
  }
}
__global__ void __launch_bounds__(256) hc_mix_kernel(const float* X, const float* Wf, int M, int nD, int P,
                                                     float* part) {
  pdl_trigger();
  float w0[4][8];  // weights: requested before the wait for the predecessor
  hc_mix_load_w(Wf, M, nD, blockIdx.x, threadIdx.x >> 5, w0);
  pdl_wait();
  hc_mix_block(X, Wf, M, nD, P, part, blockIdx.x, blockIdx.y, w0);
}

// mHC pre, pass 2, token blockIdx.x (1024 threads): mix = sum of the P partials (warp m sums row m),
// RMS of flatten(X) applied to the un-normalized mix; head = false: pre/post/comb with Sinkhorn;
// head = true: pre only (output head). out = rms_norm(sum_i pre_i X_i) * norm_w, float4 columns.
constexpr int HC_THREADS = 1024;
constexpr int HC_MAXU = 4;  // float4 columns per thread: D <= 16384
__global__ void __launch_bounds__(HC_THREADS) hc_pre_kernel(const float* X, const float* part, int P,
                                                            const float* scale, const float* base,
                                                            const float* norm_w, int n, int D, int iters,
                                                            float eps_rms, float eps_hc, bool head, float* out,
                                                            float* post_out, float* comb_out) {
  pdl_begin();
  __shared__ float red[32];
  __shared__ float mixs[8 * 10 + 1];
  __shared__ float pre[16], comb[64];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* Xt = X + (int64_t)t * n * D;
  const int M = head ? n : (2 + n) * n;
  const int D4 = D / 4;
  float4 x0[4];  // the first float4 column of up to 4 streams, requested before the weights are known
  const bool pre0 = n <= 4 && threadIdx.x < D4;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (pre0 && i < n) x0[i] = __ldg((const float4*)(Xt + (int64_t)i * D) + threadIdx.x);
  for (int m = warp; m <= M; m += HC_THREADS / 32) {
    const float* pm = part + (int64_t)t * P * (M + 1) + m;
    float v = 0.0f;
    for (int p = lane; p < P; p += 32) v += pm[(int64_t)p * (M + 1)];
    v = warp_sum_f(v);
    if (lane == 0) mixs[m] = v;
  }
  __syncthreads();
  const float r = rsqrtf(mixs[M] / (float)(n * D) + eps_rms);
  // weights on warp 0, one lane per pre/post entry and per comb entry (a, b) = (lane / n, lane % n)
  if (threadIdx.x < 32) {
    const float* m = mixs;
    if (lane < n) pre[lane] = sigmoidf_(m[lane] * r * scale[0] + base[lane]) + eps_hc;
    if (!head) {
      if (lane < n) post_out[(int64_t)t * n + lane] = 2.0f * sigmoidf_(m[n + lane] * r * scale[1] + base[n + lane]);
      if (n == 4) {  // comb on 16 lanes (a, b) = (lane / 4, lane % 4): sums by xor shuffles, no barriers
        const int l = lane & 15;  // lanes 16-31 mirror 0-15
        float v = m[8 + l] * r * scale[2] + base[8 + l];
        float mx = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float e = expf(v - mx);
        float s = e + __shfl_xor_sync(0xffffffffu, e, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        v = e / s + eps_hc;
        for (int it = 0; it < iters; ++it) {  // fast divisions (~2 ulp): 40 IEEE ones were ~3 us
          if (it > 0) {  // rows (sum over b)
            s = v + __shfl_xor_sync(0xffffffffu, v, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            v = __fdividef(v, s + eps_hc);
          }
          s = v + __shfl_xor_sync(0xffffffffu, v, 4);  // columns (sum over a)
          s += __shfl_xor_sync(0xffffffffu, s, 8);
          v = __fdividef(v, s + eps_hc);
        }
        if (lane < 16) comb_out[(int64_t)t * 16 + lane] = v;
      } else {
      const bool own = lane < n * n;
      const int a = own ? lane / n : 0, b = own ? lane % n : 0;
      float v = own ? m[2 * n + lane] * r * scale[2] + base[2 * n + lane] : 0.0f;
      if (own) comb[lane] = v;
      __syncwarp();
      float mx = -INFINITY;
      for (int j = 0; j < n; ++j) mx = fmaxf(mx, comb[a * n + j]);
      __syncwarp();
      float e = expf(v - mx);
      if (own) comb[lane] = e;
      __syncwarp();
      float s = 0.0f;
      for (int j = 0; j < n; ++j) s += comb[a * n + j];
      v = e / s + eps_hc;
      for (int it = 0; it < iters; ++it) {
        if (it > 0) {  // rows (sum over b)
          __syncwarp();
          if (own) comb[lane] = v;
          __syncwarp();
          s = 0.0f;
          for (int j = 0; j < n; ++j) s += comb[a * n + j];
          v = v / (s + eps_hc);
        }
        __syncwarp();  // columns (sum over a)
        if (own) comb[lane] = v;
        __syncwarp();
        s = 0.0f;
        for (int j = 0; j < n; ++j) s += comb[j * n + b];
        v = v / (s + eps_hc);
      }
      if (own) comb_out[(int64_t)t * n * n + lane] = v;
      }
    }
  }
  __syncthreads();
  float4 u[HC_MAXU];
  float su = 0.0f;
#pragma unroll
  for (int k = 0; k < HC_MAXU; ++k) {
    const int d4 = threadIdx.x + k * HC_THREADS;
    u[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (d4 < D4) {
      float4 xs[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)  // all streams in flight before the sum
        if (i < n) xs[i] = (k == 0 && pre0 && i < 4) ? x0[i < 4 ? i : 0] : __ldg((const float4*)(Xt + (int64_t)i * D) + d4);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i < n) {
          u[k].x += pre[i] * xs[i].x; u[k].y += pre[i] * xs[i].y;
          u[k].z += pre[i] * xs[i].z; u[k].w += pre[i] * xs[i].w;
        }
      su += u[k].x * u[k].x + u[k].y * u[k].y + u[k].z * u[k].z + u[k].w * u[k].w;
    }
  }
  su = block_sum(su, red);
  const float r2 = rsqrtf(su / (float)D + eps_rms);
#pragma unroll
  for (int k = 0; k < HC_MAXU; ++k) {
    const int d4 = threadIdx.x + k * HC_THREADS;
    if (d4 < D4) {
      float4 w = norm_w ? __ldg((const float4*)norm_w + d4) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
      float4 o = norm_w ? make_float4(u[k].x * r2 * w.x, u[k].y * r2 * w.y, u[k].z * r2 * w.z, u[k].w * r2 * w.w)
                        : make_float4(u[k].x * r2, u[k].y * r2, u[k].z * r2, u[k].w * r2);
      ((float4*)(out + (int64_t)t * D))[d4] = o;
    }
  }
}

// mHC pre in one launch (decode): the blocks of hc_mix_kernel, and the last block of a token to finish
// (atomic count; the count is reset for the next launch or graph replay) does pass 2 with 256 threads.
// With hp.y1 the blocks first apply the previous sublayer's mHC post to their columns (and write X'),
// so hc_post needs no launch of its own. Pass 2: the partials are read once, coalesced, into shared
// memory (other blocks wrote them during this kernel: ld.global.cg); the last warp computes post and
// comb, Sinkhorn in one thread's registers (the 4 x 4 sums in the xor-shuffle order of hc_pre_kernel,
// without its ~40 dependent shuffles), while the other 7 warps form out: nothing waits for comb, so
// out's norm uses named barriers among those 224 threads, each of which computes the n pre weights itself.
constexpr int HC1_THREADS = 256, HC1_COLS = HC1_THREADS - 32, HC1_MAXU = 5;  // D <= 4 * 5 * 224 = 4480
constexpr int HC1_MAX_T = 64;
constexpr int HC1_MAX_PART = 72 * 25;  // P x (M + 1): P <= 4 * 4480 / 256 = 70, M + 1 <= 25
// Arrival counts per token, one set per device: launches of this kernel must not run concurrently (one stream
// per device, as the session uses; PDL keeps launches on one stream apart: each waits for the previous grid).
__device__ unsigned g_hc_count[HC1_MAX_T];

__device__ __forceinline__ float cols_sum(float v, float* sh) {  // sum over the HC1_COLS column threads
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum_f(v);
  if (lane == 0) sh[warp] = v;
  asm volatile("bar.sync 1, %0;" ::"r"(HC1_COLS) : "memory");
  float t = 0.0f;
#pragma unroll
  for (int i = 0; i < HC1_COLS / 32; ++i) t += sh[i];
  return t;
}

// $DS4_GPU_HC_DEFER=1 (v22): decode's mHC kernel writes comb's 16 logits (logits_out) and this kernel, launched by the
// session on a stream of its own, runs Sinkhorn from them (one block of one warp per token). comb is read only by the
// next sublayer's mHC, so its 20 dependent iterations leave the decode chain; the same arithmetic on the same logits,
// so the same bits. (v21 measured no gain with hc_mix_pre_kernel, whose last warp ran Sinkhorn beside the block's out
// pass; in hc_cluster_kernel it is the tail: bench_hc 5.52 us at 0 iterations, 6.94 at 20.)
__global__ void sinkhorn4_kernel(const float* logits, int iters, float eps, bool rcp, float* comb) {
  pdl_begin();
  if (threadIdx.x != 0) return;
  const int t = blockIdx.x;
  float l[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) l[i] = logits[16 * t + i];
  sinkhorn4_of(l, iters, eps, comb + 16 * t, rcp);
}

// The end of both pass-2 forms, once r (the RMS factor of flatten(X)) and the mix (mixs) are known: the last warp writes
// post and comb (Sinkhorn in one thread) while the HC1_COLS column threads, which hold their columns of the n <= 4
// streams in xs, form out = rms_norm(sum_i pre_i X_i) * norm_w without waiting for it.
__device__ __forceinline__ void hc1_finish(const float4 (&xs)[HC1_MAXU][4], const float* mixs, float r,
                                           const float* scale, const float* base, const float* norm_w, int n, int D,
                                           int iters, float eps_rms, float eps_hc, bool head, int t, float* out,
                                           float* post_out, float* comb_out, float* red, bool rcp,
                                           float* logits_out = nullptr) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, D4 = D / 4;
  if (warp == HC1_THREADS / 32 - 1) {  // post and comb; the column threads do not wait for this warp
    if (head) return;
    if (lane < n) post_out[(int64_t)t * n + lane] = 2.0f * sigmoidf_(mixs[n + lane] * r * scale[1] + base[n + lane]);
    if (logits_out) {  // deferred: sinkhorn4_kernel runs Sinkhorn from these
      if (lane < 16) logits_out[(int64_t)t * 16 + lane] = comb_logit(mixs, r, scale[2], base, lane);
    } else if (lane == 0) {
      sinkhorn4(mixs, r, scale[2], base, iters, eps_hc, comb_out + (int64_t)t * 16, rcp);
    }
    return;
  }
  float pre[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pre[i] = i < n ? sigmoidf_(mixs[i] * r * scale[0] + base[i]) + eps_hc : 0.0f;
  float4 u[HC1_MAXU];
  float su = 0.0f;
#pragma unroll
  for (int k = 0; k < HC1_MAXU; ++k) {
    u[k] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u[k].x += pre[i] * xs[k][i].x; u[k].y += pre[i] * xs[k][i].y;
      u[k].z += pre[i] * xs[k][i].z; u[k].w += pre[i] * xs[k][i].w;
    }
    su += u[k].x * u[k].x + u[k].y * u[k].y + u[k].z * u[k].z + u[k].w * u[k].w;
  }
  su = cols_sum(su, red);
  const float r2 = rsqrtf(su / (float)D + eps_rms);
#pragma unroll
  for (int k = 0; k < HC1_MAXU; ++k) {
    const int d4 = tid + k * HC1_COLS;
    if (d4 < D4) {
      float4 w = norm_w ? __ldg((const float4*)norm_w + d4) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
      ((float4*)(out + (int64_t)t * D))[d4] =
          make_float4(u[k].x * r2 * w.x, u[k].y * r2 * w.y, u[k].z * r2 * w.z, u[k].w * r2 * w.w);
    }
  }
}

__global__ void __launch_bounds__(HC1_THREADS) hc_mix_pre_kernel(const float* X, const float* Wf, int M, int P,
                                                                 float* part, const float* scale, const float* base,
                                                                 const float* norm_w, int n, int D, int iters,
                                                                 float eps_rms, float eps_hc, bool head, float* out,
                                                                 float* post_out, float* comb_out, HcPost hp,
                                                                 bool rcp, float* logits_out) {
  pdl_trigger();
  float w0[4][8];  // the first mix rows of this warp: weights, so requested before the wait for the predecessor
  hc_mix_load_w(Wf, M, n * D, blockIdx.x, threadIdx.x >> 5, w0);
  pdl_wait();
  __shared__ float s_part[HC1_MAX_PART];
  __shared__ float mixs[8 * 10 + 1];
  __shared__ float red[32];
  __shared__ bool last;
  const int t = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  hc_mix_block(X, Wf, M, n * D, P, part, blockIdx.x, t, w0, hp, n, D);
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(&g_hc_count[t], 1u) == (unsigned)P - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (tid == 0) g_hc_count[t] = 0;
  const int D4 = D / 4;
  const float* Xt = (hp.y1 ? hp.Xo : X) + (int64_t)t * n * D;
  float4 xs[HC1_MAXU][4];  // this thread's columns of the (up to 4) streams, requested before the mix is known
#pragma unroll
  for (int k = 0; k < HC1_MAXU; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d4 = tid + k * HC1_COLS;
      const float4* p4 = (const float4*)(Xt + (int64_t)i * D) + d4;
      xs[k][i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (tid < HC1_COLS && d4 < D4 && i < n) xs[k][i] = hp.y1 ? __ldcg(p4) : __ldg(p4);  // X' is from this kernel
    }
  const int np = P * (M + 1);
  const float* pt = part + (int64_t)t * np;
  for (int i0 = tid; i0 < np; i0 += 8 * HC1_THREADS) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * HC1_THREADS;
      v[u] = i < np ? __ldcg(pt + i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (i0 + u * HC1_THREADS < np) s_part[i0 + u * HC1_THREADS] = v[u];
  }
  __syncthreads();
  for (int m = warp; m <= M; m += HC1_THREADS / 32) {
    float v = 0.0f;
    for (int p = lane; p < P; p += 32) v += s_part[p * (M + 1) + m];
    v = warp_sum_f(v);
    if (lane == 0) mixs[m] = v;
  }
  __syncthreads();
  const float r = rsqrtf(mixs[M] / (float)(n * D) + eps_rms);
  hc1_finish(xs, mixs, r, scale, base, norm_w, n, D, iters, eps_rms, eps_hc, head, t, out, post_out, comb_out, red,
             rcp, logits_out);
}

// mHC pre, pass 2, for prefill rows (the mix from one float32 GEMM, P = 1, no norm column): one 256-thread block per
// token; the 224 column threads hold the token's n <= 4 streams in registers, so the sum of squares of flatten(X)
// comes from them (the GEMM path's separate norm pass over X is gone), and out does not wait for Sinkhorn, which
// the last warp runs beside it (hc_mix_pre_kernel's split). hc_pre_kernel's 1024 threads waited on warp 0's ~40
// dependent shuffles per token: ~435 us per 8192-token call on the H200 (v14 profile).
__global__ void __launch_bounds__(HC1_THREADS, 2) hc_pre_rows_kernel(const float* X, const float* mix,
                                                                     const float* scale, const float* base,
                                                                     const float* norm_w, int n, int D, int M,
                                                                     int iters, float eps_rms, float eps_hc, bool head,
                                                                     float* out, float* post_out, float* comb_out,
                                                                     bool rcp) {
  pdl_begin();
  __shared__ float mixs[8 * 10 + 1];
  __shared__ float red[32];
  const int t = blockIdx.x, tid = threadIdx.x;
  const int D4 = D / 4;
  const float* Xt = X + (int64_t)t * n * D;
  float4 xs[HC1_MAXU][4];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < HC1_MAXU; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d4 = tid + k * HC1_COLS;
      xs[k][i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (tid < HC1_COLS && d4 < D4 && i < n) xs[k][i] = __ldg((const float4*)(Xt + (int64_t)i * D) + d4);
    }
  if (tid < M) mixs[tid] = mix[(int64_t)t * M + tid];
#pragma unroll
  for (int k = 0; k < HC1_MAXU; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      ss += xs[k][i].x * xs[k][i].x + xs[k][i].y * xs[k][i].y + xs[k][i].z * xs[k][i].z + xs[k][i].w * xs[k][i].w;
  ss = block_sum(ss, red);  // its barriers also publish mixs
  const float r = rsqrtf(ss / (float)(n * D) + eps_rms);
  hc1_finish(xs, mixs, r, scale, base, norm_w, n, D, iters, eps_rms, eps_hc, head, t, out, post_out, comb_out, red,
             rcp);
}

// mHC post: X'[b] = post_b (y1 + y2) + sum_a comb[a, b] X[a]; in place is allowed (X' = X).
// r1, r2 (non-null: prefill, v28): y1 and y2 are a GEMM's unscaled products whose per-row rescale (weights.mm_unscaled)
// is applied here, y = y1 r1[t] as the torch multiply would round it (__fmul_rn: never fused into the add that
// follows), so the bits are those of rescaling first; one pass over [T, D] less per product.
__device__ __forceinline__ float hc_y(const float* y, const float* r, int t, int64_t i) {
  return r ? __fmul_rn(y[i], r[t]) : y[i];
}

__global__ void hc_post_kernel(const float* X, const float* y1, const float* y2, const float* post,
                               const float* comb, int n, int D, float* Xo, const float* r1, const float* r2) {
  pdl_begin();
  const int t = blockIdx.y;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float x[16];  // unrolled with guards so x stays in registers (a runtime index put it in local memory)
#pragma unroll
  for (int a = 0; a < 16; ++a) x[a] = a < n ? X[((int64_t)t * n + a) * D + d] : 0.0f;
  float y = hc_y(y1, r1, t, (int64_t)t * D + d);
  if (y2) y += hc_y(y2, r2, t, (int64_t)t * D + d);
  for (int b = 0; b < n; ++b) {
    float s = 0.0f;
#pragma unroll
    for (int a = 0; a < 16; ++a)
      if (a < n) s += comb[((int64_t)t * n + a) * n + b] * x[a];
    Xo[((int64_t)t * n + b) * D + d] = post[(int64_t)t * n + b] * y + s;
  }
}

__device__ __forceinline__ float4 hc_scale4(float4 v, float r) {
  return make_float4(__fmul_rn(v.x, r), __fmul_rn(v.y, r), __fmul_rn(v.z, r), __fmul_rn(v.w, r));
}

// hc_post_kernel for n = 4 streams (Flash, Pro) and aligned rows: 4 columns per thread in float4s, and comb and post
// read into registers before any store (the stores may alias X, so the generic kernel reloads them after each
// store: a dependent L1 round trip per stream). Same operations in the same order: the same bits.
__global__ void hc_post4_kernel(const float* X, const float* y1, const float* y2, const float* post, const float* comb,
                                int D, float* Xo, const float* r1, const float* r2) {
  constexpr int N = 4;
  pdl_begin();
  const int t = blockIdx.y;
  const int d = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (d >= D) return;
  float cb[N][N], pb[N];
#pragma unroll
  for (int a = 0; a < N; ++a) {
    pb[a] = post[(int64_t)t * N + a];
#pragma unroll
    for (int b = 0; b < N; ++b) cb[a][b] = comb[((int64_t)t * N + a) * N + b];
  }
  float x[N][4];
#pragma unroll
  for (int a = 0; a < N; ++a) {
    const float4 v = *(const float4*)(X + ((int64_t)t * N + a) * D + d);
    x[a][0] = v.x; x[a][1] = v.y; x[a][2] = v.z; x[a][3] = v.w;
  }
  float y[4];
  {
    float4 v = *(const float4*)(y1 + (int64_t)t * D + d);
    if (r1) v = hc_scale4(v, r1[t]);
    y[0] = v.x; y[1] = v.y; y[2] = v.z; y[3] = v.w;
  }
  if (y2) {
    float4 v = *(const float4*)(y2 + (int64_t)t * D + d);
    if (r2) v = hc_scale4(v, r2[t]);
    y[0] += v.x; y[1] += v.y; y[2] += v.z; y[3] += v.w;
  }
#pragma unroll
  for (int b = 0; b < N; ++b) {
    float o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int a = 0; a < N; ++a) s += cb[a][b] * x[a][j];
      o[j] = pb[b] * y[j] + s;
    }
    *(float4*)(Xo + ((int64_t)t * N + b) * D + d) = make_float4(o[0], o[1], o[2], o[3]);
  }
}

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------

int hc_parts(int n, int D) { return (n * D + HC_COLS - 1) / HC_COLS; }

// $DS4_GPU_HC_ONE=0: the two-launch hc_pre for decode too (benchmark A/B).
// $DS4_GPU_HC_RCP (default 1 since v22; 0 the fast divisions): sinkhorn4's divisions as one reciprocal per sum and
// multiplies (the same bits, tests/test_gpu_fused.py -k sinkhorn; bench_hc at 20 iterations 8.5 -> 8.0 us, decode
// 6.56 -> 6.53 ms in two calls). set_hc_rcp overrides it for this process (0, 1; -1 the environment).
static int& hc_rcp_override() {
  static int v = -1;
  return v;
}
void set_hc_rcp(int mode) { hc_rcp_override() = mode == 0 || mode == 1 ? mode : -1; }
bool hc_rcp() {
  static const bool env = [] {
    const char* e = getenv("DS4_GPU_HC_RCP");
    return !(e && e[0] == '0');
  }();
  return hc_rcp_override() >= 0 ? hc_rcp_override() == 1 : env;
}

static bool hc_one_launch() {
  static const bool v = [] {
    const char* e = getenv("DS4_GPU_HC_ONE");
    return !(e && e[0] == '0');
  }();
  return v;
}

// $DS4_GPU_HC_ROWS=0: prefill's mHC pre on the v14 form (torch norm pass + hc_pre_kernel), benchmark A/B.
bool hc_pre_rows_takes(int n, int D, bool head) {
  static const bool on = [] {
    const char* e = getenv("DS4_GPU_HC_ROWS");
    return !(e && e[0] == '0');
  }();
  return on && n <= 4 && (head || n == 4) && D % 4 == 0 && D / 4 <= HC1_MAXU * HC1_COLS;
}

bool hc_one_launch_takes(int T, int n, int D, bool head) {
  return hc_one_launch() && T <= HC1_MAX_T && n <= 4 && (head || n == 4) && D % 8 == 0 &&
         D <= 4 * HC1_MAXU * HC1_COLS && hc_parts(n, D) * ((head ? n : (2 + n) * n) + 1) <= HC1_MAX_PART;
}

bool launch_hc_post_pre(const float* X, const float* y1, const float* y2, const float* post_in, const float* comb_in,
                        float* Xo, const float* Wf, float* part, const float* scale, const float* base,
                        const float* norm_w, int T, int n, int D, int iters, float eps_rms, float eps_hc, bool head,
                        float* out, float* post, float* comb, cudaStream_t s, float* logits, float* ring,
                        const int64_t* ring_pos, int ring_r) {
  if (!hc_one_launch_takes(T, n, D, head)) throw std::invalid_argument("hc_post_pre: shape not supported");
  if (ring && (T != 1 || !ring_pos || ring_r < 1))
    throw std::invalid_argument("hc_post_pre: a ring needs T = 1, its position and ring_r >= 1");
  if (logits && (head || n != 4)) throw std::invalid_argument("hc_post_pre: deferred comb logits need n = 4, no head");
  // the blocks read all streams of X at their columns while others write X': never in place
  const uintptr_t o0 = (uintptr_t)Xo, o1 = o0 + sizeof(float) * (size_t)T * n * D;
  auto overlaps = [&](const float* p, int64_t count) {
    const uintptr_t a = (uintptr_t)p;
    return p && a < o1 && o0 < a + sizeof(float) * (size_t)count;
  };
  if (overlaps(X, (int64_t)T * n * D) || overlaps(y1, (int64_t)T * D) || overlaps(y2, (int64_t)T * D) ||
      overlaps(post_in, (int64_t)T * n) || overlaps(comb_in, (int64_t)T * n * n))
    throw std::invalid_argument("hc_post_pre: Xo must not overlap its inputs");
  if (((uintptr_t)X | (uintptr_t)Xo | (uintptr_t)y1 | (uintptr_t)y2) & 15)
    throw std::invalid_argument("hc_post_pre: X, Xo, y1, y2 must be 16-byte aligned (float4 access)");
  HcPost hp;
  hp.y1 = y1;
  hp.y2 = y2;
  hp.post = post_in;
  hp.comb = comb_in;
  hp.Xo = Xo;
  const int M = head ? n : (2 + n) * n, P = hc_parts(n, D);
  if (hc_cluster_takes(n, D, M)) {
    hp.ring = ring;
    hp.ring_pos = ring_pos;
    hp.ring_r = ring_r;
    launch_hc_cluster(X, Wf, M, scale, base, norm_w, T, D, iters, eps_rms, eps_hc, head, out, post, comb, hp, s,
                      logits);
    return ring != nullptr;
  }
  launch_k(hc_mix_pre_kernel, dim3(P, T), dim3(HC1_THREADS), 0, s, X, Wf, M, P, part, scale, base, norm_w, n, D, iters,
           eps_rms, eps_hc, head, out, post, comb, hp, hc_rcp(), logits);
  DS4_CHECK_LAUNCH("hc_post_pre");
  return false;  // the arrival-count kernel leaves the ring to the caller
}

void launch_sinkhorn4(const float* logits, int T, int iters, float eps, float* comb, cudaStream_t s) {
  if (T < 1 || iters < 0) throw std::invalid_argument("sinkhorn4: T >= 1 and iters >= 0");
  launch_k(sinkhorn4_kernel, dim3(T), dim3(32), 0, s, logits, iters, eps, hc_rcp(), comb);
  DS4_CHECK_LAUNCH("sinkhorn4");
}

void launch_hc_pre(const float* X, const float* Wf, float* part, const float* scale, const float* base,
                   const float* norm_w, int T, int n, int D, int iters, float eps_rms, float eps_hc, bool head,
                   float* out, float* post, float* comb, cudaStream_t s, int parts) {
  if (n > 8) throw std::invalid_argument("hc_pre: at most 8 streams");
  if (D % 4 || D > 4 * HC_MAXU * HC_THREADS) throw std::invalid_argument("hc_pre: D must be a multiple of 4, <= 16384");
  const int M = head ? n : (2 + n) * n;
  if (parts < 0) {  // prefill rows: part is the mix [T, M] from one GEMM, without the norm column
    if (!hc_pre_rows_takes(n, D, head)) throw std::invalid_argument("hc_pre: rows form does not take this shape");
    launch_k(hc_pre_rows_kernel, dim3(T), dim3(HC1_THREADS), 0, s, X, (const float*)part, scale, base, norm_w, n, D, M,
             iters, eps_rms, eps_hc, head, out, post, comb, hc_rcp());
    DS4_CHECK_LAUNCH("hc_pre_rows");
    return;
  }
  int P = parts;
  if (P == 0) {
    P = hc_parts(n, D);
    if ((n * D) % 8) throw std::invalid_argument("hc_pre: n * D must be a multiple of 8");
    if (hc_one_launch_takes(T, n, D, head) && hc_cluster_takes(n, D, M)) {
      launch_hc_cluster(X, Wf, M, scale, base, norm_w, T, D, iters, eps_rms, eps_hc, head, out, post, comb, HcPost(), s);
      return;
    }
    if (hc_one_launch_takes(T, n, D, head)) {
      launch_k(hc_mix_pre_kernel, dim3(P, T), dim3(HC1_THREADS), 0, s, X, Wf, M, P, part, scale, base, norm_w, n, D,
               iters, eps_rms, eps_hc, head, out, post, comb, HcPost(), hc_rcp(), (float*)nullptr);
      DS4_CHECK_LAUNCH("hc_mix_pre");
      return;
    }
    launch_k(hc_mix_kernel, dim3(P, T), dim3(256), 0, s, X, Wf, M, n * D, P, part);
    DS4_CHECK_LAUNCH("hc_mix");
  }
  launch_k(hc_pre_kernel, dim3(T), dim3(HC_THREADS), 0, s, X, part, P, scale, base, norm_w, n, D, iters, eps_rms,
           eps_hc, head, out, post, comb);
  DS4_CHECK_LAUNCH("hc_pre");
}

void launch_hc_post(const float* X, const float* y1, const float* y2, const float* post, const float* comb, int T,
                    int n, int D, float* Xo, cudaStream_t s, const float* r1, const float* r2) {
  if (n > 16) throw std::invalid_argument("hc_post: at most 16 streams");
  const auto aligned = [](const void* p) { return ((uintptr_t)p & 15u) == 0; };
  if (n == 4 && D % 4 == 0 && aligned(X) && aligned(y1) && aligned(y2) && aligned(Xo)) {
    launch_k(hc_post4_kernel, dim3((D / 4 + 255) / 256, T), dim3(256), 0, s, X, y1, y2, post, comb, D, Xo, r1, r2);
    DS4_CHECK_LAUNCH("hc_post4");
    return;
  }
  dim3 grid((D + 255) / 256, T);
  launch_k(hc_post_kernel, dim3(grid), dim3(256), 0, s, X, y1, y2, post, comb, n, D, Xo, r1, r2);
  DS4_CHECK_LAUNCH("hc_post");
}

}  // namespace ds4gpu
