// Decode attention (model-spec §3.5; session.py attend is the torch form): the partial blocks (16 keys x a head group)
// and the combine with the sinks and the inverse RoPE, in two launches or one ($DS4_GPU_ATTN_ONE), and their launcher.
#include <math.h>

#include <algorithm>
#include <cstdlib>

#include "block_ops.cuh"
#include "common.cuh"
#include "row_block.cuh"

namespace ds4gpu {

namespace {

// Which key kk of the attention list (raw ring rows, then compressed rows) a decode query sees.
struct KeyList {
  const float* raw;
  int cap;
  const float* comp;     // null: no compressed rows
  const int64_t* sel;    // null: compressed rows 0..n_comp-1, else the indexer's selection
  int n_comp;            // rows listed after the raw ones
  int ratio;
  int tiles = 0;         // attn_partial_block's scores and P.V in register tiles ($DS4_GPU_ATTN_TILES, default on)
};

__device__ __forceinline__ const float* key_row(const KeyList& L, int kk, int64_t p, int d, bool* visible) {
  if (kk < L.cap) {
    int64_t key_pos = p - ((p - kk) % L.cap + L.cap) % L.cap;
    *visible = key_pos >= 0;
    return L.raw + (int64_t)kk * d;
  }
  int ci = kk - L.cap;
  int64_t row = L.sel ? L.sel[ci] : ci;
  int64_t n_vis = (p + 1) / L.ratio;
  *visible = row < n_vis;
  return L.comp + row * d;
}

constexpr int ATT_KEYS = 16;   // keys per block
constexpr int ATT_HEADS = 8;   // most heads per block (one per warp)
constexpr int ATT_THREADS = 256;

// Floats of the partial pass's dynamic shared memory for hb heads: keys, the heads' queries, their probabilities.
__host__ __device__ constexpr int attn_partial_floats(int d, int hb) { return ATT_KEYS * d + hb * d + hb * ATT_KEYS; }

// Split-key decode attention, pass 1: block (key chunk c, head group g of hb heads) loads its keys and
// its heads' queries once into shared memory (float4) and computes, for each head, the chunk's max
// score m, sum of exp l and the unnormalized output o (flash-decoding partials). Warp w scores head w
// against all ATT_KEYS keys with per-key accumulators in registers (the v3 kernel's per-(head, key)
// warp reductions with q re-read from global ran 25-40 us; 16 heads per block ran 12-16 us: too much
// serial work per block, so 8 heads and twice the blocks). Every head's arithmetic is the same whatever
// hb is (warp w's work does not depend on w), so the partials do not depend on the head grouping.
// Needs ATT_THREADS threads and attn_partial_floats(d, hb) floats at sh.
__device__ void attn_partial_block(const float* q, const KeyList& L, int n_keys, int d, int hb, int H, int c, int g,
                                   int64_t p, float scale, float* part_o, float* part_ml, float* sh) {
  float* keys = sh;                          // [ATT_KEYS][d]
  float* qs = sh + ATT_KEYS * d;             // [hb][d]
  float* prob = qs + hb * d;                 // [hb][ATT_KEYS]
  __shared__ bool vis[ATT_KEYS];
  const int k0 = c * ATT_KEYS, d4 = d / 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int kk = warp; kk < ATT_KEYS; kk += ATT_THREADS / 32) {
    bool v = false;
    const float* src = nullptr;
    if (k0 + kk < n_keys) src = key_row(L, k0 + kk, p, d, &v);
    const bool use = src && v;
    for (int j = lane; j < d4; j += 32)
      ((float4*)keys)[kk * d4 + j] = use ? __ldg((const float4*)src + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (lane == 0) vis[kk] = use;
  }
  const float4* qg = (const float4*)(q + (int64_t)g * hb * d);
  for (int i = threadIdx.x; i < hb * d4; i += ATT_THREADS) ((float4*)qs)[i] = __ldg(qg + i);
  __syncthreads();
  if (L.tiles) {
    // Warp w scores the 4 heads of quad w / 4 against the 4 keys of quad w % 4 (8 warps: 2 head quads x 4 key quads):
    // per column 8 shared-memory loads for 16 products, where the per-head form below loads 17 for 16 (1024 against
    // 2176 wavefronts per 8-head block). Each score is the same chain of products in the same column order and the
    // same warp sum: the same bits.
    static_assert(ATT_THREADS / 32 == 8 && ATT_KEYS == 16, "the tile form deals 2 x 4 quads to 8 warps");
    const int h0 = 4 * (warp >> 2), k0 = 4 * (warp & 3);
    if (h0 < hb) {
      float a[4][4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) a[u][v] = 0.0f;
      for (int j = lane; j < d; j += 32) {
        float x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) x[u] = h0 + u < hb ? qs[(h0 + u) * d + j] : 0.0f;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float kv = keys[(k0 + v) * d + j];
#pragma unroll
          for (int u = 0; u < 4; ++u) a[u][v] += x[u] * kv;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float s0 = warp_sum_f(a[u][v]);
          if (lane == 0 && h0 + u < hb) prob[(h0 + u) * ATT_KEYS + k0 + v] = vis[k0 + v] ? s0 * scale : -INFINITY;
        }
    }
  } else if (warp < hb) {  // warp w scores head w against every key of the chunk
    float a0[ATT_KEYS];
#pragma unroll
    for (int kk = 0; kk < ATT_KEYS; ++kk) a0[kk] = 0.0f;
    const float* q0 = qs + warp * d;
    for (int j = lane; j < d; j += 32) {
      const float x0 = q0[j];
#pragma unroll
      for (int kk = 0; kk < ATT_KEYS; ++kk) a0[kk] += x0 * keys[kk * d + j];
    }
#pragma unroll
    for (int kk = 0; kk < ATT_KEYS; ++kk) {
      const float s0 = warp_sum_f(a0[kk]);
      if (lane == 0) prob[warp * ATT_KEYS + kk] = vis[kk] ? s0 * scale : -INFINITY;
    }
  }
  __syncthreads();
  if (threadIdx.x < hb) {
    const int hh = threadIdx.x, h = g * hb + hh;
    float m = -INFINITY;
    for (int kk = 0; kk < ATT_KEYS; ++kk) m = fmaxf(m, prob[hh * ATT_KEYS + kk]);
    float l = 0.0f;
    for (int kk = 0; kk < ATT_KEYS; ++kk) {
      float e = m == -INFINITY ? 0.0f : expf(prob[hh * ATT_KEYS + kk] - m);
      prob[hh * ATT_KEYS + kk] = e;
      l += e;
    }
    part_ml[((int64_t)c * H + h) * 2] = m;
    part_ml[((int64_t)c * H + h) * 2 + 1] = l;
  }
  __syncthreads();
  if (L.tiles) {
    // Thread (head quad hq, float4 column j4) takes 4 heads: each key's float4 is loaded once for the 4 (the per-head
    // loop below loads it once per head: 2560 shared-memory wavefronts per 8-head block against 1024 here). Per output
    // the same products added in the same key order: the same bits.
    const int nq = (hb + 3) / 4;
    for (int i = threadIdx.x; i < nq * d4; i += ATT_THREADS) {
      const int hq = i / d4, j4 = i % d4, h0 = 4 * hq;
      float4 acc[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int kk = 0; kk < ATT_KEYS; ++kk) {
        const float4 kv = ((const float4*)keys)[kk * d4 + j4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float e = h0 + u < hb ? prob[(h0 + u) * ATT_KEYS + kk] : 0.0f;
          acc[u].x += e * kv.x; acc[u].y += e * kv.y; acc[u].z += e * kv.z; acc[u].w += e * kv.w;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (h0 + u < hb) ((float4*)(part_o + ((int64_t)c * H + g * hb + h0 + u) * d))[j4] = acc[u];
    }
    return;
  }
  for (int i = threadIdx.x; i < hb * d4; i += ATT_THREADS) {
    const int hh = i / d4, j4 = i % d4, h = g * hb + hh;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int kk = 0; kk < ATT_KEYS; ++kk) {
      const float e = prob[hh * ATT_KEYS + kk];
      const float4 kv = ((const float4*)keys)[kk * d4 + j4];
      acc.x += e * kv.x; acc.y += e * kv.y; acc.z += e * kv.z; acc.w += e * kv.w;
    }
    ((float4*)(part_o + ((int64_t)c * H + h) * d))[j4] = acc;
  }
}

__global__ void __launch_bounds__(ATT_THREADS) attn_partial_kernel(const float* q, KeyList L, int n_keys, int d,
                                                                   int hb, const int64_t* pos, float scale,
                                                                   float* part_o, float* part_ml, bool pre) {
  extern __shared__ __align__(16) float sh[];
  // pre ($DS4_GPU_PREWAIT=2): the position (written before the step's graph starts) is read before the wait, so the
  // key rows' addresses and visibility do not wait for its round trip after it
  pdl_trigger();
  const int64_t p_early = pre ? *pos : 0;
  pdl_wait();
  const int64_t p = pre ? p_early : *pos;
  const int H = gridDim.y * hb;
  // A chunk of compressed rows (in order, no selection) that are all past the visible ones is empty: it writes only
  // m = -inf, l = 0, and the combine gives it weight 0 and reads none of its outputs. A decode graph is sized for the
  // session's whole context; this makes its cost follow the position (v34: a 32k session's ratio-128 layers at 2k
  // ran 25 chunks for 10 with keys). The other chunks' partials and so the output keep their bits.
  if (!L.sel && L.comp && (int64_t)blockIdx.x * ATT_KEYS >= L.cap + (p + 1) / L.ratio) {
    if (threadIdx.x < hb) {
      float* ml = part_ml + ((int64_t)blockIdx.x * H + blockIdx.y * hb + threadIdx.x) * 2;
      ml[0] = -INFINITY;
      ml[1] = 0.0f;
    }
    return;
  }
  attn_partial_block(q, L, n_keys, d, hb, H, blockIdx.x, blockIdx.y, p, scale, part_o, part_ml, sh);
}

// Pass 2: combine the chunks of heads h0..h0+nh-1 with the sinks, then row_post (the inverse RoPE on the tail).
// The sum of exp over chunks has a fixed partition whatever the block size (any multiple of 32 threads): the
// one of a block of ATT_COMBINE_THREADS threads, i.e. virtual thread t of 16 virtual warps sums chunks t,
// t + 512, ... in order, each virtual warp reduces with warp_sum_f and the 16 warp sums add in order (block_sum's
// order). The max is exact in any order; each output column sums its chunks in order 0..n-1. So the two-launch
// path (512 threads, one head per block) and the one-launch path (the last partial block of a head group, 256
// threads, all the group's heads) give the same bits. A per-block RMS norm in `o` would reduce in block_sum's
// thread-count-dependent order: the one-launch path does not take it (attention never asks for one).
// Partials are read with __ldcg (L2): in the one-launch path other blocks of this grid wrote them.
// Needs attn_combine_floats(d, nh, n_chunks) floats at sh (16-byte aligned).
constexpr int ATT_COMBINE_THREADS = 512;
constexpr int ATT_VWARPS = ATT_COMBINE_THREADS / 32;  // virtual warps of the sum's partition
constexpr int ATT_CHUNKS_AT_ONCE = 8;                 // chunks whose loads are issued together
__host__ __device__ constexpr int attn_combine_floats(int d, int nh, int n_chunks) {
  return nh * d + d + nh * n_chunks + 2 * nh * ATT_VWARPS + 32 + nh;
}
// c4_0, c4_1: only the float4 columns [c4_0, c4_1) of each head row are formed and stored (-1: to the end); every
// column is computed alone, so a slice has the bits of the whole (row_post must then be elementwise: no norm).
// cs (optional): the inverse RoPE's factors, staged by row_post_stage before griddepcontrol.wait.
__device__ void attn_combine_heads(const float* part_o, const float* part_ml, int n_chunks, int H, int d, int h0,
                                   int nh, const float* sinks, float p, const RowPost& o, float* out, float* sh,
                                   int c4_0 = 0, int c4_1 = -1, const float* cs = nullptr) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
  float* v = sh;                           // [nh][d] outputs
  float* tmp = v + nh * d;                 // [d] row_post's scratch
  float* wc = tmp + d;                     // [nh][n_chunks] chunk weight exp(m_c - M), 0 for empty chunks
  float* mxs = wc + nh * n_chunks;         // [nh][ATT_VWARPS] max of each virtual warp's chunks
  float* sums = mxs + nh * ATT_VWARPS;     // [nh][ATT_VWARPS] sum of each virtual warp's l_c w_c
  float* red = sums + nh * ATT_VWARPS;     // [32] row_post's block_sum
  float* lsum = red + 32;                  // [nh] the softmax denominator of each head
  // (virtual warp vw, head hh) pairs i = vw * nh + hh go round the real warps: the few virtual warps that have
  // chunks (n_chunks <= 32 vw) are spread over different warps, so their loads are in flight together.
  // One (virtual warp, head) pair per warp and one chunk per lane (every decode shape up to 512 chunks): the pass
  // below keeps its chunk's m and l in registers for the second pass instead of reading them again (one L2 round
  // trip less on the chain; the same values, so the same bits).
  const bool one_each = nh * ATT_VWARPS <= nw && n_chunks <= ATT_COMBINE_THREADS;
  float m_own = -INFINITY, l_own = 0.0f;
  for (int i = warp; i < nh * ATT_VWARPS; i += nw) {
    const int vw = i / nh, hh = i % nh, h = h0 + hh;
    float mx = -INFINITY;
    for (int c = vw * 32 + lane; c < n_chunks; c += ATT_COMBINE_THREADS) {
      const float m = __ldcg(part_ml + ((int64_t)c * H + h) * 2);
      if (one_each) m_own = m, l_own = __ldcg(part_ml + ((int64_t)c * H + h) * 2 + 1);
      mx = fmaxf(mx, m);
    }
    mx = warp_max_f(mx);
    if (lane == 0) mxs[hh * ATT_VWARPS + vw] = mx;
  }
  __syncthreads();
  for (int i = warp; i < nh * ATT_VWARPS; i += nw) {
    const int vw = i / nh, hh = i % nh, h = h0 + hh;
    float M = sinks[h];
    for (int k = 0; k < ATT_VWARPS; ++k) M = fmaxf(M, mxs[hh * ATT_VWARPS + k]);
    float ls = 0.0f;
    for (int c = vw * 32 + lane; c < n_chunks; c += ATT_COMBINE_THREADS) {
      const float m = one_each ? m_own : __ldcg(part_ml + ((int64_t)c * H + h) * 2),
                  l = one_each ? l_own : __ldcg(part_ml + ((int64_t)c * H + h) * 2 + 1);
      const float w = m == -INFINITY ? 0.0f : expf(m - M);
      wc[hh * n_chunks + c] = w;
      if (m != -INFINITY) ls += l * w;
    }
    ls = warp_sum_f(ls);
    if (lane == 0) sums[hh * ATT_VWARPS + vw] = ls;
  }
  __syncthreads();
  if (tid < nh) {
    const float sink = sinks[h0 + tid];
    float M = sink;
    for (int k = 0; k < ATT_VWARPS; ++k) M = fmaxf(M, mxs[tid * ATT_VWARPS + k]);
    float t = 0.0f;
    for (int k = 0; k < ATT_VWARPS; ++k) t += sums[tid * ATT_VWARPS + k];
    lsum[tid] = t + expf(sink - M);
  }
  __syncthreads();
  // Column sums: thread tid takes the float4 columns i = tid, tid + nt, ... of all nh heads and, per column,
  // issues the loads of ATT_CHUNKS_AT_ONCE chunks before it adds them (__ldcg loads keep their order, so loads
  // interleaved with the adds would have 1-2 in flight). Each column adds its chunks in order 0..n-1.
  const int d4 = d / 4, c4_end = c4_1 < 0 ? d4 : c4_1, w4 = c4_end - c4_0, n4 = nh * w4;
  const int64_t cstride4 = (int64_t)H * d4;  // float4s from one chunk to the next
  for (int k4 = tid; k4 < n4; k4 += nt) {
    const int hh = k4 / w4, i = hh * d4 + c4_0 + k4 % w4;  // i: the float4 of v (head hh's row, column slice)
    const float4* src = (const float4*)(part_o + (int64_t)(h0 + hh) * d) + i % d4;
    const float* w = wc + hh * n_chunks;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int c0 = 0; c0 < n_chunks; c0 += ATT_CHUNKS_AT_ONCE, src += ATT_CHUNKS_AT_ONCE * cstride4) {
      float4 x[ATT_CHUNKS_AT_ONCE];
#pragma unroll
      for (int k = 0; k < ATT_CHUNKS_AT_ONCE; ++k)  // a chunk of weight 0 adds +-0 to a sum that is never -0: skipped
        x[k] = c0 + k < n_chunks && w[c0 + k] != 0.0f ? __ldcg(src + k * cstride4) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k = 0; k < ATT_CHUNKS_AT_ONCE; ++k) {
        if (c0 + k >= n_chunks) break;
        const float wk = w[c0 + k];
        acc.x += x[k].x * wk; acc.y += x[k].y * wk; acc.z += x[k].z * wk; acc.w += x[k].w * wk;
      }
    }
    const float L = lsum[hh];
    ((float4*)v)[i] = make_float4(acc.x / L, acc.y / L, acc.z / L, acc.w / L);
  }
  __syncthreads();
  for (int hh = 0; hh < nh; ++hh) row_post(v + hh * d, tmp, d, p, o, red, cs);
  for (int k4 = tid; k4 < n4; k4 += nt) {
    const int i = (k4 / w4) * d4 + c4_0 + k4 % w4;
    ((float4*)(out + (int64_t)h0 * d))[i] = ((const float4*)v)[i];
  }
}

