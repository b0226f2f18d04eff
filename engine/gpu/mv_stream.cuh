// Batch-1 streaming matvec for Q8_0 and F16 weights: y_s[r] = W_s[r] . x for up to MV_MAX_SEG matrices
// of one width in one launch (segments: q_a + kv, shared gate + up, compressor kv + score (+ indexer proj)), or one
// block-diagonal matrix (groups: y[r] = W[r] . x[g(r)]).
//
// Why this kernel (v4, Q8_0 only: "matvec_q8"): the general one (matvec.cu) reached 0.46-0.54 of copy
// bandwidth on the 35.6 MB attention matrices, 0.2-0.3 on 4-9 MB ones and 0.04-0.6 on the F16 ones.
// Its costs are fixed per call: a separate activation quantization launch, one DRAM round trip per warp
// (for K = 1024 each lane does a single x block and the warp exits) and a partial last wave. This kernel
//   - stages x itself into shared memory (Q8_0: quantized with quantize_x_kernel's exact arithmetic;
//     F16: as float32), after the first weight loads are already in flight, so a call is one launch;
//   - optionally applies SwiGLU to x while staging it (x_op = MV_X_SWIGLU: x = [g | u] of 2 K values), so
//     the shared expert's down projection needs no separate SwiGLU kernel, or an RMS norm (x_op = MV_X_RMS:
//     x * rsqrt(mean(x^2) + eps) * w, the bits of rms_norm_kernel), so q_b needs no norm launch after q_a;
//   - runs a persistent grid (resident CTAs only); each warp walks row tiles gw, gw + NW, ... over all
//     segments and streams each tile in steps of C chunks, loading step n + 1 (two register buffers) before
//     it computes step n, so a warp always has one to two steps of loads outstanding;
//   - loads weights coalesced: lane l reads bytes 16 l .. 16 l + 15 of each 512-byte chunk of a row.
// Q8_0 numerics are those of the general kernel: per 32 columns the exact int32 sum 254 * (codes . hi) +
// (codes . lo) (two lanes' 16-column halves added with one shuffle) and one float FMA with d * x_scale;
// F16: f32 products of the f16 weights and the f32 activations. Only the order of float sums differs.
//
// With pdl the kernel is launched with programmatic dependent launch: the first weight loads are issued
// before griddepcontrol.wait (weights never depend on the previous kernel: upload synchronizes after its
// repack; x does), and the kernel lets its own successor start early, so back-to-back matvecs overlap
// their tails and heads.
#pragma once
#include <cstdlib>

#include "mv_core.cuh"

