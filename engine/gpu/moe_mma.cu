// Routed-MoE gate/up for IQ2_XXS experts on the tensor cores (decode): int8 mma.sync does the multiply-adds
// against the quantized activations, so a weight costs only its 2-bit decode (grid lookup, signs). moe.cu's
// rows kernel is instruction-bound (ncu: 61% SM issue, 22% DRAM, 23.5 us for Flash's 6 experts): its loop is
// 549 SASS instructions per lane per 4 rows x 32 columns (137 per 32 weights: decode, then dp4a against x hi
// and x lo and their combination); this kernel's is 618 per 4 rows x 64 columns (77 per 32 weights; sm_90a,
// CUDA 13), of which ~17 per 8-weight group are the decode (prmt, lds, sign masks, negation).
//
// Fragments of mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (PTX ISA 9.7.14.5.10, "Matrix Fragments for
// mma.m16n8k32"), lane = 4 g + q, 4 int8 per register, lowest element in the low byte:
//   A 16x32: reg0 = row g, K 4q..4q+3     reg1 = row g+8, K 4q..4q+3
//            reg2 = row g, K 16+4q..+3    reg3 = row g+8, K 16+4q..+3
//   B 32x8:  reg0 = column g, K 4q..4q+3  reg1 = column g, K 16+4q..+3
//   C 16x8:  c0 = (g, 2q)  c1 = (g, 2q+1)  c2 = (g+8, 2q)  c3 = (g+8, 2q+1)
// The 8 K positions {4q..4q+3, 16+4q..16+4q+3} belong to lane quad q in A and in B, and the sum over K need
// not be one 32-column block: here quad q's K positions carry one 8-weight group (elements 0-3 in reg0/1,
// 4-7 in reg2/3) of a sub-block of q's own, and B columns 2q / 2q+1 carry x hi / x lo of that sub-block's
// group (B is zero elsewhere, so the quads do not mix). Four mma (groups 0..3, accumulating in C) leave in
// every lane c0/c1 = the exact hi/lo dot products of row g with its sub-block, c2/c3 those of row g+8: all
// 32 lanes' C is useful, every lane decodes only the weights it loaded itself, and those loads are 16 B per
// lane (2 sub-blocks of one row), 64 contiguous bytes per quad. The int32 sum t = 254 c_hi + c_lo is the
// same integer as the rows kernel's, and the float arithmetic per (row, 32 columns) is the same, so the
// two kernels differ only in the order of the float sums.
//
// Work: a unit is (pair, 16-row tile); a warp computes the tile's 16 gate and 16 up rows (two mma per 8
// weights of a row group) over every `splits`-th block of 256 columns, keeping the next block's loads in
// flight; with splits > 1 the warps of a unit sum in shared memory (one barrier per round of units).
// Units are dealt to a persistent grid whose CTAs build the lane-replicated IQ2_XXS grid table once,
// before griddepcontrol.wait (it overlaps the previous kernel), as moe.cu's rows kernel does.
#include <algorithm>
#include <cstdlib>

#include "moe_mma.cuh"
#include "mv_core.cuh"

namespace ds4gpu {

constexpr int GM_THREADS = 256, GM_WARPS = GM_THREADS / 32;
constexpr int GM_ROWS = 16;  // rows of gate (and of up) per unit: the mma's M
// CTAs per SM the registers are sized for: 2 -> 122 registers, no spills (sm_90a, CUDA 13); 3 (24 warps, as
// the rows kernel) caps them at 80 and spills ~170 B per thread inside the block loop.
constexpr int GM_MIN_CTAS = 2;
constexpr size_t GM_RED_FLOATS = 2 * GM_WARPS * GM_ROWS * 2;  // two rounds x warps x rows x (gate, up)
constexpr size_t GM_SMEM = IQ2_LANE_TABLE_BYTES + GM_RED_FLOATS * sizeof(float);

// Byte j = 0xff where bit 8j+7 of p is set, else 0 (prmt's sign-replicate selector; __byte_perm ignores it).
__device__ __forceinline__ uint32_t msb_byte_mask(uint32_t p) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(p), "r"(0u), "r"(0xBA98u));
  return r;
}

// The bytes of g (magnitudes 8..43) negated where m is 0xff: 0x01010100 - g is 256 - g_j in every byte
// (no borrow crosses a byte since g_j >= 1), then a bitwise select.
__device__ __forceinline__ uint32_t negate_bytes(uint32_t g, uint32_t m) {
  return (g & ~m) | ((0x01010100u - g) & m);
}