template <bool PRE>
__global__ void __launch_bounds__(ATT_COMBINE_THREADS) attn_combine_kernel(const float* part_o, const float* part_ml,
                                                                           int n_chunks, int H, int d,
                                                                           const float* sinks, const int64_t* pos,
                                                                           RowPost o, float* out) {
  extern __shared__ __align__(16) float sh[];
  if constexpr (PRE) {  // $DS4_GPU_PREWAIT: the position, the sinks and the RoPE factors before the wait (row_post_stage)
    pdl_trigger();
    float* staged = sh + attn_combine_floats(d, 1, n_chunks);  // [H] sinks, then the RoPE factors
    const float p = (float)*pos;
    for (int h = threadIdx.x; h < H; h += blockDim.x) staged[h] = sinks[h];
    const RowPost os = row_post_stage(o, d, p, nullptr, staged + H);
    pdl_wait();  // the partials are the previous kernel's
    attn_combine_heads(part_o, part_ml, n_chunks, H, d, blockIdx.x, 1, staged, p, os, out, sh, 0, -1, staged + H);
  } else {
    pdl_begin();
    attn_combine_heads(part_o, part_ml, n_chunks, H, d, blockIdx.x, 1, sinks, (float)*pos, o, out, sh);
  }
}

// Both passes in one launch ($DS4_GPU_ATTN_ONE=1): the partial blocks as attn_partial_kernel; each then counts
// itself in its head group's arrival counter (after a fence, so its partials are visible in L2 first), and the
// last block of the group to arrive combines the group's heads (attn_combine_heads, the same bits as the
// combine kernel) and resets the counter for the next launch or graph replay.
constexpr int ATT_ONE_MAX_GROUPS = 1024;
__device__ unsigned g_attn_count[ATT_ONE_MAX_GROUPS];

