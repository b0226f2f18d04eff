// Fused kernels for the non-matvec work of a DeepSeek V4 layer (model-spec §3.3-3.7; the mHC kernels are in
// hc.cu), one launch per chain that the torch graph ran as 5-40 small kernels. Each mirrors ds4.engine.gpu.ops / session.py
// operation for operation (same formulas, same roundings of the FP8/FP4 simulations); only summation
// orders differ. Decode (T = 1) reads the position from device memory, so a CUDA graph can replay it.
#include <math.h>

#include <algorithm>
#include <cstdlib>

#include "block_ops.cuh"
#include "common.cuh"
#include "router.cuh"
#include "row_warp.cuh"

namespace ds4gpu {

namespace {

// In-place post-processing of one row v[d] in shared memory by the whole block (NT threads):
// optional RMS norm (times w), RoPE on the last rope_dim dims at position `p` (freq[rope_dim/2]),
// FP8 e4m3 rounding of the first fp8_nope dims in blocks of 64, or Hadamard + FP4 e2m1 in blocks of 32.
// Mirrors ops.rms_norm, ops.apply_tail, ops.fp8_kv_round and ops.indexer_qat.
// RowPost (common.cuh) says which of these steps run.
__device__ void row_post(float* v, float* tmp, int d, float p, const RowPost& o, float* red) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if (o.norm) {
    float ss = 0.0f;
    for (int i = tid; i < d; i += nt) ss += v[i] * v[i];
    ss = block_sum(ss, red);
    float r = rsqrtf(ss / (float)d + o.eps);
    for (int i = tid; i < d; i += nt) v[i] = o.w ? v[i] * r * o.w[i] : v[i] * r;
    __syncthreads();
  }
  if (o.freq) {
    const int half = o.rope_dim / 2, n_nope = d - o.rope_dim;
    for (int i = tid; i < half; i += nt) {
      float ang = p * o.freq[i];
      float c = cosf(ang), s = sinf(ang);
      if (o.inverse) s = -s;
      float x0 = v[n_nope + 2 * i], x1 = v[n_nope + 2 * i + 1];
      v[n_nope + 2 * i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
      v[n_nope + 2 * i + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
    __syncthreads();
  }
  const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
  if (o.fp8_nope > 0) {
    for (int b = warp; b < o.fp8_nope / 64; b += nw) {
      float x0 = v[64 * b + lane], x1 = v[64 * b + 32 + lane];
      float amax = fmaxf(warp_max_f(fmaxf(fabsf(x0), fabsf(x1))), 1e-4f);
      float scale = pow2_ceil(amax / 448.0f);
      float q0 = fminf(fmaxf(x0 / scale, -448.0f), 448.0f), q1 = fminf(fmaxf(x1 / scale, -448.0f), 448.0f);
      v[64 * b + lane] = round_minifloat(q0, 3, -6) * scale;
      v[64 * b + 32 + lane] = round_minifloat(q1, 3, -6) * scale;
    }
    __syncthreads();
  }
  if (o.qat) {
    // Hadamard butterflies in the order of ops.hadamard (pairs (i, i + h) within blocks of 2h)
    float* a = v;
    float* b = tmp;
    for (int h = 1; h < d; h *= 2) {
      for (int i = tid; i < d; i += nt) {
        int j = i % (2 * h);
        b[i] = j < h ? a[i] + a[i + h] : a[i - h] - a[i];
      }
      __syncthreads();
      float* t = a;
      a = b;
      b = t;
    }
    for (int i = tid; i < d; i += nt) a[i] = a[i] * o.had_scale;
    __syncthreads();
    for (int blk = warp; blk < d / 32; blk += nw) {
      float x = a[32 * blk + lane];
      float amax = fmaxf(warp_max_f(fabsf(x)), 6.0f * 1.1754943508222875e-38f);
      float scale = pow2_ceil(amax / 6.0f);
      float q = fminf(fmaxf(x / scale, -6.0f), 6.0f);
      v[32 * blk + lane] = round_minifloat(q, 1, 0) * scale;
    }
    __syncthreads();
  }
}

// ---- kernels ------------------------------------------------------------------------------------

// y[r] = rms_norm(x[r]) (* w); one block per row; y may alias x. Rows of a multiple of 4 columns go
// through float4 loads held in registers (n <= 4 * 4 * blockDim), so each thread's loads are in flight at once.
constexpr int RMS_THREADS = 512;
__global__ void __launch_bounds__(RMS_THREADS) rms_norm_kernel(const float* x, const float* w, float* y, int n,
                                                               float eps) {
  pdl_begin();
  __shared__ float red[32];
  const float* xr = x + (int64_t)blockIdx.x * n;
  float* yr = y + (int64_t)blockIdx.x * n;
  if (n % 4 == 0 && n <= 16 * RMS_THREADS) {
    const int n4 = n / 4;
    float4 v[4];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = threadIdx.x + k * RMS_THREADS;
      v[k] = i < n4 ? __ldg((const float4*)xr + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / (float)n + eps);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = threadIdx.x + k * RMS_THREADS;
      if (i >= n4) continue;
      float4 g = w ? __ldg((const float4*)w + i) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
      ((float4*)yr)[i] = w ? make_float4(v[k].x * r * g.x, v[k].y * r * g.y, v[k].z * r * g.z, v[k].w * r * g.w)
                           : make_float4(v[k].x * r, v[k].y * r, v[k].z * r, v[k].w * r);
    }
    return;
  }
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, red);
  float r = rsqrtf(ss / (float)n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w ? xr[i] * r * w[i] : xr[i] * r;
}

// One row per block: x[row] -> row_post -> out[row] (or the ring row pos % ring_cap when ring_cap > 0).
// Token of a row: row / rows_per_token; its position pos[token]. Blocks past job a's rows do job b's, and past
// those job c's (decode: the query heads, the KV row and, on indexed layers, the indexer's query heads in one launch).
__global__ void norm_rope_kernel(NormRopeJob a, NormRopeJob b, NormRopeJob c, const int64_t* pos) {
  pdl_begin();
  extern __shared__ float sh[];
  __shared__ float red[32];
  const int bi = (int)blockIdx.x;
  const int which = bi < a.rows ? 0 : (bi < a.rows + b.rows ? 1 : 2);
  const NormRopeJob& j = which == 0 ? a : (which == 1 ? b : c);
  const int d = j.d;
  float* v = sh;
  float* tmp = sh + d;
  const int row = bi - (which > 0 ? a.rows : 0) - (which > 1 ? b.rows : 0), t = row / j.rows_per_token;
  const float in_s = j.in_scale ? j.in_scale[t] : 1.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float x = j.x[(int64_t)row * d + i];
    v[i] = j.in_scale ? x * in_s : x;
  }
  __syncthreads();
  const int64_t p = pos ? pos[t] : 0;
  row_post(v, tmp, d, (float)p, j.o, red);
  int64_t orow = j.ring_cap > 0 ? p % j.ring_cap : row;
  for (int i = threadIdx.x; i < d; i += blockDim.x) j.out[orow * d + i] = v[i];
}

// norm_rope for many rows (prefill's query heads: 64 x T rows of 512): one warp per row, the row in registers
// (element lane + 32 k), the norm's sum by shuffles and RoPE's pairs (even, odd) in adjacent lanes, so no
// block barrier and 8 rows per 256-thread block. The block kernel keeps ~16 rows per SM in flight, each waiting
// on its barriers: at 0.5M rows per prefill chunk that ran at a third of the bandwidth. Same formulas as
// row_post; the norm's sum runs in another order (the block kernel stays for decode and the ring rows). The FP8 and
// Hadamard + FP4 steps too (v15: the indexer's 0.5M query rows per 8192-token chunk ran ~2 ms on the block kernel).
constexpr int NR_WARP_MAX_D = 1024, NR_WARP_THREADS = 256, NR_WARP_MIN_ROWS = 256;

__global__ void __launch_bounds__(NR_WARP_THREADS) norm_rope_warp_kernel(NormRopeJob j, const int64_t* pos) {
  pdl_begin();
  constexpr int KMAX = NR_WARP_MAX_D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * (NR_WARP_THREADS / 32) + (threadIdx.x >> 5);
  if (row >= j.rows) return;
  const int d = j.d, nk = d / 32;
  const RowPost& o = j.o;
  float v[KMAX];
  const float* xr = j.x + row * d;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) v[k] = k < nk ? xr[lane + 32 * k] : 0.0f;
  if (j.in_scale) {
    const float in_s = j.in_scale[row / j.rows_per_token];
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < nk) v[k] *= in_s;
  }
  warp_row_post<KMAX>(v, d, lane, o, pos ? (float)pos[row / j.rows_per_token] : 0.0f);
  float* yr = j.out + row * d;
#pragma unroll
  for (int k = 0; k < KMAX; ++k)
    if (k < nk) yr[lane + 32 * k] = v[k];
}

