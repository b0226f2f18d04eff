// Fused kernels for the non-matvec work of a DeepSeek V4 layer (model-spec §3.3-3.7; the mHC kernels are in
// hc.cu, the decode attention in attn_decode.cu), one launch per chain that the torch graph ran as 5-40 small kernels. Each mirrors ds4.engine.gpu.ops / session.py
// operation for operation (same formulas, same roundings of the FP8/FP4 simulations); only summation
// orders differ. Decode (T = 1) reads the position from device memory, so a CUDA graph can replay it.
#include <math.h>

#include <algorithm>
#include <cstdlib>

#include "block_ops.cuh"
#include "common.cuh"
#include "router.cuh"
#include "row_block.cuh"
#include "row_warp.cuh"

namespace ds4gpu {

namespace {

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
// pre ($DS4_GPU_PREWAIT): the position, the norm weight and the RoPE factors are staged before the wait
// (row_post_stage; needs 4 d floats of shared memory), so after it only the row's own load is an L2 round trip.
template <bool PRE>
__global__ void norm_rope_kernel(NormRopeJob a, NormRopeJob b, NormRopeJob c, const int64_t* pos) {
  extern __shared__ float sh[];
  __shared__ float red[32];
  const int bi = (int)blockIdx.x;
  const int which = bi < a.rows ? 0 : (bi < a.rows + b.rows ? 1 : 2);
  const NormRopeJob& j = which == 0 ? a : (which == 1 ? b : c);
  const int d = j.d;
  float* v = sh;
  float* tmp = sh + d;
  const int row = bi - (which > 0 ? a.rows : 0) - (which > 1 ? b.rows : 0), t = row / j.rows_per_token;
  if constexpr (PRE) {
    pdl_trigger();
    const int64_t p = pos ? pos[t] : 0;
    float* cs = sh + 3 * d;
    const RowPost o = row_post_stage(j.o, d, (float)p, sh + 2 * d, cs);
    pdl_wait();  // x (and in_scale) are the previous kernel's
    const float in_s = j.in_scale ? j.in_scale[t] : 1.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      const float x = j.x[(int64_t)row * d + i];
      v[i] = j.in_scale ? x * in_s : x;
    }
    __syncthreads();
    row_post(v, tmp, d, (float)p, o, red, cs);
    const int64_t orow = j.ring_cap > 0 ? p % j.ring_cap : row;
    for (int i = threadIdx.x; i < d; i += blockDim.x) j.out[orow * d + i] = v[i];
    return;
  }
  pdl_begin();
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
// g_scale, u_scale != null ($DS4_GPU_FOLD_SWIGLU, v28, prepared): g and u are GEMM products whose per-row rescale
// (weights.mm_unscaled) is applied here as they are read, __fmul_rn (never fused into what follows): the bits of a
// torch multiply first.
__global__ void swiglu_kernel(const float* g, const float* u, int64_t n, float limit, float* out, const float* row_w,
                              int64_t width, const int64_t* row_of, const float* g_scale, const float* u_scale) {
  pdl_begin();
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gi = g_scale ? __fmul_rn(g[i], g_scale[i / width]) : g[i];
  const float ui = u_scale ? __fmul_rn(u[i], u_scale[i / width]) : u[i];
  float a = fminf(gi, limit);
  float b = fminf(fmaxf(ui, -limit), limit);
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
// A ratio-4 step with $DS4_GPU_PREWAIT: before the wait, the position and (on pooling steps) the norm weight and the
// RoPE factors of the finished row (row_post_stage); after it, each thread loads everything its columns need at once
// (this token's kv and score, the APE row, the window's other candidates), pools them in registers with the
// expressions of the regs path below, and stores the shifted frontier straight from registers: one L2 round trip
// where the regs path has ~8 (store, reload, one per pooled column, one per shifted column, the weights). The values
// stored and pooled are the regs path's, so the same bits. Thread t takes columns j = t, t + nt, ... of the first half
// and d + j of the second; CJ columns' loads are issued together. Needs 4 d floats of shared memory.
constexpr int CJ = 2;
__device__ void compress_step_r4_prewait(const CompressJob& job, const int64_t* pos, float* sh, float* red) {
  const int width = job.width, d = width / 2, tid = threadIdx.x, nt = blockDim.x;
  pdl_trigger();
  const int64_t p = *pos;
  const int phase = (int)(p % 4), slot = 4 + phase;
  const bool pool = (p + 1) % 4 == 0;
  const int64_t row = (p + 1) / 4 - 1;
  float* v = sh;
  float* cs = sh + 3 * d;
  const RowPost o = pool ? row_post_stage(job.o, d, (float)(row * 4), sh + 2 * d, cs) : job.o;
  const float* ape = job.ape + (int64_t)phase * width;
  float* s_kv = job.s_kv;
  float* s_sc = job.s_sc;
  pdl_wait();  // kv and sc are the previous kernel's
  // deferred products (comp_defer.py): phases 0-2 of the window whose positions are at or after *start come from the
  // ring's rows (the score plus its APE row, as the step that stored it would have written it); a bitmask of them
  int from_ring = 0;
  if (pool && job.ring_kv) {
    const int64_t first = p - 3, st = *job.start;
    for (int ph = 0; ph < 3; ++ph) from_ring |= (first + ph >= st) << ph;
  }
  for (int j0 = tid; j0 < d; j0 += CJ * nt) {
    // [u][i]: column j0 + u nt; a: slots 0-7 of the first-half column j, b: slots 4-7 of the second-half column d + j
    float nk[CJ][2], ns[CJ][2], ak[CJ][8], as[CJ][8], bk[CJ][4], bs[CJ][4];
#pragma unroll
    for (int u = 0; u < CJ; ++u) {
      const int j = j0 + u * nt;
      if (j >= d) break;
      nk[u][0] = job.kv[j];
      nk[u][1] = job.kv[d + j];
      ns[u][0] = job.sc[j] + ape[j];
      ns[u][1] = job.sc[d + j] + ape[d + j];
      if (!pool) continue;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        ak[u][i] = i == slot ? 0.0f : s_kv[(int64_t)i * width + j];
        as[u][i] = i == slot ? 0.0f : s_sc[(int64_t)i * width + j];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        bk[u][i] = i + 4 == slot ? 0.0f : s_kv[(int64_t)(i + 4) * width + d + j];
        bs[u][i] = i + 4 == slot ? 0.0f : s_sc[(int64_t)(i + 4) * width + d + j];
      }
    }
#pragma unroll
    for (int u = 0; u < CJ; ++u) {
      const int j = j0 + u * nt;
      if (j >= d) break;
      if (!pool) {  // this token's kv and score into its slot of the frontier, nothing else
        s_kv[(int64_t)slot * width + j] = nk[u][0];
        s_kv[(int64_t)slot * width + d + j] = nk[u][1];
        s_sc[(int64_t)slot * width + j] = ns[u][0];
        s_sc[(int64_t)slot * width + d + j] = ns[u][1];
        continue;
      }
#pragma unroll
      for (int i = 4; i < 8; ++i) {  // this token's slot (a runtime index: selects keep the arrays in registers)
        if (i == slot) ak[u][i] = nk[u][0], as[u][i] = ns[u][0], bk[u][i - 4] = nk[u][1], bs[u][i - 4] = ns[u][1];
      }
      if (from_ring) {
#pragma unroll
        for (int ph = 0; ph < 3; ++ph) {
          if (!(from_ring >> ph & 1)) continue;
          const int64_t o0 = (int64_t)ph * width;
          ak[u][4 + ph] = job.ring_kv[o0 + j];
          as[u][4 + ph] = job.ring_sc[o0 + j] + job.ape[o0 + j];
          bk[u][ph] = job.ring_kv[o0 + d + j];
          bs[u][ph] = job.ring_sc[o0 + d + j] + job.ape[o0 + d + j];
        }
      }
      float sc8[8], kv8[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        sc8[i] = i < 4 ? as[u][i] : bs[u][i - 4];
        kv8[i] = i < 4 ? ak[u][i] : bk[u][i - 4];
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
      // the frontier shifted: the window's slots 4-7 become 0-3, slots 4-7 empty
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s_kv[(int64_t)i * width + j] = ak[u][i + 4];
        s_sc[(int64_t)i * width + j] = as[u][i + 4];
        s_kv[(int64_t)i * width + d + j] = bk[u][i];
        s_sc[(int64_t)i * width + d + j] = bs[u][i];
        s_kv[(int64_t)(i + 4) * width + j] = 0.0f;
        s_sc[(int64_t)(i + 4) * width + j] = -INFINITY;
        s_kv[(int64_t)(i + 4) * width + d + j] = 0.0f;
        s_sc[(int64_t)(i + 4) * width + d + j] = -INFINITY;
      }
    }
  }
  if (!pool) return;  // uniform over the block
  __syncthreads();
  row_post(v, sh + d, d, (float)(row * 4), o, red, cs);
  for (int j = tid; j < d; j += nt) job.rows[row * d + j] = v[j];
}

// The pooling of ratios other than 4 with $DS4_GPU_COMPRESS_WIDE=1 (prepared in v24, default since v25): the v15 loops
// give each thread whole columns, i.e. 3 x r dependent-ish L2 loads per column (bench_compress: 118 us per ratio-128
// pooling step, on one token in 128; this form 28.8 us). Here the 8 warps split a column group's r candidates (r / 8 each), every thread
// loads its candidates of two column groups at once, pools them with a split softmax (its max, then sum e and sum kv e),
// and warp 0 combines the 8 warps' parts rescaled to the common max. Not the loops' bits (another summation order and
// A / S instead of sum kv (e / S)); the same outcome for NaN or infinite inputs (0). Needs 256 threads, r % 8 == 0,
// r / 8 <= POOL_WIDE_CPW and d % 32 == 0 (compress_wide_takes).
constexpr int POOL_WIDE_CPW = 16, POOL_WIDE_GROUPS = 2;
__host__ __device__ constexpr bool compress_wide_fits(int r, int d) {
  return r != 4 && r % 8 == 0 && r / 8 <= POOL_WIDE_CPW && d % (32 * POOL_WIDE_GROUPS) == 0;
}
__device__ void pool_wide(const float* s_kv, const float* s_sc, int width, int d, int nc, float* v) {
  __shared__ float part[3][POOL_WIDE_GROUPS][8][32];  // [m, sum e, sum kv e][group][warp][lane]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cpw = nc / 8, i0 = warp * cpw;
  for (int g0 = 0; g0 < d / 32; g0 += POOL_WIDE_GROUPS) {
    float t[POOL_WIDE_GROUPS][POOL_WIDE_CPW], k[POOL_WIDE_GROUPS][POOL_WIDE_CPW];
#pragma unroll
    for (int q = 0; q < POOL_WIDE_GROUPS; ++q) {
      const int j = 32 * (g0 + q) + lane;
#pragma unroll
      for (int u = 0; u < POOL_WIDE_CPW; ++u) {
        t[q][u] = u < cpw ? s_sc[(int64_t)(i0 + u) * width + j] : -INFINITY;
        k[q][u] = u < cpw ? s_kv[(int64_t)(i0 + u) * width + j] : 0.0f;
      }
    }
#pragma unroll
    for (int q = 0; q < POOL_WIDE_GROUPS; ++q) {
      float m = -INFINITY;
#pragma unroll
      for (int u = 0; u < POOL_WIDE_CPW; ++u) m = fmaxf(m, t[q][u]);
      float se = 0.0f, sa = 0.0f;
      if (m != -INFINITY) {
#pragma unroll
        for (int u = 0; u < POOL_WIDE_CPW; ++u) {
          if (u >= cpw) break;
          const float e = expf(t[q][u] - m);
          se += e;
          sa += k[q][u] * e;
        }
      }
      part[0][q][warp][lane] = m;
      part[1][q][warp][lane] = se;
      part[2][q][warp][lane] = sa;
    }
    __syncthreads();
    if (warp < POOL_WIDE_GROUPS) {  // warp q combines group g0 + q
      const int q = warp;
      float M = -INFINITY;
      for (int w = 0; w < 8; ++w) M = fmaxf(M, part[0][q][w][lane]);
      float S = 0.0f, A = 0.0f;
      if (M != -INFINITY) {
        for (int w = 0; w < 8; ++w) {
          const float mw = part[0][q][w][lane];
          if (mw == -INFINITY) continue;
          const float f = expf(mw - M);
          S += part[1][q][w][lane] * f;
          A += part[2][q][w][lane] * f;
        }
      }
      const float val = A / S;
      v[32 * (g0 + q) + lane] = isfinite(val) ? val : 0.0f;
    }
    __syncthreads();
  }
}

template <bool PRE, bool WIDE = false>
__global__ void compress_step_kernel(CompressJob ja, CompressJob jb, const int64_t* pos, int regs) {
  extern __shared__ float sh[];
  __shared__ float red[32];
  const CompressJob& job = blockIdx.x == 0 ? ja : jb;
  if (PRE && job.r == 4) {
    compress_step_r4_prewait(job, pos, sh, red);
    return;
  }
  pdl_begin();
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
  if (WIDE && compress_wide_fits(r, d) && blockDim.x == 256) {
    pool_wide(s_kv, s_sc, width, d, nc, v);
  } else if (r == 4 && regs) {
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

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------

void launch_rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps, cudaStream_t s) {
  launch_k(rms_norm_kernel, dim3(rows), dim3(RMS_THREADS), 0, s, x, w, y, n, eps);
  DS4_CHECK_LAUNCH("rms_norm");
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
  const int pre = prewait_mode();
  launch_k(pre ? norm_rope_kernel<true> : norm_rope_kernel<false>, dim3(a.rows + jb.rows + jc.rows), dim3(128),
           (pre ? 4 : 2) * d * sizeof(float), s, a, jb, jc, pos);
  DS4_CHECK_LAUNCH("norm_rope");
}

void launch_router(const float* logits, const float* bias, const int64_t* table, const int64_t* tok, int T, int E,
                   int k, float scale, int32_t* ids, float* wts, cudaStream_t s) {
  if (E > 256 || k > 16 || k > E) throw std::invalid_argument("router: E <= 256 and k <= 16");
  launch_k(router_kernel, dim3(T), dim3(ROUTER_THREADS), 0, s, logits, bias, table, tok, E, k, scale, ids, wts);
  DS4_CHECK_LAUNCH("router");
}

void launch_swiglu(const float* g, const float* u, int64_t n, float limit, float* out, cudaStream_t s, const float* row_w,
                   int64_t width, const int64_t* row_of, const float* g_scale, const float* u_scale) {
  if ((row_w || g_scale || u_scale) && (width < 1 || n % width))
    throw std::invalid_argument("swiglu: row weights or scales need n a multiple of width >= 1");
  launch_k(swiglu_kernel, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s, g, u, n, limit, out, row_w, width,
           row_of, g_scale, u_scale);
  DS4_CHECK_LAUNCH("swiglu");
}

// $DS4_GPU_COMPRESS_REGS (v16, default 1): ratio-4 pooling and frontier shift with each column's candidates loaded
// together (the same bits); 0: the v15 loops, one dependent L2 round trip per candidate and pass. (v23's mode 2, the
// other ratios' pooling with 16 candidates' loads in flight, measured slower in v24: bench_compress's ratio-128 pooling
// step 135.8 against 117.5 us; removed.) set_compress_regs overrides it (0, 1; -1 the environment).
static EnvSwitch compress_regs_switch{"DS4_GPU_COMPRESS_REGS", 1, 1};
void set_compress_regs(int mode) { compress_regs_switch.set(mode); }
static int compress_regs() { return compress_regs_switch.get(); }

// $DS4_GPU_COMPRESS_WIDE (v25, default 1): the pooling of ratios other than 4 by pool_wide (not the v15 loops' bits;
// the ratio-128 pooling step 118 -> 28.8 us); 0: the v15 loops. set_compress_wide overrides it (0, 1; -1 the environment).
static EnvSwitch compress_wide_switch{"DS4_GPU_COMPRESS_WIDE", 1, 1};
void set_compress_wide(int mode) { compress_wide_switch.set(mode); }
static int compress_wide() { return compress_wide_switch.get(); }

// $DS4_GPU_PREWAIT (v24, default 2): 1 = norm_rope, the ratio-4 compressor steps and the attention combine stage the
// position, the norm weights and the RoPE factors before griddepcontrol.wait, and the ratio-4 step loads its window at
// once (the same bits; decode 6.05 / 6.09 -> 5.97 / 6.01 ms at 2k / 8k); 2 = also the mHC pre's scale, base and norm
// weight, the router's bias, the position in the attention partials, the top-k and the index keys, and the index keys'
// older rows (the same bits; 5.94 / 6.03 -> 5.86 / 5.93 ms); 0 = the v23 kernels. set_prewait overrides it (0-2; -1 the
// environment).
static EnvSwitch prewait_switch{"DS4_GPU_PREWAIT", 2, 2};
void set_prewait(int mode) { prewait_switch.set(mode); }
int prewait_mode() { return prewait_switch.get(); }

bool compress_ring_takes(int r) { return r == 4 && prewait_mode() >= 1; }

void launch_compress_step(const CompressJob& a, const CompressJob* b, const int64_t* pos, cudaStream_t s) {
  int d = 0;
  for (const CompressJob* j : {&a, b}) {
    if (!j) continue;
    if (j->r < 1 || j->width < 1 || (j->r == 4 && j->width % 2)) throw std::invalid_argument("compress_step: bad shape");
    if (j->ring_kv && (!j->ring_sc || !j->start || !compress_ring_takes(j->r)))
      throw std::invalid_argument("compress_step: deferred products need ratio 4, PREWAIT and all three pointers");
    const int dj = j->r == 4 ? j->width / 2 : j->width;
    check_row_post(j->o, dj);
    d = std::max(d, dj);
  }
  const int pre = prewait_mode();
  // the wide pooling in instantiations of its own, so the default kernels keep their code
  auto* kernel = compress_wide() ? (pre ? compress_step_kernel<true, true> : compress_step_kernel<false, true>)
                                 : (pre ? compress_step_kernel<true> : compress_step_kernel<false>);
  launch_k(kernel, dim3(b ? 2 : 1), dim3(256), (pre ? 4 : 2) * d * sizeof(float), s, a, b ? *b : a, pos,
           compress_regs());
  DS4_CHECK_LAUNCH("compress_step");
}

}  // namespace ds4gpu