namespace ds4gpu {

constexpr int MV_CHUNK_BYTES = 512;  // one warp-wide 16-byte load per row
constexpr int MV_MAX_THREADS = 256;
constexpr int MV_MAX_SEG = 5;  // a ratio-4 layer's compressor matrices and the indexer's proj (decode)
constexpr int Q8_MAX_COLS = 16384;   // Q8_0 x planes in shared memory: 2.125 B per column (34 KB here)
constexpr int F16_MAX_COLS = 8192;   // F16: float32 x in shared memory (32 KB here)

// Columns of one chunk: 16 codes or 8 halves per lane.
template <int QT>
__host__ __device__ constexpr int chunk_cols() {
  return QT == QT_F16 ? MV_CHUNK_BYTES / 2 : MV_CHUNK_BYTES;
}

struct MvSeg {
  const uint8_t* qs;
  const uint8_t* sc;
  float* y;
  int rows;   // rows of this matrix (of one group when groups > 1)
  int tile0;  // first tile of this segment
};

struct MvArgs {
  int64_t qs_row, sc_row;
  // Bytes from group g's weights to group g + 1's in the codes and scales planes: rows_g rows (a block-diagonal matrix,
  // mv_args) or, for a matrix cut into column slices (launch_matvec_sliced), one slice's codes and scales of a row.
  int64_t gq, gs;
  int ncols;
  int nseg;
  MvSeg seg[MV_MAX_SEG];
  int tiles;   // tiles of one group over all segments
  int nsteps;  // steps of C chunks per row
  int kpad;    // nsteps * C * chunk columns: columns staged in shared memory (zeros past ncols)
  const float* x;  // [groups, ncols], or [g | u] of 2 ncols for MV_X_SWIGLU ...
  XQ xq;           // ... or (Q8_0, !quantize) already quantized planes
  int quantize;
  int x_op;
  float clamp;  // MV_X_SWIGLU: x = silu(min(g, c)) * clamp(u, -c, c)
  const float* norm_w;  // MV_X_RMS: x = rms_norm(x) * norm_w (null: no weight), one x vector (groups == 1) ...
  float eps;            // ... of at most MV_RMS_THREADS * 16 values, a multiple of 4
};

// The segment of a tile: its matrix, output and the tile's index inside it (nseg <= 4, uniform per warp;
// static indices keep the arguments in the constant bank).
struct SegView {
  const uint8_t* qs;
  const uint8_t* sc;
  float* y;
  int rows, t;
};
__device__ __forceinline__ SegView seg_of(const MvArgs& a, int tile) {
  SegView v{a.seg[0].qs, a.seg[0].sc, a.seg[0].y, a.seg[0].rows, tile};
#pragma unroll
  for (int i = 1; i < MV_MAX_SEG; ++i)
    if (i < a.nseg && tile >= a.seg[i].tile0) {
      v.qs = a.seg[i].qs;
      v.sc = a.seg[i].sc;
      v.y = a.seg[i].y;
      v.rows = a.seg[i].rows;
      v.t = tile - a.seg[i].tile0;
    }
  return v;
}

// One step of one warp: R rows x C chunks, one 16-byte load (and for Q8_0 one f16 scale) per (row, chunk).
template <int QT, int R, int C>
struct MvStep {
  uint4 q[R][C];
  uint32_t s[R][C];
};

template <int QT, int R, int C>
__device__ __forceinline__ void mv_load(const MvArgs& a, int g, int tile, int step, int lane, MvStep<QT, R, C>& o) {
  constexpr int CC = chunk_cols<QT>();
  constexpr int BPC = QT == QT_F16 ? 2 : 1;  // bytes per column
  const SegView sv = seg_of(a, tile);
  const int col0 = step * (C * CC) + (CC / 32) * lane;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    // rows past the end of the segment read its last row (never written)
    const int64_t row = min(sv.t * R + r, sv.rows - 1);
    const uint8_t* qrow = sv.qs + g * a.gq + row * a.qs_row;
    const uint8_t* srow = sv.sc + g * a.gs + row * a.sc_row;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = col0 + c * CC;
      if (col < a.ncols) {  // a lane's columns are all in or all out (ncols: multiple of 256 / 8)
        o.q[r][c] = ld_stream16(qrow + (int64_t)BPC * col);
        if constexpr (QT == QT_Q8_0) o.s[r][c] = ld_stream2(srow + 2 * (col >> 5));
      } else {
        o.q[r][c] = make_uint4(0, 0, 0, 0);
        o.s[r][c] = 0;  // f16 +0: the padded x scales are 0 too, so the term is exactly 0
      }
    }
  }
}

// x staged for F16: chunk k's 256 columns as two planes of 128, lane l's columns 8 l .. 8 l + 3 at
// [256 k + 4 l] and 8 l + 4 .. 8 l + 7 at [256 k + 128 + 4 l], so a warp's float4 reads are contiguous.
__device__ __forceinline__ int f16_slot(int col) {
  const int k = col >> 8, w = col & 255;
  return (k << 8) + ((w & 4) << 5) + ((w >> 3) << 2) + (w & 3);
}

// A lane's 16 Q8_0 codes against its 16 columns of x (hi, lo planes), summed with its neighbour lane's: the exact int32
// 254 (codes . hi) + (codes . lo) of the 32-column block (the same on both lanes of the pair).
__device__ __forceinline__ int q8_block_sum(const uint4& q, const int4& xh, const int4& xl) {
  int th = __dp4a((int)q.x, xh.x, 0), tl = __dp4a((int)q.x, xl.x, 0);
  th = __dp4a((int)q.y, xh.y, th);
  tl = __dp4a((int)q.y, xl.y, tl);
  th = __dp4a((int)q.z, xh.z, th);
  tl = __dp4a((int)q.z, xl.z, tl);
  th = __dp4a((int)q.w, xh.w, th);
  tl = __dp4a((int)q.w, xl.w, tl);
  const int t = 254 * th + tl;
  return t + __shfl_xor_sync(0xffffffffu, t, 1);
}