// The byte offset of entry (grid index i of a0) in this lane's column of the lane table: index * 256 +
// lane * 8, one prmt (byte 0 from lane8 = lane * 8, byte 1 = byte i of a0, bytes 2-3 = lane8's zero byte 1).
__device__ __forceinline__ uint32_t grid_offset(uint32_t a0, uint32_t lane8, int i) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a0), "r"(lane8), "r"(0x5504u | (uint32_t)(i << 4)));
  return r;
}

// Group i (elements 8i..8i+7) of an IQ2_XXS sub-block (a0 = 4 grid indices, a1 = 4 sign fields of 7 bits
// and the 4-bit scale) as signed int8: lo = elements 0-3, hi = 4-7; rep: the lane table (entry n of lane l
// at rep + 256 n + 8 l).
// The sign of element 7 is the parity of the field's 7 bits. v * 0x10204080 puts bit j of a v < 128 at bit
// 8j+7 (its copies at shifts 7, 14, 21, 28 do not overlap, so nothing carries): lo's v = f, the field; hi's
// v = (f >> 4) + 8 popc(f) < 64, whose bit 3 is the parity (bits 4-5 land below the byte tops), written as
// (f & 0x70) * 0x01020408 + popc * 0x81020400 to save the shift.
__device__ __forceinline__ void iq2_group(uint32_t a0, uint32_t a1, int i, const char* rep, uint32_t lane8,
                                          uint32_t& lo, uint32_t& hi) {
  const uint2 g = *reinterpret_cast<const uint2*>(rep + grid_offset(a0, lane8, i));
  const uint32_t t = a1 >> (7 * i), f = t & 127u;
  const uint32_t plo = f * 0x10204080u;
  const uint32_t phi = (t & 0x70u) * 0x01020408u + (uint32_t)__popc(f) * 0x81020400u;
  lo = negate_bytes(g.x, msb_byte_mask(plo));
  hi = negate_bytes(g.y, msb_byte_mask(phi));
}

__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One lane's weights of one 256-column block: rows (gate g, gate g+8, up g, up g+8), 16 B each =
// sub-blocks 2q (words x, y = a0, a1) and 2q+1 (z, w), and the rows' f16 block scales.
struct MmaRaw {
  uint4 w[4];
  uint32_t d[4];
};

__device__ __forceinline__ void mma_load(const uint8_t* const (&qrow)[4], const uint8_t* const (&srow)[4], int blk,
                                         MmaRaw& o) {
#pragma unroll
  for (int r = 0; r < 4; ++r) o.w[r] = ld_stream16(qrow[r] + 64 * blk);
#pragma unroll
  for (int r = 0; r < 4; ++r) o.d[r] = ld_stream2(srow[r] + 2 * blk);
}

// acc[r] += row r . x over the lane's two sub-blocks of block blk. xb: x hi or lo (B column g) at sub-block
// 2q of block 0, bmask: ~0 where this lane's B registers are nonzero, xsp: x scales at sub-block 2q of block 0.
__device__ __forceinline__ void mma_block(const MmaRaw& raw, int blk, const int8_t* xb, uint32_t bmask,
                                          const float* xsp, const char* rep, uint32_t lane8,
                                          float (&acc)[4]) {
  const float2 xs = __ldg(reinterpret_cast<const float2*>(xsp + 8 * blk));
  float dq[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) dq[r] = half_bits(raw.d[r]) * 0.25f;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    // B: x of sub-block 2q+s (32 bytes; group i = words 2i, 2i+1). Every lane loads (the address depends
    // only on (g & 1, q), so the warp reads 8 distinct 16-byte pieces) and all but 8 lanes zero it.
    const int4* xp = reinterpret_cast<const int4*>(xb + 256 * blk + 32 * s);
    const int4 v0 = __ldg(xp), v1 = __ldg(xp + 1);
    const uint32_t bx[8] = {v0.x & bmask, v0.y & bmask, v0.z & bmask, v0.w & bmask,
                            v1.x & bmask, v1.y & bmask, v1.z & bmask, v1.w & bmask};
    int c[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};  // gate, up: (row g hi, row g lo, row g+8 hi, row g+8 lo)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const uint4& r0 = raw.w[2 * m];
        const uint4& r1 = raw.w[2 * m + 1];
        uint32_t lo0, hi0, lo1, hi1;
        iq2_group(s ? r0.z : r0.x, s ? r0.w : r0.y, i, rep, lane8, lo0, hi0);
        iq2_group(s ? r1.z : r1.x, s ? r1.w : r1.y, i, rep, lane8, lo1, hi1);
        mma_s8(c[m], lo0, lo1, hi0, hi1, bx[2 * i], bx[2 * i + 1]);
      }
    }
    const float xss = s ? xs.y : xs.x;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int m = r >> 1, rr = r & 1;
      const uint32_t a1 = s ? raw.w[r].w : raw.w[r].y;
      const int t = 254 * c[m][2 * rr] + c[m][2 * rr + 1];
      // = d (0.5 + scale) / 4 of the rows kernel exactly (scaling by 1/4 commutes with rounding)
      const float dscale = dq[r] * (0.5f + (float)(a1 >> 28));
      acc[r] = fmaf(dscale * xss, (float)t, acc[r]);
    }
  }
}

