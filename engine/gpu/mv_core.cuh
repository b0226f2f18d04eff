// The inner loop shared by the matvec and MoE kernels: R weight rows times NB quantized activation
// vectors over the x blocks a lane owns, decoded straight from the device layout (common.cuh).
//
// Why this shape: decode is bandwidth-bound only if each weight costs ~1-2 integer instructions.
// Activations are pre-quantized to int8 hi/lo planes (x = s (254 hi + lo)), so every quant type
// reduces to int8 codes and __dp4a (4 MACs per instruction) with exact int32 sums per 32 columns;
// one float multiply-add per 32 columns applies the block scales. The x words are loaded once per
// x block and reused for all R rows.
#pragma once

#include "common.cuh"

namespace ds4gpu {

static __device__ const unsigned long long kIq2Grid[256] = {
#include "iq2_tables.inc"
};

// Streaming loads of weights: read-only, not kept in L1 (the activations live there). `volatile`
// keeps them in program order, so all rows of an x block are requested before the first is used
// (v1 let the compiler interleave load and use per row: one DRAM round trip per row, ~50% of copy).
// EF: with L2's evict_first policy (common.cuh kStreamEvictFirst: decode's weights; the prefill GEMMs pass false).
template <bool EF = kStreamEvictFirst>
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  if constexpr (EF)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(l2_evict_first_policy()));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}
template <bool EF = kStreamEvictFirst>
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 v;
  if constexpr (EF)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p), "l"(l2_evict_first_policy()));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
template <bool EF = kStreamEvictFirst>
__device__ __forceinline__ uint32_t ld_stream4(const void* p) {
  uint32_t v;
  if constexpr (EF)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;"
                 : "=r"(v)
                 : "l"(p), "l"(l2_evict_first_policy()));
  else
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
template <bool EF = kStreamEvictFirst>
__device__ __forceinline__ uint32_t ld_stream2(const void* p) {
  unsigned short v;
  if constexpr (EF)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u16 %0, [%1], %2;"
                 : "=h"(v)
                 : "l"(p), "l"(l2_evict_first_policy()));
  else
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float half_bits(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }

// IQ2_XXS grid in shared memory (256 entries of 8 magnitudes). The 8 signs of a group come from its
// 7-bit field arithmetically (the eighth is the parity of the seven): a second table lookup per group
// was half of the shared-memory wavefronts that bound the 2-bit kernels (ncu: L1/TEX 82% busy).
struct Iq2Tables {
  static constexpr bool kSignLut = false;  // signs from the 7-bit field arithmetically (iq2_sign_bytes)
  static constexpr bool kByteOff = false;  // lookups by entry index (Iq2LutTablesU: by byte offset)
  const unsigned long long* grid;
  __device__ __forceinline__ unsigned long long operator()(int i) const { return grid[i]; }
};

// The grid replicated once per lane (entry i of lane l at [32 i + l]): every lane reads its own banks,
// so a warp's 32 random lookups take the minimum 2 wavefronts instead of ~5 (64 KB; for persistent
// kernels that build it once per CTA).
struct Iq2LaneTables {
  static constexpr bool kSignLut = false, kByteOff = false;
  const uint2* rep;
  int lane;
  __device__ __forceinline__ unsigned long long operator()(int i) const {
    const uint2 v = rep[32 * i + lane];
    return (unsigned long long)v.x | ((unsigned long long)v.y << 32);
  }
};
constexpr size_t IQ2_LANE_TABLE_BYTES = 256 * 32 * sizeof(uint2);

// v17, prepared ($DS4_GPU_GU_LUT=1, the decode gate/up rows kernel): the grid with 16 replicas (entry i of replica r
// at [16 i + r], r = lane % 16) and after it the 8 sign masks of every 7-bit field, replicated the same way (byte j
// 0xff where element j is negative; element 7's sign is the parity of the field). Lanes l and l + 16 share banks, so
// a warp's 32 lookups of 8 bytes still take the minimum two wavefronts; 48 KB instead of the 64 of the 32-replica
// grid. Why: ncu has the rows kernel throttled by its integer pipes, and the masks' arithmetic (popc, two multiplies,
// masks and shifts: ~11 of a group's ~17 integer instructions) becomes one shared-memory load.
struct Iq2LutTables {
  static constexpr bool kSignLut = true, kByteOff = false;
  static constexpr int kSign = 256 * 16;  // the sign masks follow the grid: [128][16]
  const uint2* p;  // the tables' base + lane % 16 (one pointer: the kernel runs at 80 registers)
  __device__ __forceinline__ unsigned long long operator()(int i) const {
    const uint2 v = p[16 * i];
    return (unsigned long long)v.x | ((unsigned long long)v.y << 32);
  }
  __device__ __forceinline__ uint2 signs(uint32_t s7) const { return p[kSign + 16 * s7]; }
};
constexpr size_t IQ2_LUT_TABLE_BYTES = (256 + 128) * 16 * sizeof(uint2);