// $DS4_GPU_NR_WARP (benchmark A/B): 2 (default) the warp kernel for 256+ rows, FP8 and FP4 rows included; 1 the v9
// choice (FP8 and FP4 rows on the block kernel); 0 every norm_rope on the block kernel.
static int norm_rope_warp_level() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_NR_WARP");
    return e && e[0] ? atoi(e) : 2;
  }();
  return v;
}

// MoE routing (model-spec §3.7 steps 1-3) for token blockIdx.x, one thread per expert: route_token (router.cuh,
// shared with the one-launch decode router of router.cu). Top-k by rank (the v3 kernel ran k argmax passes on
// one warp, ~7 us).
constexpr int ROUTER_THREADS = ROUTER_MAX_E;
__global__ void __launch_bounds__(ROUTER_THREADS) router_kernel(const float* logits, const float* bias,
                                                                const int64_t* table, const int64_t* tok, int E,
                                                                int k, float scale, int32_t* ids, float* wts) {
  pdl_begin();
  route_token<false>(logits, bias, table, tok, blockIdx.x, E, k, scale, ids, wts);
}

// row_w != null: each row of `width` values is also multiplied by its weight row_w[row_of ? row_of[row] : row] (the
// prefill experts' routing weights, read through the expert order): the bits of a separate multiply after it.
__global__ void swiglu_kernel(const float* g, const float* u, int64_t n, float limit, float* out, const float* row_w,
                              int64_t width, const int64_t* row_of) {
  pdl_begin();
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  float a = fminf(g[i], limit);
  float b = fminf(fmaxf(u[i], -limit), limit);
  float v = a * sigmoidf_(a) * b;
  if (row_w) {
    const int64_t r = i / width;
    v = v * row_w[row_of ? row_of[r] : r];
  }
  out[i] = v;
}