// A lane's 8 F16 weights (one 16-byte load) against its 8 columns of x (x0, x1): the product chain every F16 path
// (the streaming kernel, the router's cluster kernel) sums in this order, so their logits are the same bits.
__device__ __forceinline__ float f16_chunk_dot(const uint4& q, const float4& x0, const float4& x1) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&q.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&q.y));
  const float2 d = __half22float2(*reinterpret_cast<const __half2*>(&q.z));
  const float2 e = __half22float2(*reinterpret_cast<const __half2*>(&q.w));
  float s = a.x * x0.x;
  s = fmaf(a.y, x0.y, s);
  s = fmaf(b.x, x0.z, s);
  s = fmaf(b.y, x0.w, s);
  s = fmaf(d.x, x1.x, s);
  s = fmaf(d.y, x1.y, s);
  s = fmaf(e.x, x1.z, s);
  return fmaf(e.y, x1.w, s);
}

// acc[r] += this step's part of row r . x. Q8_0: only even lanes accumulate (they hold the 32-column sums).
template <int QT, int R, int C>
__device__ __forceinline__ void mv_consume(const MvStep<QT, R, C>& st, const unsigned char* smem, int kpad, int step,
                                           int lane, float (&acc)[R]) {
  if constexpr (QT == QT_F16) {
    const float4* s_x = (const float4*)smem;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int base = ((step * C + c) << 6) + lane;  // float4 index of the chunk's first plane
      const float4 x0 = s_x[base], x1 = s_x[base + 32];
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] += f16_chunk_dot(st.q[r][c], x0, x1);
    }
  } else {
    const int4* s_hi = (const int4*)smem;
    const int4* s_lo = (const int4*)(smem + kpad);
    const float* s_xs = (const float*)(smem + 2 * kpad);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int i16 = (step * C + c) * 32 + lane;  // 16-column unit of this lane
      const int4 xh = s_hi[i16], xl = s_lo[i16];
      const float xs = s_xs[i16 >> 1];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int t = q8_block_sum(st.q[r][c], xh, xl);
        if (!(lane & 1)) acc[r] = fmaf(half_bits(st.s[r][c]) * xs, (float)t, acc[r]);
      }
    }
  }
}

// Last step of a tile: sum over the lanes, write the R rows, reset.
template <int R>
__device__ __forceinline__ void mv_finish(const MvArgs& a, int g, int tile, int lane, float (&acc)[R]) {
  const SegView sv = seg_of(a, tile);
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);  // Q8_0: odd lanes hold 0
    const int rg = sv.t * R + r;
    if (lane == 2 * r && rg < sv.rows) sv.y[(int64_t)g * sv.rows + rg] = acc[r];
    acc[r] = 0.0f;
  }
}

__device__ __forceinline__ float swiglu1(float g, float u, float c) {
  const float a = fminf(g, c);
  return a * (1.0f / (1.0f + expf(-a))) * fminf(fmaxf(u, -c), c);  // swiglu_kernel's arithmetic
}

// Four consecutive x values at column col (a multiple of 4) of vector g: plain or SwiGLU of [g | u].
// COH: x was written by this same grid (a chained phase B), so L2 loads instead of the read-only path.
template <bool COH>
__device__ __forceinline__ float4 x_ld4(const float* p) {
  if constexpr (COH) return __ldcg((const float4*)p);
  else return __ldg((const float4*)p);
}

// MV_X_RMS reads x with plain loads (L2 loads when COH: x written by this same grid). x is q_a's output, written
// by the previous kernel; the weights of the norm through the read-only path.
template <bool COH>
__device__ __forceinline__ float4 x_ld4_plain(const float* p) {
  if constexpr (COH) return __ldcg((const float4*)p);
  else return *(const float4*)p;
}