__device__ __forceinline__ float swiglu_route(float gs, float us, float clamp, float w, bool bad) {
  const float g = fminf(gs, clamp), u = fminf(fmaxf(us, -clamp), clamp);
  const float v = g / (1.0f + __expf(-g)) * u * w;
  return bad ? __int_as_float(0x7fc00000) : v;  // NaN marks an expert id out of range
}

__global__ void __launch_bounds__(GM_THREADS, GM_MIN_CTAS) moe_gateup_mma_kernel(Packed gate, Packed up, int n_ff,
                                                                        int n_expert, XQ xq, const int32_t* ids,
                                                                        const float* wts, int k, float clamp,
                                                                        int units, int splits, float* h) {
  extern __shared__ uint2 s_rep[];  // the lane-replicated grid, then the cross-warp sums
  float* red = reinterpret_cast<float*>(s_rep + IQ2_LANE_TABLE_BYTES / sizeof(uint2));
  pdl_trigger();
  iq2_lane_tables_init(s_rep);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int cs = warp % splits, slot = warp / splits, per_cta = GM_WARPS / splits;
  // B column g is x hi (g even) or x lo (g odd) of quad g >> 1's sub-block; only lanes with g >> 1 == q
  // hold that quad's K rows
  const uint32_t bmask = (g >> 1) == q ? ~0u : 0u;
  const char* rep = reinterpret_cast<const char*>(s_rep);
  const uint32_t lane8 = 8u * lane;
  const int tiles = n_ff / GM_ROWS, nb = (int)(gate.ncols / 256);
  pdl_wait();  // ids, x and h's readers are from earlier kernels
  int round = 0;
  for (int u0 = blockIdx.x * per_cta; u0 < units; u0 += gridDim.x * per_cta, round ^= 1) {
    const int unit = u0 + slot;  // warp-uniform: the branches below keep whole warps together
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // gate g, gate g+8, up g, up g+8
    int pair = 0, f0 = 0;
    bool bad = false;
    if (unit < units) {
      pair = unit / tiles;
      f0 = (unit - pair * tiles) * GM_ROWS;
      const int token = pair / k, e = ids[pair];
      bad = e < 0 || e >= n_expert;
      const int64_t row = (int64_t)(bad ? 0 : e) * n_ff + f0 + g;
      const uint8_t* qrow[4] = {gate.qs + row * gate.qs_row + 16 * q, gate.qs + (row + 8) * gate.qs_row + 16 * q,
                                up.qs + row * up.qs_row + 16 * q, up.qs + (row + 8) * up.qs_row + 16 * q};
      const uint8_t* srow[4] = {gate.sc + row * gate.sc_row, gate.sc + (row + 8) * gate.sc_row,
                                up.sc + row * up.sc_row, up.sc + (row + 8) * up.sc_row};
      const int8_t* xb = ((g & 1) ? xq.lo : xq.hi) + (int64_t)token * xq.n + 64 * q;  // sub-block 2q of block 0
      const float* xsp = xq.scale + (int64_t)token * (xq.n / 32) + 2 * q;
      if (cs < nb) {
        MmaRaw cur;
        mma_load(qrow, srow, cs, cur);
        for (int blk = cs; blk < nb; blk += splits) {
          MmaRaw nxt;
          if (blk + splits < nb) mma_load(qrow, srow, blk + splits, nxt);
          mma_block(cur, blk, xb, bmask, xsp, rep, lane8, acc);
          cur = nxt;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // the 4 lanes of a quad hold the row's 8 sub-blocks of each block
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 1);
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 2);
      }
    }
    if (splits == 1) {
      if (unit < units && q == 0) {
        const float w = wts[pair];
        float* hp = h + (int64_t)pair * n_ff + f0;
        hp[g] = swiglu_route(acc[0], acc[2], clamp, w, bad);
        hp[g + 8] = swiglu_route(acc[1], acc[3], clamp, w, bad);
      }
    } else {
      // two buffers, one barrier per round: a warp writes round r + 2's sums only after the barrier of
      // round r + 1, which every warp reaches after reading round r's
      float* rb = red + round * (GM_WARPS * GM_ROWS * 2);
      if (unit < units && q == 0) {
        rb[(warp * GM_ROWS + g) * 2] = acc[0];
        rb[(warp * GM_ROWS + g) * 2 + 1] = acc[2];
        rb[(warp * GM_ROWS + g + 8) * 2] = acc[1];
        rb[(warp * GM_ROWS + g + 8) * 2 + 1] = acc[3];
      }
      __syncthreads();
      if (unit < units && cs == 0 && lane < GM_ROWS) {
        float gs = 0.0f, us = 0.0f;
        for (int c = 0; c < splits; ++c) {
          gs += rb[((warp + c) * GM_ROWS + lane) * 2];
          us += rb[((warp + c) * GM_ROWS + lane) * 2 + 1];
        }
        h[(int64_t)pair * n_ff + f0 + lane] = swiglu_route(gs, us, clamp, wts[pair], bad);
      }
    }
  }
}

