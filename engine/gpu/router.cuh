// The MoE router (model-spec §3.7 steps 1-3) shared by router_kernel (fused.cu: logits from an earlier
// kernel, one CTA per token) and router_one_kernel (router.cu: the F16 router matvec and the routing of the
// decode token in one launch), and the host launcher of the latter.
//
// The device part is compiled only by nvcc for .cu files (__CUDACC__); bindings.cpp (host C++) sees the
// launcher's declaration.
#pragma once

#include "common.cuh"

namespace ds4gpu {

constexpr int ROUTER_MAX_E = 256;  // experts: one shared-memory slot each
constexpr int ROUTER_MAX_K = 16;   // experts per token

// router.cu, decode (one token): logits = w . x through the F16 streaming matvec's building blocks (the bits of
// ext.matvec's batch-1 F16 launch), then, in the last CTA of the grid to finish, the routing of router_kernel on
// those logits: ids/wts [k]. bias (E) and table ([vocab, k], with tok[0]) as for launch_router. False, with
// nothing launched, where that matvec would not run the streaming kernel for w (DS4_GPU_MV < 4, not F16, widths
// it does not take, x not 16-byte aligned) or E > 256, k outside 1..16. One decode stream per device: the
// CTAs' arrival count is one device variable (it returns to 0 at the end of every launch, so graph replays work).
// router.cu: $DS4_GPU_ROUTER_CLUSTER (launch_router_one as one cluster of 16 CTAs: 1 on, 0 off, -1 the environment),
// and whether it takes a router of E experts and K columns now.
void set_router_cluster(int mode);
bool router_cluster_takes(int E, int K);
bool launch_router_one(const Packed& w, const float* x, float* logits, const float* bias, const int64_t* table,
                       const int64_t* tok, int k, float scale, int32_t* ids, float* wts, cudaStream_t stream);

#if defined(__CUDACC__)
// Routing of token t by the whole calling CTA (any blockDim.x that is a multiple of 32; experts e = tid,
// tid + blockDim.x, ...): s = sqrt(softplus(logit)), ids = top-k of s + bias (or table[tok[t]] on hash layers),
// w = s[ids] / max(sum, 6.1035e-5) * scale. Top-k by rank: expert e's rank is the number of experts ahead of it
// (larger biased score, or equal and a lower index), so chosen[rank] = e gives the order of k successive argmax
// passes. NaN scores rank last (as -inf, lowest index first). The outcome does not depend on blockDim.x: each
// expert's score and rank are computed alone, and thread 0 sums the k weights in rank order.
// COH: the logits were written by other CTAs of the calling grid, so they are read from L2 (__ldcg).
template <bool COH>
__device__ __forceinline__ void route_token(const float* logits, const float* bias, const int64_t* table,
                                            const int64_t* tok, int t, int E, int k, float scale, int32_t* ids,
                                            float* wts) {
  __shared__ float s[ROUTER_MAX_E];
  __shared__ __align__(16) float sb[ROUTER_MAX_E];
  __shared__ int chosen[ROUTER_MAX_K];
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int e = tid; e < ROUTER_MAX_E; e += nt) {
    sb[e] = -INFINITY;  // padding past E never ranks ahead
    if (e < E) {
      const float* p = logits + (int64_t)t * E + e;
      const float x = COH ? __ldcg(p) : *p;
      const float sp = x > 20.0f ? x : log1pf(expf(x));
      s[e] = sqrtf(sp);
      const float b = bias ? s[e] + bias[e] : s[e];
      sb[e] = isnan(b) ? -INFINITY : b;  // scores are >= 0 and biases finite, so -inf only marks NaN
    }
  }
  if (tid < k) chosen[tid] = -1;
  __syncthreads();
  if (table) {
    if (tid < k) chosen[tid] = (int)table[tok[t] * k + tid];
  } else {
    for (int e = tid; e < E; e += nt) {
      const float me = sb[e];
      int r0 = 0, r1 = 0, r2 = 0, r3 = 0;  // four counters: independent chains
      const float4* sb4 = (const float4*)sb;
      for (int j4 = 0; j4 < (E + 3) / 4; ++j4) {
        const float4 o = sb4[j4];
        const int j = 4 * j4;
        r0 += o.x > me || (o.x == me && j < e);
        r1 += o.y > me || (o.y == me && j + 1 < e);
        r2 += o.z > me || (o.z == me && j + 2 < e);
        r3 += o.w > me || (o.w == me && j + 3 < e);
      }
      const int rank = r0 + r1 + r2 + r3;
      if (rank < k) chosen[rank] = e;
    }
  }
  __syncthreads();
  if (tid == 0) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int c = chosen[j];
      sum += (c >= 0 && c < E) ? s[c] : 0.0f;
    }
    const float den = fmaxf(sum, 6.1035e-5f);
    for (int j = 0; j < k; ++j) {
      const int c = chosen[j];
      ids[(int64_t)t * k + j] = c;
      wts[(int64_t)t * k + j] = (c >= 0 && c < E) ? s[c] / den * scale : 0.0f;
    }
  }
}
#endif

}  // namespace ds4gpu