// MV_X_RMS: the 1 / rms of the one x vector (a.ncols values) with the bits rms_norm_kernel (fused.cu) computes.
// That kernel runs RMS_THREADS = 512 threads; thread t sums the squares of its float4s i = t + 512 k (k < 4,
// zeros past the end) as ss += fma(w, w, fma(z, z, fma(x, x, y * y))) in k order (the contraction nvcc makes of
// its `v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w`: checked in its SASS), then block_sum: the xor-butterfly
// warp sum (16, 8, 4, 2, 1) and the 16 warp sums added in order from 0; r = rsqrtf(ss / n + eps). Here each warp
// plays that kernel's warps warp, warp + W, ... (cheap: a few thousand values, L2-resident) with the operations
// spelled out, so the compiler's contraction choices in this kernel cannot change the bits. The 16 sums go
// through the first 64 bytes of the x staging area (barriers on both sides; every thread of the CTA calls this).
constexpr int MV_RMS_THREADS = 512;  // fused.cu's RMS_THREADS
template <bool COH>
__device__ __forceinline__ float mv_rms_scale(const MvArgs& a, unsigned char* smem) {
  constexpr int VW = MV_RMS_THREADS / 32;
  const int lane = threadIdx.x & 31, W = blockDim.x >> 5;
  const int n4 = a.ncols >> 2;
  float* red = (float*)smem;
  for (int vw = threadIdx.x >> 5; vw < VW; vw += W) {
    const int t = 32 * vw + lane;
    float4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = t + k * MV_RMS_THREADS;
      v[k] = i < n4 ? x_ld4_plain<COH>(a.x + 4 * i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      ss = __fadd_rn(ss, __fmaf_rn(v[k].w, v[k].w, __fmaf_rn(v[k].z, v[k].z,
                                                             __fmaf_rn(v[k].x, v[k].x, __fmul_rn(v[k].y, v[k].y)))));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
    if (lane == 0) red[vw] = ss;
  }
  __syncthreads();
  float t = 0.0f;
#pragma unroll
  for (int i = 0; i < VW; ++i) t = __fadd_rn(t, red[i]);
  __syncthreads();  // the staging overwrites red
  return rsqrtf(__fadd_rn(__fdiv_rn(t, (float)a.ncols), a.eps));
}

// rr: MV_X_RMS's 1 / rms (mv_rms_scale); x * rr * w as rms_norm_kernel multiplies (two roundings, in that order).
template <bool COH>
__device__ __forceinline__ float4 x_load4(const MvArgs& a, int g, int col, float rr = 1.0f) {
  if (col >= a.ncols) return make_float4(0.f, 0.f, 0.f, 0.f);
  if (a.x_op == MV_X_RMS) {
    const float4 v = x_ld4_plain<COH>(a.x + col);
    if (!a.norm_w) return make_float4(__fmul_rn(v.x, rr), __fmul_rn(v.y, rr), __fmul_rn(v.z, rr), __fmul_rn(v.w, rr));
    const float4 w = __ldg((const float4*)(a.norm_w + col));
    return make_float4(__fmul_rn(__fmul_rn(v.x, rr), w.x), __fmul_rn(__fmul_rn(v.y, rr), w.y),
                       __fmul_rn(__fmul_rn(v.z, rr), w.z), __fmul_rn(__fmul_rn(v.w, rr), w.w));
  }
  if (a.x_op == MV_X_SWIGLU) {
    const float4 gv = x_ld4<COH>(a.x + col), uv = x_ld4<COH>(a.x + a.ncols + col);
    return make_float4(swiglu1(gv.x, uv.x, a.clamp), swiglu1(gv.y, uv.y, a.clamp), swiglu1(gv.z, uv.z, a.clamp),
                       swiglu1(gv.w, uv.w, a.clamp));
  }
  return x_ld4<COH>(a.x + (int64_t)g * a.ncols + col);
}

// x vector g -> shared memory, columns [0, kpad), zeros past ncols.
// Q8_0 quantize: the arithmetic of quantize_x_kernel (repack.cu), 8 lanes x 4 columns per x block, all
// loads of a thread issued before the first use. F16: float32 in the two-plane layout of f16_slot.
// rr: MV_X_RMS's 1 / rms of x (mv_rms_scale), which mv_stage_x computes first; mv_stage_x_rr takes it from a caller
// that stages one x twice (matvec_pair_kernel: the Q8_0 planes and the F16 floats).
template <int QT, bool COH = false>
__device__ __forceinline__ void mv_stage_x_rr(const MvArgs& a, int g, unsigned char* smem, float rr) {
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31;
  constexpr int QU = 8;
  if constexpr (QT == QT_F16) {
    float* s_x = (float*)smem;
    for (int base = 4 * tid; base < a.kpad; base += 4 * nthr * QU) {
      float4 v[QU];
#pragma unroll
      for (int u = 0; u < QU; ++u) v[u] = x_load4<COH>(a, g, base + u * 4 * nthr, rr);
#pragma unroll
      for (int u = 0; u < QU; ++u) {
        const int col = base + u * 4 * nthr;
        if (col < a.kpad) *(float4*)(s_x + f16_slot(col)) = v[u];
      }
    }
  } else if (a.quantize) {
    int8_t* s_hi = (int8_t*)smem;
    int8_t* s_lo = s_hi + a.kpad;
    float* s_xs = (float*)(s_lo + a.kpad);
    for (int base = 4 * tid; base < a.kpad; base += 4 * nthr * QU) {
      float4 v[QU];
#pragma unroll
      for (int u = 0; u < QU; ++u) v[u] = x_load4<COH>(a, g, base + u * 4 * nthr, rr);
#pragma unroll
      for (int u = 0; u < QU; ++u) {
        const int col = base + u * 4 * nthr;
        if (col >= a.kpad) break;  // uniform per warp: a warp spans 128 columns, kpad is a multiple of 512
        float amax = fmaxf(fmaxf(fabsf(v[u].x), fabsf(v[u].y)), fmaxf(fabsf(v[u].z), fabsf(v[u].w)));
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float s = amax / 127.0f;
        const float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
        uint32_t hw = 0, lw = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          int h = 0, l = 0;
          if (amax > 0.0f) {
            const float t = e[k] / s;
            const float hr = rintf(t);
            h = (int)hr;
            l = (int)rintf((t - hr) * 254.0f);
            l = max(-127, min(127, l));
          }
          hw |= (uint32_t)(uint8_t)(int8_t)h << (8 * k);
          lw |= (uint32_t)(uint8_t)(int8_t)l << (8 * k);
        }
        *(uint32_t*)(s_hi + col) = hw;
        *(uint32_t*)(s_lo + col) = lw;
        if ((lane & 7) == 0) s_xs[col >> 5] = s / 254.0f;
      }
    }
  } else {
    int8_t* s_hi = (int8_t*)smem;
    int8_t* s_lo = s_hi + a.kpad;
    float* s_xs = (float*)(s_lo + a.kpad);
    const int4* hi = (const int4*)(a.xq.hi + (int64_t)g * a.xq.n);
    const int4* lo = (const int4*)(a.xq.lo + (int64_t)g * a.xq.n);
    const float* sc = a.xq.scale + (int64_t)g * (a.xq.n / 32);
    const int4 z = make_int4(0, 0, 0, 0);
    for (int i = tid; i < a.kpad / 16; i += nthr) {
      const bool in = 16 * i < a.ncols;
      ((int4*)s_hi)[i] = in ? __ldg(hi + i) : z;
      ((int4*)s_lo)[i] = in ? __ldg(lo + i) : z;
    }
    for (int i = tid; i < a.kpad / 32; i += nthr) s_xs[i] = 32 * i < a.ncols ? __ldg(sc + i) : 0.0f;
  }
}