// The 8 byte masks of a 7-bit sign field (byte j 0xff where element j is negative; element 7's sign is the parity).
__device__ __forceinline__ uint2 iq2_sign_masks(uint32_t s7) {
  const uint32_t s8 = s7 | ((uint32_t)(__popc(s7) & 1) << 7);
  uint32_t m[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (s8 >> j & 1u) m[j >> 2] |= 0xffu << (8 * (j & 3));
  return make_uint2(m[0], m[1]);
}

// Every thread of the CTA: the grid's 16 replicas (all of a thread's loads issued before its stores), then the sign
// masks computed in place.
__device__ __forceinline__ Iq2LutTables iq2_lut_tables_init(uint2* base) {
  constexpr int N = 256 * 16;
  for (int i0 = threadIdx.x; i0 < N; i0 += 8 * blockDim.x) {
    unsigned long long g[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * blockDim.x;
      g[u] = i < N ? kIq2Grid[i >> 4] : 0ull;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < N) base[i] = make_uint2((uint32_t)g[u], (uint32_t)(g[u] >> 32));
    }
  }
  uint2* sign = base + Iq2LutTables::kSign;
  for (int i = threadIdx.x; i < 128 * 16; i += blockDim.x) {
    sign[i] = iq2_sign_masks((uint32_t)i >> 4);
  }
  return Iq2LutTables{base + (threadIdx.x & 15)};
}

// v21 ($DS4_GPU_GU_LUT=3): Iq2LutTables' tables read through byte offsets from one warp-uniform shared-window address.
// A lookup's offset is (field << 7) | (lane % 16) * 8 (128 bytes per entry: 16 replicas of 8), one shift and one LOP3,
// and ptxas adds the uniform base in the load (LDS [R + UR]). Form 2's SASS spends ~4 instructions per lookup (mask, OR
// with the lane, LEA, shift) on 32 lookups per 4 rows x 32 columns: its loop is 459 instructions, this one's 398. The same
// loads, so the same codes and bits.
// v21 measurement: the kernel bench's gate/up 20.9 -> 19.0 us, decode 6.65 -> 6.56 ms per token at 2k. 16-byte sign entries
// that also held m & 0x01010101 (one LOP3 less per word, LDS.128) ran 20.6 us: removed.
struct Iq2LutTablesU {
  static constexpr bool kSignLut = true, kByteOff = true;
  static constexpr uint32_t kSignBytes = Iq2LutTables::kSign * sizeof(uint2);  // the sign masks' byte offset
  uint32_t base;      // shared-window address of the grid (the same in every thread)
  uint32_t lane_off;  // (lane % 16) * 8: this lane's replica
  __device__ __forceinline__ uint2 at(uint32_t off) const {
    uint2 v;
    asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(base + off));
    return v;
  }
};

__device__ __forceinline__ Iq2LutTablesU iq2_lut_tables_init_u(uint2* base) {
  iq2_lut_tables_init(base);
  return Iq2LutTablesU{(uint32_t)__cvta_generic_to_shared(base), (threadIdx.x & 15u) * 8u};
}

__device__ __forceinline__ void iq2_tables_init(unsigned long long* grid) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) grid[i] = kIq2Grid[i];
}
// One global load per lane, then each warp writes 32 consecutive slots per entry (conflict-free);
// a loop of global load -> store per slot ran ~10 us per CTA (dependent round trips).
__device__ __forceinline__ void iq2_lane_tables_init(uint2* rep) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int base = 32 * warp; base < 256; base += 32 * nw) {
    const unsigned long long mine = kIq2Grid[base + lane];
    for (int j = 0; j < 32; ++j) {
      const unsigned long long g = __shfl_sync(0xffffffffu, mine, j);
      rep[32 * (base + j) + lane] = make_uint2((uint32_t)g, (uint32_t)(g >> 32));
    }
  }
}