__global__ void __launch_bounds__(ATT_THREADS) attn_one_kernel(const float* q, KeyList L, int n_keys, int d, int hb,
                                                               const int64_t* pos, float scale, float* part_o,
                                                               float* part_ml, const float* sinks, RowPost o,
                                                               float* out) {
  pdl_begin();
  extern __shared__ __align__(16) float sh[];
  __shared__ bool last;
  const int nc = gridDim.x, g = blockIdx.y, H = gridDim.y * hb;
  const int64_t p = *pos;
  attn_partial_block(q, L, n_keys, d, hb, H, blockIdx.x, g, p, scale, part_o, part_ml, sh);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&g_attn_count[g], 1u) == (unsigned)nc - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) g_attn_count[g] = 0;
  attn_combine_heads(part_o, part_ml, nc, H, d, g * hb, hb, sinks, (float)p, o, out, sh);
}

// Both passes in one launch, the combine in blocks of its own ($DS4_GPU_ATTN_ONE=2): the last block of a group
// (above) combines all its heads in one SM, a tail that grows with the heads per block. Here the grid has
// n_part = chunks x groups partial blocks (hb heads each, as the two-launch path) and then one combine block per
// head, which waits until its group's arrival counter reaches the chunk count and combines that head. Roles go by
// a ticket taken at the start (atomic counter), not by blockIdx: a block holding a combine ticket got it after
// every partial ticket was taken by a running block, and partial blocks wait for nothing, so the waits end even
// when the grid is not all resident. The last ticket resets the ticket counter; the last combine block of a
// group to finish waiting resets that group's counters.
__device__ unsigned g_attn_ticket;
__device__ unsigned g_attn_seen[ATT_ONE_MAX_GROUPS];

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void __launch_bounds__(ATT_THREADS) attn_one_wait_kernel(const float* q, KeyList L, int n_keys, int d,
                                                                    int hb, int H, const int64_t* pos, float scale,
                                                                    float* part_o, float* part_ml, const float* sinks,
                                                                    RowPost o, float* out) {
  pdl_begin();
  extern __shared__ __align__(16) float sh[];
  __shared__ unsigned ticket;
  const int nc = (n_keys + ATT_KEYS - 1) / ATT_KEYS, n_part = nc * (H / hb);
  const int64_t p = *pos;
  if (threadIdx.x == 0) {
    ticket = atomicAdd(&g_attn_ticket, 1u);
    if (ticket == gridDim.x - 1) g_attn_ticket = 0;  // every ticket of this launch is taken
  }
  __syncthreads();
  const int t = (int)ticket;
  if (t < n_part) {
    const int g = t / nc;
    attn_partial_block(q, L, n_keys, d, hb, H, t % nc, g, p, scale, part_o, part_ml, sh);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&g_attn_count[g], 1u);
    return;
  }
  const int h = t - n_part, g = h / hb;
  if (threadIdx.x == 0) {
    while (ld_acquire_u32(&g_attn_count[g]) < (unsigned)nc) __nanosleep(100);
    if (atomicAdd(&g_attn_seen[g], 1u) == (unsigned)hb - 1) {  // the group's last waiter: reset for the next launch
      g_attn_seen[g] = 0;
      g_attn_count[g] = 0;
    }
  }
  __syncthreads();
  __threadfence();
  attn_combine_heads(part_o, part_ml, nc, H, d, h, 1, sinks, (float)p, o, out, sh);
}

}  // namespace