template <int QT, bool COH = false>
__device__ __forceinline__ void mv_stage_x(const MvArgs& a, int g, unsigned char* smem) {
  const float rr = a.x_op == MV_X_RMS ? mv_rms_scale<COH>(a, smem) : 1.0f;  // uniform: barriers inside
  mv_stage_x_rr<QT, COH>(a, g, smem, rr);
}

// The streaming loop of one matvec for CTA `cta` of the `nctas` working on group g: each warp walks row tiles
// cta * W + warp, + nctas * W, ...; A holds the warp's first step, already loaded by the caller when that tile
// exists (weights never depend on earlier kernels, so callers issue those loads as early as they can).
// mv_loop_w: the same for warp w of nw warps that share the matrix (mv_loop: all warps of the grid); A holds its
// first step (mv_first_load_w).
template <int QT, int R, int C>
__device__ __forceinline__ void mv_loop_w(const MvArgs& a, int g, int w, int nw, const unsigned char* smem,
                                          MvStep<QT, R, C>& A) {
  const int lane = threadIdx.x & 31;
  const int T = a.tiles, NW = nw;
  MvStep<QT, R, C> B;
  int ta = w, sa = 0;  // the step buffer A holds
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const int last = a.nsteps - 1;
  while (ta < T) {
    int tb = ta, sb = sa + 1;  // the step after A's, into B
    if (sb > last) { sb = 0; tb += NW; }
    if (tb < T) mv_load<QT, R, C>(a, g, tb, sb, lane, B);
    mv_consume<QT, R, C>(A, smem, a.kpad, sa, lane, acc);
    if (sa == last) mv_finish<R>(a, g, ta, lane, acc);
    if (tb >= T) break;
    ta = tb;  // the step after B's, into A
    sa = sb + 1;
    if (sa > last) { sa = 0; ta += NW; }
    if (ta < T) mv_load<QT, R, C>(a, g, ta, sa, lane, A);
    mv_consume<QT, R, C>(B, smem, a.kpad, sb, lane, acc);
    if (sb == last) mv_finish<R>(a, g, tb, lane, acc);
  }
}