// One compressor step (session._compress_step): store the token's kv and score (+ APE) in the
// frontier; on the last token of a window pool the candidates (softmax over the window per column),
// finish the row (norm, RoPE at the row's position, FP8 or FP4 simulation) and shift the frontier.
// Block b runs job b (a ratio-4 layer's two compressors in one launch: on its pooling steps they pool side by side).
__global__ void compress_step_kernel(CompressJob ja, CompressJob jb, const int64_t* pos, bool regs) {
  pdl_begin();
  extern __shared__ float sh[];
  __shared__ float red[32];
  const CompressJob& job = blockIdx.x == 0 ? ja : jb;
  const float* kv = job.kv;
  const float* sc = job.sc;
  const float* ape = job.ape;
  float* s_kv = job.s_kv;
  float* s_sc = job.s_sc;
  float* rows = job.rows;
  const int r = job.r, width = job.width;
  const RowPost& o = job.o;
  const int64_t p = *pos;
  const int slot = r == 4 ? 4 + (int)(p % 4) : (int)(p % r);
  const int phase = (int)(p % r);
  for (int j = threadIdx.x; j < width; j += blockDim.x) {
    s_kv[(int64_t)slot * width + j] = kv[j];
    s_sc[(int64_t)slot * width + j] = sc[j] + ape[(int64_t)phase * width + j];
  }
  if ((p + 1) % r != 0) return;  // uniform over the block: no row this step
  __syncthreads();
  const int d = r == 4 ? width / 2 : width;
  const int nc = r == 4 ? 8 : r;
  float* v = sh;
  float* tmp = sh + d;
  if (r == 4 && regs) {
    // ratio 4: the 8 candidates of a column are loaded together (all in flight at once), then pooled in the order
    // of the loop below, with the same expressions: the same bits, one L2 round trip instead of ~24 per column
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      float sc8[8], kv8[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t at = (int64_t)i * width + (i >= 4 ? d + j : j);
        sc8[i] = s_sc[at];
        kv8[i] = s_kv[at];
      }
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) mx = fmaxf(mx, sc8[i]);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += expf(sc8[i] - mx);
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc += kv8[i] * (expf(sc8[i] - mx) / sum);
      v[j] = isfinite(acc) ? acc : 0.0f;
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      float mx = -INFINITY;
      for (int i = 0; i < nc; ++i) {
        int64_t at = (int64_t)i * width + ((r == 4 && i >= 4) ? d + j : j);
        mx = fmaxf(mx, s_sc[at]);
      }
      float sum = 0.0f;
      for (int i = 0; i < nc; ++i) {
        int64_t at = (int64_t)i * width + ((r == 4 && i >= 4) ? d + j : j);
        sum += expf(s_sc[at] - mx);
      }
      float acc = 0.0f;
      for (int i = 0; i < nc; ++i) {
        int64_t at = (int64_t)i * width + ((r == 4 && i >= 4) ? d + j : j);
        acc += s_kv[at] * (expf(s_sc[at] - mx) / sum);
      }
      v[j] = isfinite(acc) ? acc : 0.0f;
    }
  }
  __syncthreads();
  // shift the frontier: ratio 4 keeps the finished window as the next one's previous half
  const int keep = r == 4 ? 4 : 0;
  if (r == 4 && regs) {
    for (int j = threadIdx.x; j < width; j += blockDim.x) {  // the four rows' loads before any store
      float kv4[4], sc4[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        kv4[i] = s_kv[(int64_t)(i + 4) * width + j];
        sc4[i] = s_sc[(int64_t)(i + 4) * width + j];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s_kv[(int64_t)i * width + j] = kv4[i];
        s_sc[(int64_t)i * width + j] = sc4[i];
        s_kv[(int64_t)(i + 4) * width + j] = 0.0f;
        s_sc[(int64_t)(i + 4) * width + j] = -INFINITY;
      }
    }
  } else {
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
      for (int i = 0; i < keep; ++i) {
        s_kv[(int64_t)i * width + j] = s_kv[(int64_t)(i + 4) * width + j];
        s_sc[(int64_t)i * width + j] = s_sc[(int64_t)(i + 4) * width + j];
      }
      for (int i = keep; i < (r == 4 ? 8 : r); ++i) {
        s_kv[(int64_t)i * width + j] = 0.0f;
        s_sc[(int64_t)i * width + j] = -INFINITY;
      }
    }
  }
  const int64_t row = (p + 1) / r - 1;
  row_post(v, tmp, d, (float)(row * r), o, red);
  for (int j = threadIdx.x; j < d; j += blockDim.x) rows[row * d + j] = v[j];
}

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
                                                                   float* part_o, float* part_ml) {
  pdl_begin();
  extern __shared__ __align__(16) float sh[];
  attn_partial_block(q, L, n_keys, d, hb, gridDim.y * hb, blockIdx.x, blockIdx.y, *pos, scale, part_o, part_ml, sh);
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
__device__ void attn_combine_heads(const float* part_o, const float* part_ml, int n_chunks, int H, int d, int h0,
                                   int nh, const float* sinks, float p, const RowPost& o, float* out, float* sh) {
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
  for (int i = warp; i < nh * ATT_VWARPS; i += nw) {
    const int vw = i / nh, hh = i % nh, h = h0 + hh;
    float mx = -INFINITY;
    for (int c = vw * 32 + lane; c < n_chunks; c += ATT_COMBINE_THREADS)
      mx = fmaxf(mx, __ldcg(part_ml + ((int64_t)c * H + h) * 2));
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
      const float m = __ldcg(part_ml + ((int64_t)c * H + h) * 2), l = __ldcg(part_ml + ((int64_t)c * H + h) * 2 + 1);
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
  const int d4 = d / 4, n4 = nh * d4;
  const int64_t cstride4 = (int64_t)H * d4;  // float4s from one chunk to the next
  for (int i = tid; i < n4; i += nt) {
    const int hh = i / d4;
    const float4* src = (const float4*)(part_o + (int64_t)(h0 + hh) * d) + i % d4;
    const float* w = wc + hh * n_chunks;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int c0 = 0; c0 < n_chunks; c0 += ATT_CHUNKS_AT_ONCE, src += ATT_CHUNKS_AT_ONCE * cstride4) {
      float4 x[ATT_CHUNKS_AT_ONCE];
#pragma unroll
      for (int k = 0; k < ATT_CHUNKS_AT_ONCE; ++k)
        x[k] = c0 + k < n_chunks ? __ldcg(src + k * cstride4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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
  for (int hh = 0; hh < nh; ++hh) row_post(v + hh * d, tmp, d, p, o, red);
  for (int i = tid; i < n4; i += nt) ((float4*)(out + (int64_t)h0 * d))[i] = ((const float4*)v)[i];
}

__global__ void __launch_bounds__(ATT_COMBINE_THREADS) attn_combine_kernel(const float* part_o, const float* part_ml,
                                                                           int n_chunks, int H, int d,
                                                                           const float* sinks, const int64_t* pos,
                                                                           RowPost o, float* out) {
  pdl_begin();
  extern __shared__ __align__(16) float sh[];
  attn_combine_heads(part_o, part_ml, n_chunks, H, d, blockIdx.x, 1, sinks, (float)*pos, o, out, sh);
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

// ---- launchers -------------------------------------------------------------------------------------

void launch_rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps, cudaStream_t s) {
  launch_k(rms_norm_kernel, dim3(rows), dim3(RMS_THREADS), 0, s, x, w, y, n, eps);
  DS4_CHECK_LAUNCH("rms_norm");
}

static void check_row_post(const RowPost& o, int d) {
  if (d > 2048) throw std::invalid_argument("row length above 2048");
  if (o.freq && (o.rope_dim <= 0 || o.rope_dim > d || o.rope_dim % 2)) throw std::invalid_argument("bad rope_dim");
  if (o.fp8_nope % 64 || o.fp8_nope > d) throw std::invalid_argument("fp8 part must be a multiple of 64");
  if (o.qat && (d % 32 || (d & (d - 1)))) throw std::invalid_argument("FP4 simulation needs a power-of-two row");
}

void launch_norm_rope(const NormRopeJob& a, const NormRopeJob* b, const int64_t* pos, cudaStream_t s,
                      const NormRopeJob* c) {
  if (c && !b) throw std::invalid_argument("norm_rope: a third job needs a second");
  NormRopeJob none = a;
  none.rows = 0;
  const NormRopeJob& jb = b ? *b : none;
  const NormRopeJob& jc = c ? *c : none;
  for (const NormRopeJob* j : {&a, &jb, &jc}) {
    check_row_post(j->o, j->d);
    if (j->rows < 0 || j->rows_per_token < 1) throw std::invalid_argument("norm_rope: bad row counts");
  }
  if (jb.rows == 0 && a.rows >= NR_WARP_MIN_ROWS && a.ring_cap <= 0 && a.d % 32 == 0 &&
      a.d <= NR_WARP_MAX_D && (a.d - a.o.rope_dim) % 2 == 0 &&
      norm_rope_warp_level() >= ((a.o.fp8_nope || a.o.qat) ? 2 : 1)) {
    const int per_block = NR_WARP_THREADS / 32;
    launch_k(norm_rope_warp_kernel, dim3((unsigned)((a.rows + per_block - 1) / per_block)), dim3(NR_WARP_THREADS), 0,
             s, a, pos);
    DS4_CHECK_LAUNCH("norm_rope_warp");
    return;
  }
  const int d = std::max(a.d, std::max(jb.rows ? jb.d : 0, jc.rows ? jc.d : 0));
  launch_k(norm_rope_kernel, dim3(a.rows + jb.rows + jc.rows), dim3(128), 2 * d * sizeof(float), s, a, jb, jc, pos);
  DS4_CHECK_LAUNCH("norm_rope");
}

void launch_router(const float* logits, const float* bias, const int64_t* table, const int64_t* tok, int T, int E,
                   int k, float scale, int32_t* ids, float* wts, cudaStream_t s) {
  if (E > 256 || k > 16 || k > E) throw std::invalid_argument("router: E <= 256 and k <= 16");
  launch_k(router_kernel, dim3(T), dim3(ROUTER_THREADS), 0, s, logits, bias, table, tok, E, k, scale, ids, wts);
  DS4_CHECK_LAUNCH("router");
}

void launch_swiglu(const float* g, const float* u, int64_t n, float limit, float* out, cudaStream_t s, const float* row_w,
                   int64_t width, const int64_t* row_of) {
  if (row_w && (width < 1 || n % width)) throw std::invalid_argument("swiglu: row weights need n a multiple of width >= 1");
  launch_k(swiglu_kernel, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s, g, u, n, limit, out, row_w, width,
           row_of);
  DS4_CHECK_LAUNCH("swiglu");
}

// $DS4_GPU_COMPRESS_REGS (v16, default 1): ratio-4 pooling and frontier shift with each column's candidates loaded
// together (the same bits); 0: the v15 loops, one dependent L2 round trip per candidate and pass.
static bool compress_regs() {
  static const bool on = [] {
    const char* e = std::getenv("DS4_GPU_COMPRESS_REGS");
    return !(e && e[0] == '0');
  }();
  return on;
}

void launch_compress_step(const CompressJob& a, const CompressJob* b, const int64_t* pos, cudaStream_t s) {
  int d = 0;
  for (const CompressJob* j : {&a, b}) {
    if (!j) continue;
    if (j->r < 1 || j->width < 1 || (j->r == 4 && j->width % 2)) throw std::invalid_argument("compress_step: bad shape");
    const int dj = j->r == 4 ? j->width / 2 : j->width;
    check_row_post(j->o, dj);
    d = std::max(d, dj);
  }
  launch_k(compress_step_kernel, dim3(b ? 2 : 1), dim3(256), 2 * d * sizeof(float), s, a, b ? *b : a, pos,
           compress_regs());
  DS4_CHECK_LAUNCH("compress_step");
}

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
           part_ml);
  DS4_CHECK_LAUNCH("attention partial");
  size_t shm2 = sizeof(float) * (size_t)attn_combine_floats(d, 1, nc);
  static size_t shm2_set = 0;
  if (shm2 > 48 * 1024 && shm2 > shm2_set) {
    DS4_CHECK(cudaFuncSetAttribute(attn_combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm2));
    shm2_set = shm2;
  }
  launch_k(attn_combine_kernel, dim3(H), dim3(ATT_COMBINE_THREADS), shm2, s, part_o, part_ml, nc, H, d, sinks, pos, o,
           out);
  DS4_CHECK_LAUNCH("attention combine");
}

}  // namespace ds4gpu
