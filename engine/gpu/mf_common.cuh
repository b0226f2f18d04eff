// Shared by the float16 expert products on the codes (mmf.cu: mma.sync; mmw.cu: wgmma): their arguments, the codes as
// exact float16 integers, and a CTA's tile of the expert tile table.
#pragma once
#include <cuda_fp16.h>

#include "common.cuh"

namespace ds4gpu {
namespace {

struct MfArgs {
  Packed w;
  int K, nb;                      // columns; 256-column super-blocks per row
  const __half *xh, *xl;          // [R, K]: x / s = hi + lo
  const __half *mh, *ml;          // [R, K / 256, 16]: the group sums of x / s, split (K-quants)
  const float* s;                 // [R]
  float* y;                       // [R, rows_g]
  int rows_g;
  const int4* tiles;              // (first activation row, rows <= the tile rows, expert, 0) per grid.y
};

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Four int8 codes (signed, or unsigned 0..255) times mult as four exact float16: each byte becomes the low byte of a
// float16 1024 + b (bits 0x64bb; signed bytes biased by 128 first), then 1024 (or 1152) comes off and mult goes on,
// both exact below 2048.
template <bool SIGNED>
__device__ __forceinline__ uint2 codes_half(uint32_t w, __half2 mult) {
  if constexpr (SIGNED) w ^= 0x80808080u;
  const __half2 off = __half2half2(__ushort_as_half(SIGNED ? (unsigned short)0x6480 : (unsigned short)0x6400));
  const __half2 a = __hsub2(bits_h2(__byte_perm(w, 0x64646464u, 0x4140)), off);
  const __half2 b = __hsub2(bits_h2(__byte_perm(w, 0x64646464u, 0x4342)), off);
  return make_uint2(h2_bits(__hmul2(a, mult)), h2_bits(__hmul2(b, mult)));
}

struct MfTile {
  int64_t a0, wrow0;
  int an, r0;
};

// This CTA's tile of M weight rows x at most N activation rows (mmf: 64 x 128, mmw: 128 x 64).
template <int M, int N>
__device__ __forceinline__ MfTile mf_tile(const MfArgs& a) {
  const int4 e = a.tiles[blockIdx.y];
  MfTile t;
  t.r0 = blockIdx.x * M;
  t.a0 = e.x;
  t.an = min(e.y, N);  // a longer tile would overrun the shared planes: its extra rows are not computed
  t.wrow0 = (int64_t)e.z * a.rows_g;
  return t;
}

// The kernels' arguments for experts of w (mmf and mmw alike; mmw reads no group sums).
MfArgs mf_args(const Packed& w, int n_expert, const MmfActivations& x, const int4* tiles, float* y) {
  MfArgs a;
  a.w = w;
  a.K = (int)w.ncols;
  a.nb = (int)(w.ncols / 256);
  a.xh = x.hi;
  a.xl = x.lo;
  a.mh = x.sum_hi;
  a.ml = x.sum_lo;
  a.s = x.scale;
  a.y = y;
  a.rows_g = (int)(w.nrows / n_expert);
  a.tiles = tiles;
  return a;
}

}  // namespace
}  // namespace ds4gpu