namespace {
int g_mode = -1;   // set_gateup_mma: -1 = $DS4_GPU_GU_MMA
int g_splits = 0;  // 0 = $DS4_GPU_GU_MMA_SPLIT, else automatic

int env_int(const char* name, int fallback) {
  const char* e = getenv(name);
  return e && e[0] ? atoi(e) : fallback;
}
}  // namespace

void set_gateup_mma(int mode, int splits) {
  if (splits != 0 && splits != 1 && splits != 2 && splits != 4 && splits != 8)
    throw std::invalid_argument("gate/up mma: splits must be 0 (automatic), 1, 2, 4 or 8");
  g_mode = mode;
  g_splits = splits;
}

bool gateup_mma_enabled() {
  static const bool env = env_int("DS4_GPU_GU_MMA", 0) == 1;
  return g_mode < 0 ? env : g_mode != 0;
}

bool launch_gateup_mma(const Packed& gate, const Packed& up, int n_ff, int n_expert, const XQ& xq,
                       const int32_t* ids, const float* wts, int pairs, int k, float clamp, float* h,
                       cudaStream_t stream) {
  if (gate.qtype != QT_IQ2_XXS || up.qtype != QT_IQ2_XXS || n_ff % GM_ROWS || gate.ncols % 256 ||
      up.ncols != gate.ncols || xq.n != gate.ncols)
    return false;
  const int units = pairs * (n_ff / GM_ROWS), nb = (int)(gate.ncols / 256);
  if (units <= 0) return true;
  static const int resident = [] {
    DS4_CHECK(cudaFuncSetAttribute(moe_gateup_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)GM_SMEM));
    int dev = 0, sms = 0, per_sm = 0;
    DS4_CHECK(cudaGetDevice(&dev));
    DS4_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_gateup_mma_kernel, GM_THREADS, GM_SMEM));
    return std::max(1, per_sm) * sms;
  }();
  static const int env_splits = env_int("DS4_GPU_GU_MMA_SPLIT", 0);
  int splits = g_splits ? g_splits : env_splits;
  if (splits != 1 && splits != 2 && splits != 4 && splits != 8) {
    // fewest block-times: rounds of the persistent grid x blocks per warp (decode: 6 pairs x 128 tiles =
    // 768 units for ~260 resident CTAs; 8 splits -> 3 rounds of 2 blocks, 4 -> 2 rounds of 4)
    int best = 1 << 30;
    for (int s = 1; s <= GM_WARPS && (s == 1 || s <= nb); s *= 2) {
      const int64_t rounds = ((int64_t)units * s + (int64_t)GM_WARPS * resident - 1) / ((int64_t)GM_WARPS * resident);
      const int64_t cost = rounds * ((nb + s - 1) / s);
      if (cost <= best) best = (int)cost, splits = s;
    }
  }
  const int per_cta = GM_WARPS / splits;
  launch_k(moe_gateup_mma_kernel, dim3((unsigned)std::min((units + per_cta - 1) / per_cta, resident)), dim3(GM_THREADS),
           GM_SMEM, stream, gate, up, n_ff, n_expert, xq, ids, wts, k, clamp, units, splits, h);
  return true;
}

}  // namespace ds4gpu