// Byte masks (0x01 per negative byte) of the 8 signs of a 7-bit sign field: bit i of a nibble goes
// to byte i by one multiply (the shifted copies 0, 7, 14, 21 never overlap, so nothing carries).
__device__ __forceinline__ void iq2_sign_bytes(uint32_t s7, uint32_t& lo, uint32_t& hi) {
  const uint32_t s8 = s7 | ((uint32_t)(__popc(s7) & 1) << 7);
  lo = ((s8 & 15u) * 0x00204081u) & 0x01010101u;
  hi = ((s8 >> 4) * 0x00204081u) & 0x01010101u;
}

// The raw bits of one row's x block: codes q (as many words as the type has) and scale bits.
struct RawXb {
  uint32_t q[8];
  uint32_t s0, s1;
};

// EF: the weights with L2's evict_first policy (decode; the prefill GEMMs and dequant pass false).
template <int QT, bool EF = kStreamEvictFirst>
__device__ __forceinline__ void load_xb(const uint8_t* qrow, const uint8_t* srow, int xb, int nb, RawXb& o) {
  if constexpr (QT == QT_Q8_0) {
    uint4 a = ld_stream16<EF>(qrow + 32 * xb), b = ld_stream16<EF>(qrow + 32 * xb + 16);
    o.q[0] = a.x; o.q[1] = a.y; o.q[2] = a.z; o.q[3] = a.w;
    o.q[4] = b.x; o.q[5] = b.y; o.q[6] = b.z; o.q[7] = b.w;
    o.s0 = ld_stream2<EF>(srow + 2 * xb);
  } else if constexpr (QT == QT_Q4_K) {
    uint4 v = ld_stream16<EF>(qrow + 16 * xb);
    o.q[0] = v.x; o.q[1] = v.y; o.q[2] = v.z; o.q[3] = v.w;
    o.s0 = ld_stream4<EF>(srow + 4 * (xb >> 3));
    o.s1 = ld_stream2<EF>(srow + 4 * nb + 2 * xb);
  } else if constexpr (QT == QT_Q2_K) {
    uint2 v = ld_stream8<EF>(qrow + 8 * xb);
    o.q[0] = v.x; o.q[1] = v.y;
    o.s0 = ld_stream4<EF>(srow + 4 * (xb >> 3));
    o.s1 = ld_stream2<EF>(srow + 4 * nb + 2 * xb);
  } else if constexpr (QT == QT_IQ2_XXS) {
    uint2 v = ld_stream8<EF>(qrow + 8 * xb);
    o.q[0] = v.x; o.q[1] = v.y;
    o.s0 = ld_stream2<EF>(srow + 2 * (xb >> 3));
  }
}

// One row's x block decoded to 8 words of int8 codes (word i = elements 4i..4i+3) and the factors
// that turn the int32 dot products into floats:
//   row . x  =  dscale * xs * (mul0 * T0 + mul1 * T1)  -  (min0 * sum16_0 + min1 * sum16_1)
// with T_h the hi/lo dot product of half h (16 columns).
struct XbCodes {
  uint32_t c[8];
  float dscale;
  int mul0, mul1;
  float min0, min1;
};