int attn_chunks(int n_keys) { return (n_keys + ATT_KEYS - 1) / ATT_KEYS; }

// $DS4_GPU_ATTN_TILES (default 1): decode attention's partial blocks compute scores and P.V in register tiles
// (attn_partial_block; the same bits); 0: one head per pass (v20). v21: 6.76 -> 6.67 ms per token at 2k. set_attn_tiles
// overrides it for this process (0, 1; -1 the environment).
static int& attn_tiles_override() {
  static int v = -1;
  return v;
}
void set_attn_tiles(int mode) { attn_tiles_override() = mode == 0 || mode == 1 ? mode : -1; }
static int attn_tiles_mode() {
  static const int env = [] {
    const char* e = std::getenv("DS4_GPU_ATTN_TILES");
    return e && e[0] == '0' ? 0 : 1;
  }();
  return attn_tiles_override() >= 0 ? attn_tiles_override() : env;
}

// $DS4_GPU_ATTN_ONE: decode attention in one launch; unset or 0: two launches (the default).
// 1: attn_one_kernel with $DS4_GPU_ATTN_ONE_HEADS heads per block (1..8, default 2). The last block of a group
//    combines all its heads, reading heads x chunks x d floats through one SM (Flash at 2k, 40 chunks: 80 KB per
//    head, ~3 us per pass of one float4 column per thread), while fewer heads per block load every key more often
//    (64 / heads times) in more blocks (64 registers: 4 blocks of 256 threads per SM, 528 on the H200; 40 chunks x
//    32 groups = 1280). Estimates for 40 chunks: 8 heads ~2 us partials + ~12 us tail, 4 heads ~4 + ~6 us,
//    2 heads ~6 + ~3 us; to be measured.
// 2: attn_one_wait_kernel: 8 heads per partial block as the two-launch path, plus one combine block per head
//    waiting for its group (tail: one head, as the combine kernel, without the launch between).
static int attn_one_mode() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_ATTN_ONE");
    return e && (e[0] == '1' || e[0] == '2') && e[1] == 0 ? e[0] - '0' : 0;
  }();
  return v;
}
static int attn_one_heads() {
  static const int v = [] {
    const char* h = getenv("DS4_GPU_ATTN_ONE_HEADS");
    const int n = h ? atoi(h) : 2;
    return n >= 1 && n <= ATT_HEADS ? n : 2;
  }();
  return v;
}

