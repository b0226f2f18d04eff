// The two ends of a decode step: the token's embedding rows at its head and greedy decode's argmax at its tail.
//
// Why (v32, the CUPTI trace of a 2k step): the step began with three torch launches (the embedding gather, its
// float32 conversion, the n_hc copies of the residual stream: 10.2 us of the step's frontier) and ended with an argmax
// in one block of 1024 threads (15.5 us of frontier: one SM reading 517 KB of logits). Between two greedy steps the
// host queued three more small launches (the token's copy into the step's input, its copy into the output list, the
// position's fill). Here the embedding is one launch, the argmax reads the logits with a grid, and the argmax also
// feeds the next step (its token, its position, the output list), so a greedy step is one graph replay and nothing
// else.
#include <math.h>

#include <algorithm>

#include "common.cuh"

namespace ds4gpu {
namespace {

// ---- the embedding rows -----------------------------------------------------------------------------------------

constexpr int EMBED_THREADS = 256;  // 4 columns per thread: 4 CTAs per token row at Flash's 4096

// X[t, h, :] = float32(emb[tok[t], :]) for h < n_hc: torch's `emb[tok].to(float32)` expanded over the n_hc residual
// streams (float16 -> float32 is exact, so the same bits). A token id outside [0, vocab) gives a row of NaN.
template <typename E>
__global__ void __launch_bounds__(EMBED_THREADS) embed_kernel(const E* emb, int64_t vocab, int D, const int64_t* tok,
                                                              int n_hc, float* X) {
  pdl_begin();  // launched without PDL (launch_embed): the wait returns at once; the trigger lets the step's chain go
  const int t = blockIdx.y;
  const int64_t id = tok[t];
  const bool ok = id >= 0 && id < vocab;
  for (int c = (blockIdx.x * EMBED_THREADS + threadIdx.x) * 4; c < D; c += gridDim.x * EMBED_THREADS * 4) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      v[j] = c + j >= D ? 0.0f : ok ? (float)emb[id * D + c + j] : __int_as_float(0x7fc00000);
    float* row = X + (int64_t)t * n_hc * D;
    for (int h = 0; h < n_hc; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c + j < D) row[(int64_t)h * D + c + j] = v[j];
  }
}

// ---- greedy decode's argmax (a top-1 with torch.argmax's rules) -------------------------------------------------

// Each CTA reduces a slice of the logits to its best (value, index); the last CTA to arrive (one atomic ticket) reduces
// the CTAs' answers. "Best" is a total order (NaN above every number, the first NaN among NaNs; otherwise the larger
// value, the lower index on ties), so the answer does not depend on how the logits are cut: torch.argmax's.
constexpr int ARGMAX_THREADS = 256, ARGMAX_MAX_CTAS = 128, ARGMAX_LOADS = 4;  // float4 loads in flight per thread
__device__ float g_argmax_v[ARGMAX_MAX_CTAS];
__device__ int64_t g_argmax_i[ARGMAX_MAX_CTAS];
__device__ unsigned int g_argmax_ticket = 0;  // one launch at a time per device (one decode stream, as the router's)

__device__ __forceinline__ bool argmax_better(float v, int64_t i, float bv, int64_t bi) {
  if (v != v) return bv == bv || i < bi;  // NaN beats numbers; among NaNs the first
  if (bv != bv) return false;
  return v > bv || (v == bv && i < bi);
}
__device__ __forceinline__ void argmax_warp(float& bv, int64_t& bi) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (argmax_better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
}
// The block's best of every thread's (bv, bi), returned to all threads.
__device__ __forceinline__ void argmax_block(float& bv, int64_t& bi) {
  __shared__ float s_v[ARGMAX_THREADS / 32];
  __shared__ int64_t s_i[ARGMAX_THREADS / 32];
  argmax_warp(bv, bi);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s_v[warp] = bv, s_i[warp] = bi;
  __syncthreads();
  bv = lane < ARGMAX_THREADS / 32 ? s_v[lane] : -INFINITY;
  bi = lane < ARGMAX_THREADS / 32 ? s_i[lane] : INT64_MAX;
  argmax_warp(bv, bi);
  __syncthreads();  // s_v, s_i may be reused by the caller's next reduction
}

struct ArgmaxFeed {
  const int64_t* banned;  // non-null: the index banned[0] counts as -inf (a speed probe's EOS: ds4-bench never stops)
  int64_t* pos;   // non-null: pos[0] += 1 (the position of the step the token feeds)
  int64_t* hist;  // non-null: hist[p] = the token, p = pos[0] after the increment clamped to [0, hist_len)
  int64_t hist_len;
};

__global__ void __launch_bounds__(ARGMAX_THREADS) argmax_kernel(const float* x, int64_t n, int64_t* out,
                                                                ArgmaxFeed feed) {
  pdl_begin();
  float bv = -INFINITY;
  int64_t bi = n;  // past the end: any real element at -inf still beats it
  const int64_t banned = feed.banned ? *feed.banned : -1;
  const int64_t n4 = (((uintptr_t)x & 15) == 0) ? n / 4 : 0;
  const int64_t tid = (int64_t)blockIdx.x * ARGMAX_THREADS + threadIdx.x, nt = (int64_t)gridDim.x * ARGMAX_THREADS;
  for (int64_t q0 = tid; q0 < n4; q0 += ARGMAX_LOADS * nt) {
    float4 f[ARGMAX_LOADS];
#pragma unroll
    for (int u = 0; u < ARGMAX_LOADS; ++u) {
      const int64_t q = q0 + u * nt;
      f[u] = q < n4 ? __ldcg((const float4*)x + q) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    }
#pragma unroll
    for (int u = 0; u < ARGMAX_LOADS; ++u) {
      const int64_t q = q0 + u * nt;
      const float fv[4] = {f[u].x, f[u].y, f[u].z, f[u].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float v = 4 * q + c == banned ? -INFINITY : fv[c];
        if (q < n4 && argmax_better(v, 4 * q + c, bv, bi)) bv = v, bi = 4 * q + c;
      }
    }
  }
  for (int64_t i = 4 * n4 + tid; i < n; i += nt) {
    const float v = i == banned ? -INFINITY : __ldcg(x + i);
    if (argmax_better(v, i, bv, bi)) bv = v, bi = i;
  }
  argmax_block(bv, bi);
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    g_argmax_v[blockIdx.x] = bv;
    g_argmax_i[blockIdx.x] = bi;
    __threadfence();  // this CTA's answer, device-wide, before its ticket
    s_last = atomicAdd(&g_argmax_ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // every other CTA's answer is visible from here on (read through L2)
  bv = threadIdx.x < gridDim.x ? __ldcg(g_argmax_v + threadIdx.x) : -INFINITY;
  bi = threadIdx.x < gridDim.x ? __ldcg(g_argmax_i + threadIdx.x) : INT64_MAX;
  argmax_block(bv, bi);
  if (threadIdx.x == 0) {
    *out = bi;
    if (feed.pos) {
      const int64_t p = *feed.pos + 1;
      *feed.pos = p;
      if (feed.hist) feed.hist[min(max(p, (int64_t)0), feed.hist_len - 1)] = bi;
    }
    g_argmax_ticket = 0;  // all others have arrived: ready for the next launch (graph replays)
  }
}

}  // namespace

void launch_embed(const void* emb, bool f16, int64_t vocab, int D, const int64_t* tok, int T, int n_hc, float* X,
                  cudaStream_t s) {
  if (T < 1 || D < 1 || n_hc < 1 || vocab < 1) throw std::invalid_argument("embed: empty shape");
  const dim3 grid((unsigned)((D + EMBED_THREADS * 4 - 1) / (EMBED_THREADS * 4)), (unsigned)T);
  // Not under PDL: the step's kernels read the position before their griddepcontrol.wait ($DS4_GPU_PREWAIT), which is
  // safe only if nothing of the step starts before whatever wrote it has ended. In a graph replay that is the previous
  // replay; in eager greedy decode it is the previous step's argmax (the feed), and under PDL a chain of early
  // launches could run ahead of it. A kernel launched without PDL starts after its predecessor has completed.
  if (f16)
    launch_pdl(false, embed_kernel<__half>, grid, dim3(EMBED_THREADS), 0, s, (const __half*)emb, vocab, D, tok, n_hc,
               X);
  else
    launch_pdl(false, embed_kernel<float>, grid, dim3(EMBED_THREADS), 0, s, (const float*)emb, vocab, D, tok, n_hc, X);
  DS4_CHECK_LAUNCH("embed");
}

void launch_argmax(const float* x, int64_t n, int64_t* out, cudaStream_t s, int64_t* pos, int64_t* hist,
                   int64_t hist_len, const int64_t* banned) {
  if (n < 1) throw std::invalid_argument("argmax: empty input");
  // ~1024 logits per CTA (one float4 load per thread), at most ARGMAX_MAX_CTAS: 127 CTAs for Flash's 129280
  const int64_t ctas = std::min<int64_t>(ARGMAX_MAX_CTAS, std::max<int64_t>(1, (n + 4 * ARGMAX_THREADS - 1) /
                                                                                  (4 * ARGMAX_THREADS)));
  launch_k(argmax_kernel, dim3((unsigned)ctas), dim3(ARGMAX_THREADS), 0, s, x, n, out, ArgmaxFeed{banned, pos, hist, hist_len});
  DS4_CHECK_LAUNCH("argmax");
}

}  // namespace ds4gpu