template <int QT, typename TB>
__device__ __forceinline__ void decode_xb(const RawXb& in, const TB& grid, XbCodes& o) {
  o.mul0 = o.mul1 = 1;
  o.min0 = o.min1 = 0.0f;
  if constexpr (QT == QT_Q8_0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) o.c[i] = in.q[i];
    o.dscale = half_bits(in.s0);
  } else if constexpr (QT == QT_Q4_K) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o.c[i] = in.q[i] & 0x0f0f0f0fu;
      o.c[4 + i] = (in.q[i] >> 4) & 0x0f0f0f0fu;
    }
    float d = half_bits(in.s0 & 0xffff), dmin = half_bits(in.s0 >> 16);
    o.dscale = d * (float)(in.s1 & 255);
    o.min0 = o.min1 = dmin * (float)(in.s1 >> 8);
  } else if constexpr (QT == QT_Q2_K) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o.c[k] = (in.q[0] >> (2 * k)) & 0x03030303u;
      o.c[4 + k] = (in.q[1] >> (2 * k)) & 0x03030303u;
    }
    float d = half_bits(in.s0 & 0xffff), dmin = half_bits(in.s0 >> 16);
    o.dscale = d;
    o.mul0 = in.s1 & 15;
    o.min0 = dmin * (float)((in.s1 >> 4) & 15);
    o.mul1 = (in.s1 >> 8) & 15;
    o.min1 = dmin * (float)((in.s1 >> 12) & 15);
  } else if constexpr (QT == QT_IQ2_XXS && TB::kByteOff) {  // Iq2LutTablesU: the same codes as the index forms
    const uint32_t a0 = in.q[0], a1 = in.q[1];
    o.dscale = half_bits(in.s0) * (0.5f + (float)(a1 >> 28)) * 0.25f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t g_off = (k == 0 ? a0 << 7 : a0 >> (8 * k - 7)) & 0x7f80u;  // grid byte k, times 128
      const uint32_t s_off = (k == 0 ? a1 << 7 : a1 >> (7 * k - 7)) & 0x3f80u;  // sign field k, times 128
      const uint2 g = grid.at(g_off | grid.lane_off), m = grid.at((s_off | grid.lane_off) + TB::kSignBytes);
      o.c[2 * k] = (g.x ^ m.x) + (m.x & 0x01010101u);
      o.c[2 * k + 1] = (g.y ^ m.y) + (m.y & 0x01010101u);
    }
  } else if constexpr (QT == QT_IQ2_XXS) {
    const uint32_t a0 = in.q[0], a1 = in.q[1];
    o.dscale = half_bits(in.s0) * (0.5f + (float)(a1 >> 28)) * 0.25f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      unsigned long long g = grid((a0 >> (8 * k)) & 255);
      uint32_t glo = (uint32_t)g, ghi = (uint32_t)(g >> 32);
      // negate the masked bytes: (g ^ 0xff) + 1 = 256 - g, no carry since g >= 8
      if constexpr (TB::kSignLut) {
        const uint2 m = grid.signs((a1 >> (7 * k)) & 127);
        o.c[2 * k] = (glo ^ m.x) + (m.x & 0x01010101u);
        o.c[2 * k + 1] = (ghi ^ m.y) + (m.y & 0x01010101u);
      } else {
        uint32_t mlo, mhi;
        iq2_sign_bytes((a1 >> (7 * k)) & 127, mlo, mhi);
        o.c[2 * k] = (glo ^ (mlo * 0xffu)) + mlo;
        o.c[2 * k + 1] = (ghi ^ (mhi * 0xffu)) + mhi;
      }
    }
  }
}

// x loads of mv_block: read-only global (__ldg), or XS: planes staged in shared memory (generic loads).
template <bool XS, typename T>
__device__ __forceinline__ T x_ld(const T* p) {
  if constexpr (XS) return *p;
  else return __ldg(p);
}

// acc[r][b] += row r . x block xb of vector vec[b], from the rows' raw bits of that block.
// X8: the lo plane is not read (x = s hi to within s / 2, the 8-bit activations of ds4's expert products, model-spec
// §3.9): half the dp4a and x loads; the same bits as the full form on planes whose lo is zero.
template <int QT, int NB, int R, typename TB, bool XS = false, bool X8 = false>
__device__ __forceinline__ void mv_block(const RawXb (&raw)[R], int xb, const XQ& xq, const int (&vec)[NB],
                                         const TB& tb, float (&acc)[R][NB]) {
  const int xnxb = xq.n / 32;
  XbCodes d[R];
#pragma unroll
  for (int r = 0; r < R; ++r) decode_xb<QT>(raw[r], tb, d[r]);
  int T[R][NB];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int xh[NB][4], xl[NB][4];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      int64_t off = (int64_t)vec[b] * xq.n + 32 * xb + 16 * h;
      int4 vh = x_ld<XS>((const int4*)(xq.hi + off));
      xh[b][0] = vh.x; xh[b][1] = vh.y; xh[b][2] = vh.z; xh[b][3] = vh.w;
      if constexpr (!X8) {
        int4 vl = x_ld<XS>((const int4*)(xq.lo + off));
        xl[b][0] = vl.x; xl[b][1] = vl.y; xl[b][2] = vl.z; xl[b][3] = vl.w;
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        int th = 0, tl = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          th = __dp4a((int)d[r].c[4 * h + i], xh[b][i], th);
          if constexpr (!X8) tl = __dp4a((int)d[r].c[4 * h + i], xl[b][i], tl);
        }
        int t = 254 * th + tl;
        if constexpr (QT == QT_Q2_K) t *= (h == 0 ? d[r].mul0 : d[r].mul1);
        T[r][b] = h == 0 ? t : T[r][b] + t;
      }
    }
  }
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    int64_t xi = (int64_t)vec[b] * xnxb + xb;
    float xs = x_ld<XS>(xq.scale + xi);
    float s0 = 0.0f, s1 = 0.0f;
    if constexpr (QT == QT_Q2_K || QT == QT_Q4_K) {
      s0 = x_ld<XS>(xq.sum16 + 2 * xi);
      s1 = x_ld<XS>(xq.sum16 + 2 * xi + 1);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = d[r].dscale * xs * (float)T[r][b];
      if constexpr (QT == QT_Q2_K || QT == QT_Q4_K) v -= d[r].min0 * s0 + d[r].min1 * s1;
      acc[r][b] += v;
    }
  }
}