void launch_attention(const float* q, int H, int d, const float* raw, int cap, const float* comp, const int64_t* sel,
                      int n_comp, int ratio, const int64_t* pos, float scale, const float* sinks, const RowPost& o,
                      float* part_o, float* part_ml, float* out, cudaStream_t s) {
  const int hb = H % ATT_HEADS == 0 ? ATT_HEADS : (H <= ATT_HEADS ? H : 0);
  if (hb == 0) throw std::invalid_argument("attention: heads must be <= 8 or a multiple of 8");
  check_row_post(o, d);
  KeyList L{raw, cap, comp, sel, comp ? n_comp : 0, ratio > 0 ? ratio : 1, attn_tiles_mode()};
  const int n_keys = cap + L.n_comp, nc = attn_chunks(n_keys);
  if (d % 4) throw std::invalid_argument("attention: head dim must be a multiple of 4");
  if (((uintptr_t)q | (uintptr_t)part_o | (uintptr_t)out) & 15)
    throw std::invalid_argument("attention: q, partials and out must be 16-byte aligned (float4 access)");
  const int mode = o.norm ? 0 : attn_one_mode();  // a norm in row_post would reduce in a block-size-dependent order
  if (mode == 2 && H / hb <= ATT_ONE_MAX_GROUPS) {
    const size_t shm = sizeof(float) * (size_t)std::max(attn_partial_floats(d, hb), attn_combine_floats(d, 1, nc));
    static size_t shm_wait_set = 0;
    if (shm > 48 * 1024 && shm > shm_wait_set) {
      DS4_CHECK(cudaFuncSetAttribute(attn_one_wait_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
      shm_wait_set = shm;
    }
    launch_k(attn_one_wait_kernel, dim3(nc * (H / hb) + H), dim3(ATT_THREADS), shm, s, q, L, n_keys, d, hb, H, pos,
             scale, part_o, part_ml, sinks, o, out);
    DS4_CHECK_LAUNCH("attention (one launch, waiting combine blocks)");
    return;
  }
  int hb1 = mode == 1 ? std::min(attn_one_heads(), hb) : 0;  // the largest head count <= the asked one dividing H
  while (hb1 > 1 && H % hb1) --hb1;
  if (hb1 > 0 && H / hb1 <= ATT_ONE_MAX_GROUPS) {
    const size_t shm = sizeof(float) * (size_t)std::max(attn_partial_floats(d, hb1), attn_combine_floats(d, hb1, nc));
    static size_t shm_one_set = 0;
    if (shm > 48 * 1024 && shm > shm_one_set) {
      DS4_CHECK(cudaFuncSetAttribute(attn_one_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
      shm_one_set = shm;
    }
    launch_k(attn_one_kernel, dim3(nc, H / hb1), dim3(ATT_THREADS), shm, s, q, L, n_keys, d, hb1, pos, scale, part_o,
             part_ml, sinks, o, out);
    DS4_CHECK_LAUNCH("attention (one launch)");
    return;
  }
  size_t shm = sizeof(float) * (size_t)attn_partial_floats(d, hb);
  static size_t shm_set = 0;
  if (shm > 48 * 1024 && shm > shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(attn_partial_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = shm;
  }
  launch_k(attn_partial_kernel, dim3(nc, H / hb), dim3(ATT_THREADS), shm, s, q, L, n_keys, d, hb, pos, scale, part_o,
           part_ml, prewait_mode() >= 2);
  DS4_CHECK_LAUNCH("attention partial");
  const int pre = prewait_mode() && !o.norm;  // row_post_stage stages no norm weight here (attention asks none)
  size_t shm2 = sizeof(float) * ((size_t)attn_combine_floats(d, 1, nc) + (pre ? H + rope_stage_size(o.rope_dim) : 0));
  static size_t shm2_set[2] = {0, 0};
  auto* combine = pre ? attn_combine_kernel<true> : attn_combine_kernel<false>;
  if (shm2 > 48 * 1024 && shm2 > shm2_set[pre]) {
    DS4_CHECK(cudaFuncSetAttribute(combine, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm2));
    shm2_set[pre] = shm2;
  }
  launch_k(combine, dim3(H), dim3(ATT_COMBINE_THREADS), shm2, s, part_o, part_ml, nc, H, d, sinks, pos, o, out);
  DS4_CHECK_LAUNCH("attention combine");
}

}  // namespace ds4gpu