template <int QT, int R, int C>
__device__ __forceinline__ void mv_loop(const MvArgs& a, int g, int cta, int nctas, const unsigned char* smem,
                                        MvStep<QT, R, C>& A) {
  const int W = blockDim.x >> 5;
  mv_loop_w<QT, R, C>(a, g, cta * W + (threadIdx.x >> 5), nctas * W, smem, A);
}

// The first step of warp w's first tile into A (nothing when the warp has no tile); mv_first_load: w from the CTA.
template <int QT, int R, int C>
__device__ __forceinline__ void mv_first_load_w(const MvArgs& a, int g, int w, MvStep<QT, R, C>& A) {
  if (w < a.tiles) mv_load<QT, R, C>(a, g, w, 0, threadIdx.x & 31, A);
}
template <int QT, int R, int C>
__device__ __forceinline__ void mv_first_load(const MvArgs& a, int g, int cta, MvStep<QT, R, C>& A) {
  mv_first_load_w<QT, R, C>(a, g, cta * (blockDim.x >> 5) + (threadIdx.x >> 5), A);
}

// ---- host side: the launch plan shared by the plain and the chained launches (sm_count: common.cuh) ----

// A launch's shape: rows per tile R, chunks per step C, threads per CTA, shared memory for x.
struct MvPlan {
  int R, C, threads;
  size_t smem;
};

// Fills a's tiles, steps and padded width; rows: rows of one group over all segments. full_r: R = 8 / C always
// (matvec_pair_kernel, templated on C only; R and C do not change a row's summation order, so neither the bits).
template <int QT>
MvPlan mv_plan(MvArgs& a, int groups, int64_t rows, bool full_r = false) {
  constexpr int CC = chunk_cols<QT>();
  const int nchunks = (a.ncols + CC - 1) / CC;
  const int C = nchunks <= 2 ? 2 : (nchunks <= 4 ? 4 : 8);
  // R * C = 8 chunks per step (~40 registers per buffer); fewer rows per tile while that leaves fewer
  // than 16 tiles per SM, or when R does not divide the rows of a group (groups > 1)
  int R = 8 / C;
  const int64_t want = (int64_t)sm_count() * 16;
  while (!full_r && R > 1 && ((groups > 1 && a.seg[0].rows % R) || (int64_t)groups * ((rows + R - 1) / R) < want))
    R /= 2;
  int tiles = 0;
  for (int i = 0; i < a.nseg; ++i) {
    a.seg[i].tile0 = tiles;
    tiles += (a.seg[i].rows + R - 1) / R;
  }
  a.tiles = tiles;
  a.nsteps = (a.ncols + C * CC - 1) / (C * CC);
  a.kpad = a.nsteps * C * CC;
  const size_t smem = QT == QT_F16 ? 4 * (size_t)a.kpad : 2 * (size_t)a.kpad + (size_t)a.kpad / 32 * 4;
  // 8 warps per CTA amortize the x staging; 4 when that would leave SMs without a CTA
  const int threads = (int64_t)groups * a.tiles >= (int64_t)sm_count() * 8 ? 256 : 128;
  return MvPlan{R, C, threads, smem};
}