// acc[r][b] += row r . x vector vec[b], over x blocks xb0, xb0 + xbstep, ... < nxb (XS: xq's planes are in
// shared memory). The 2-bit types
// (3 words per row and block) load the next block while the current one is decoded: one DRAM round
// trip per warp instead of one per block; Q8_0 (9 words per row) would need too many registers.
template <int QT, int NB, int R, typename TB, bool XS = false, bool X8 = false>
__device__ __forceinline__ void mv_accumulate(const uint8_t* const (&qrow)[R], const uint8_t* const (&srow)[R],
                                              int nxb, int nb, int xb0, int xbstep, const XQ& xq,
                                              const int (&vec)[NB], const TB& tb, float (&acc)[R][NB]) {
  if constexpr (QT == QT_IQ2_XXS || QT == QT_Q2_K) {
    if (xb0 >= nxb) return;
    RawXb cur[R];
#pragma unroll
    for (int r = 0; r < R; ++r) load_xb<QT>(qrow[r], srow[r], xb0, nb, cur[r]);
    for (int xb = xb0; xb < nxb; xb += xbstep) {
      const int xn = xb + xbstep;
      RawXb nxt[R];
      if (xn < nxb) {
#pragma unroll
        for (int r = 0; r < R; ++r) load_xb<QT>(qrow[r], srow[r], xn, nb, nxt[r]);
      }
      mv_block<QT, NB, R, TB, XS, X8>(cur, xb, xq, vec, tb, acc);
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r] = nxt[r];
    }
  } else {
    for (int xb = xb0; xb < nxb; xb += xbstep) {
      RawXb raw[R];
#pragma unroll
      for (int r = 0; r < R; ++r) load_xb<QT>(qrow[r], srow[r], xb, nb, raw[r]);  // all rows in flight
      mv_block<QT, NB, R, TB, XS, X8>(raw, xb, xq, vec, tb, acc);
    }
  }
}

// F16 rows against f32 activations (x vector v at x + v * ncols), 8 columns per step.
template <int NB, int R>
__device__ __forceinline__ void mv_accumulate_f16(const uint8_t* const (&qrow)[R], int64_t ncols, int u0,
                                                  int ustep, const float* x, const int (&vec)[NB],
                                                  float (&acc)[R][NB]) {
  const int nu = (int)(ncols / 8);
  for (int u = u0; u < nu; u += ustep) {
    uint4 w[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w[r] = ld_stream16(qrow[r] + 16 * (int64_t)u);
    float xv[NB][8];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const float4* p = (const float4*)(x + (int64_t)vec[b] * ncols + 8 * (int64_t)u);
      float4 a = __ldg(p), c = __ldg(p + 1);
      xv[b][0] = a.x; xv[b][1] = a.y; xv[b][2] = a.z; xv[b][3] = a.w;
      xv[b][4] = c.x; xv[b][5] = c.y; xv[b][6] = c.z; xv[b][7] = c.w;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint32_t ww[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ww[i]));
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] += f.x * xv[b][2 * i] + f.y * xv[b][2 * i + 1];
      }
    }
  }
}

// Sum over the 32 lanes; afterwards every lane holds the totals.
template <int R, int NB>
__device__ __forceinline__ void warp_sum(float (&acc)[R][NB]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][b] += __shfl_xor_sync(0xffffffffu, acc[r][b], o);
}

// Launch geometry shared by the kernels: 4 warps per CTA; S warps split the columns of one group
// of R rows, so a CTA covers 4 / S row groups.
constexpr int CTA_THREADS = 128;
constexpr int CTA_WARPS = 4;

inline int column_splits(int64_t units) { return units <= 32 ? 1 : (units <= 64 ? 2 : 4); }

}  // namespace ds4gpu