// The arguments for ys[i] = ws[i] . x (segments of one width and type, or one grouped matrix); false when the
// streaming kernel does not take them. rows: rows of one group over all segments.
inline bool mv_args(const Packed* const* ws, float* const* ys, int nw, const float* x, const XQ* xq, int groups,
                    int x_op, float clamp, MvArgs& a, int64_t& rows) {
  if (nw < 1 || nw > MV_MAX_SEG || groups < 1 || groups > 65535 || (nw > 1 && groups > 1)) return false;
  const Packed& w0 = *ws[0];
  const int qt = w0.qtype;
  const int64_t K = w0.ncols;
  if (qt == QT_Q8_0 ? (K % 256 || K > Q8_MAX_COLS) : (qt != QT_F16 || K % 8 || K > F16_MAX_COLS)) return false;
  if (x_op == MV_X_SWIGLU && (groups > 1 || xq != nullptr)) return false;
  if (xq != nullptr && (qt != QT_Q8_0 || (((uintptr_t)xq->hi | (uintptr_t)xq->lo) & 15) || xq->n % 16)) return false;
  if (xq == nullptr && ((uintptr_t)x & 15)) return false;  // 16-byte vector loads (torch views may start anywhere)
  a = MvArgs{};
  rows = 0;
  for (int i = 0; i < nw; ++i) {
    const Packed& w = *ws[i];
    if (w.qtype != qt || w.ncols != K || w.qs_row != w0.qs_row || w.sc_row != w0.sc_row || w.nrows < 1 ||
        w.nrows % groups || w.nrows / groups > (1 << 30))
      return false;
    a.seg[i] = MvSeg{w.qs, w.sc, ys[i], (int)(w.nrows / groups), 0};
    rows += w.nrows / groups;
  }
  a.qs_row = w0.qs_row;
  a.sc_row = w0.sc_row;
  a.gq = (w0.nrows / groups) * w0.qs_row;
  a.gs = (w0.nrows / groups) * w0.sc_row;
  a.ncols = (int)K;
  a.nseg = nw;
  a.x = x;
  if (xq) a.xq = *xq;
  a.quantize = xq == nullptr ? 1 : 0;
  a.x_op = x_op;
  a.clamp = clamp;
  return true;
}

// $DS4_GPU_MV_PER_SM caps the persistent grid's CTAs per SM (default: as many as fit, 2 for most shapes).
// Why it may matter: at 2 CTAs x 256 threads x up to 127 registers the kernel holds the whole register file,
// so the next kernel's CTAs cannot become resident early under programmatic dependent launch and its first
// weight loads wait for this grid's tail. With 1 CTA per SM (8 warps, 2 steps each in flight: ~8 MB on the
// GPU, more than the ~3 MB the DRAM latency needs) there is room for them. Read once; an A/B switch.
// mv_cap_override() (ext.set_mv_cap) replaces it while > 0: the session caps the launches it puts on a side
// branch of the decode graph, so the main branch's kernels find room beside them.
inline int& mv_cap_override() {
  static int v = 0;
  return v;
}
inline int mv_ctas_per_sm() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_MV_PER_SM");
    return e ? atoi(e) : 0;
  }();
  return mv_cap_override() > 0 ? mv_cap_override() : v;
}

}  // namespace ds4gpu
