// Routed MoE for decode (model-spec §3.7 steps 4 and 6): for each token and each of its k experts,
// g = min(W1 b, c), u = clamp(W3 b, -c, c), h = silu(g) u w_k, then y = sum_k W2 h_k.
// Two kernels: gate+up (one warp computes RH rows of W1 and the same rows of W3, SwiGLU in the
// epilogue) and down (the k experts of a token are one long dot product, so the sum needs no atomics).
// Their inputs x and h are quantized by quantize_x_kernel launches, except for DS4_GPU_GU_XQ=1 (decode), where
// gate/up quantizes both itself (GU_X_QUANT below): two launches instead of four; DS4_GPU_GU_XQ=2: x only.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <type_traits>

#include "moe_mma.cuh"
#include "mv_core.cuh"
#include "xquant.cuh"

namespace ds4gpu {

constexpr int MOE_R = 8;  // rows per warp of the down kernel

constexpr int GU_THREADS = 256, GU_WARPS = GU_THREADS / 32;  // gate/up CTAs: 8 warps share one IQ2_XXS table

// Gate/up: each warp computes whole rows, RH of gate and the same RH of up, over all columns (lane l takes x
// blocks l, l + 32, ...), then SwiGLU on its own lanes: no column split across warps, so no shared-memory
// reduction and no CTA barrier per unit. Units (pair, RH rows) are dealt to the warps of a persistent grid
// (the IQ2_XXS lane tables are built once per CTA, before griddepcontrol.wait: they overlap the previous
// kernel); 3 CTAs per SM. The v4 kernel (column splits, two CTA barriers per unit of one x block per lane)
// ran at the same speed on the H200 (23-24 us for Flash's 6 IQ2_XXS experts): the cost is the instructions
// of the 2-bit decode (ncu: 61% of SM issue, 22% of DRAM), not the barriers.
constexpr int GU2_RH = 2;

// Where the gate/up kernel reads the token's quantized x from.
// GU_X_GLOBAL: xq in global memory (quantize_x_kernel ran before).
// GU_X_STAGED (XS, one token): the token's quantized x is staged in shared memory after the lane tables, so the
//   x block loads of each step are shared-memory reads instead of an L2 round trip on the warp's critical path
//   (DS4_GPU_GU_XS=1; an A/B switch).
// GU_X_QUANT (XQ, one token, DS4_GPU_GU_XQ=1): every CTA quantizes the token's float32 x into shared memory
//   itself, and the epilogue also quantizes h for the down kernel (see gu_quantize_h_block): the two
//   quantize_x launches of launch_moe are gone.
// Shared-memory layout of x (XS, XQ): hi [n], lo [n], scale [n/32], sum16 [n/16].
enum GuXMode : int { GU_X_GLOBAL = 0, GU_X_STAGED = 1, GU_X_QUANT = 2 };
__host__ __device__ constexpr size_t gu_xs_bytes(int n) { return 2 * (size_t)n + (size_t)n / 32 * 4 + (size_t)n / 16 * 4; }

__device__ __forceinline__ XQ gu_smem_x(int n, unsigned char* smem) {
  XQ s;
  s.n = n;
  s.hi = (int8_t*)smem;
  s.lo = s.hi + n;
  s.scale = (float*)(s.lo + n);
  s.sum16 = s.scale + n / 32;
  return s;
}

__device__ __forceinline__ XQ gu_stage_x(const XQ& xq, unsigned char* smem) {
  XQ s = gu_smem_x(xq.n, smem);
  for (int i = threadIdx.x; i < xq.n / 16; i += blockDim.x) {
    ((int4*)s.hi)[i] = __ldg((const int4*)xq.hi + i);
    ((int4*)s.lo)[i] = __ldg((const int4*)xq.lo + i);
    if (xq.sum16) s.sum16[i] = __ldg(xq.sum16 + i);
  }
  for (int i = threadIdx.x; i < xq.n / 32; i += blockDim.x) s.scale[i] = __ldg(xq.scale + i);
  __syncthreads();
  return s;
}

// XQ: the CTA quantizes the token's x (n floats, n % 32 == 0) into shared memory. Each warp loads the values
// of up to 8 of its blocks before quantizing them, so the L2 round trips overlap.
__device__ __forceinline__ XQ gu_quantize_x(const float* x, int n, unsigned char* smem) {
  const XQ s = gu_smem_x(n, smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, nxb = n / 32;
  constexpr int C = 8;
  for (int xb0 = warp; xb0 < nxb; xb0 += C * nw) {
    float v[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int xb = xb0 + c * nw;
      v[c] = xb < nxb ? __ldg(x + (int64_t)xb * 32 + lane) : 0.0f;
    }
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (xb0 + c * nw < nxb) put_x_block(s, xb0 + c * nw, lane, v[c]);  // warp-uniform condition
  }
  __syncthreads();
  return s;
}

// XQ: arrival counts of h's x blocks (pair p, block b at [p * (n_ff / 32) + b]); the warp that completes a block
// quantizes it into the down kernel's input and resets the count, so the next launch (or graph replay) finds
// zeros. Zero at module load, one set per device: launches of the XQ kernel must not run concurrently on one
// device (one stream per device, as the session uses; PDL keeps them apart: pdl_wait comes before any count).
constexpr int GU_XQ_MAX_BLOCKS = 8192;
__device__ unsigned g_gu_h_count[GU_XQ_MAX_BLOCKS];
constexpr int GU_H_ARRIVALS = XB / GU2_RH;  // warp units that write one 32-value block of h

// After this warp wrote its h values of block hb (the h stores are done by some lanes of the warp): count the
// arrival; the 16th quantizes the block's 32 values (read back from L2: other warps and CTAs wrote them) into
// xq_h exactly as quantize_x_kernel would, NaN-poisoned values included.
__device__ __forceinline__ void gu_quantize_h_block(const float* h, const XQ& xq_h, int64_t hb, int lane) {
  __threadfence();  // this lane's h stores are visible device-wide before the arrival is counted
  __syncwarp();
  unsigned last = 0;
  if (lane == 0) last = atomicAdd(&g_gu_h_count[hb], 1u) == (unsigned)GU_H_ARRIVALS - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();  // the other warps' h stores, counted before ours, are read after the count
  const float v = __ldcg(h + hb * 32 + lane);
  put_x_block(xq_h, hb, lane, v);
  if (lane == 0) g_gu_h_count[hb] = 0u;  // every arrival of this launch is in: no one counts it again
}

// XM == GU_X_QUANT: x is the token's float32 x (xq.n holds n_embd) and xq_h receives h quantized; otherwise
// both are unused.
// LUT (IQ2_XXS, $DS4_GPU_GU_LUT=1 or 2, the default): the 16-replica grid and sign-mask tables (Iq2LutTables) instead of
// the 32-replica grid with the signs computed: the same codes, so the same bits.
// LUT 3 (v21, the default): the same tables read by byte offsets from a uniform base (Iq2LutTablesU), 2 CTAs per SM.
template <int QT, int LUT>
using GuTables =
    std::conditional_t<LUT == 3, Iq2LutTablesU, std::conditional_t<LUT != 0, Iq2LutTables, Iq2LaneTables>>;
template <int QT, int LUT>
__host__ __device__ constexpr size_t gu_table_bytes() {
  return QT != QT_IQ2_XXS ? 0 : (LUT ? IQ2_LUT_TABLE_BYTES : IQ2_LANE_TABLE_BYTES);
}

// Every thread of the CTA: the gate/up kernels' IQ2_XXS tables in shared memory (none for the other types), before
// griddepcontrol.wait.
template <int QT, int LUT>
__device__ __forceinline__ GuTables<QT, LUT> gu_tables_init(uint2* s_rep, int lane) {
  using TB = GuTables<QT, LUT>;
  TB tb{};
  if constexpr (QT == QT_IQ2_XXS) {
    if constexpr (LUT == 3) tb = iq2_lut_tables_init_u(s_rep);
    else if constexpr (LUT != 0) tb = iq2_lut_tables_init(s_rep);
    else iq2_lane_tables_init(s_rep), tb = TB{s_rep, lane};
    __syncthreads();
  } else {
    if constexpr (LUT == 0) tb = TB{s_rep, lane};
  }
  return tb;
}

// OFF32 ($DS4_GPU_GU_OFF32=1, IQ2_XXS): the rows' bytes addressed as the plane's base (a kernel parameter, uniform)
// plus a 32-bit offset (every plane of the experts is under 4 GiB; the launcher checks), so a step's addresses are a
// 32-bit add and a 64-bit add of the base. The 64-bit row pointers did not fit the 128 registers of two CTAs per SM, and
// the compiler rebuilt them (row x stride, 64-bit) at every step: ~55 of the loop's ~394 instructions. The same loads
// in the same order as mv_accumulate's 2-bit path: the same bits.
template <int R>
__device__ __forceinline__ void gu_load_off32(const uint8_t* const (&qbase)[R], const uint8_t* const (&sbase)[R],
                                              const uint32_t (&qoff)[R], const uint32_t (&soff)[R], int xb,
                                              RawXb (&raw)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint2 v = ld_stream8(qbase[r] + (qoff[r] + 8u * (uint32_t)xb));
    raw[r].q[0] = v.x;
    raw[r].q[1] = v.y;
    raw[r].s0 = ld_stream2(sbase[r] + (soff[r] + 2u * ((uint32_t)xb >> 3)));
  }
}

// UNROLL (STEPS > 0, $DS4_GPU_GU_UNROLL=1): rows of exactly 32 STEPS x blocks, packed densely (Flash's 4096 columns:
// 4 steps per lane, 1024 code bytes and 32 scale bytes per row; the launcher checks), the steps unrolled from one
// pointer per plane and matrix found once per unit: every load is such a pointer plus an immediate (the unit's second
// row 8 nxb code bytes further, step s 256 s), and x's planes likewise. The rolled loop spent ~40 of its 380
// instructions per step on 64-bit addresses (row offset + 8 xb, x block vec x n + 32 xb). Four pointers, not one per
// row: at 127 registers the compiler rematerialized the tables' lane offset at every lookup. The same loads in the same
// order: the same bits.
template <typename TB, bool X8, int STEPS>
__device__ __forceinline__ void gu_accumulate_unrolled(const Packed& gate, const Packed& up, uint32_t row0, int xb0,
                                                       const XQ& xq, const int (&vec)[1], const TB& tb,
                                                       float (&acc)[2 * GU2_RH][1]) {
  constexpr int RH = GU2_RH, R = 2 * GU2_RH, NXB = 32 * STEPS, QROW = 8 * NXB, SROW = 2 * (NXB / 8);
  const uint8_t* const qp[2] = {gate.qs + (row0 * (uint32_t)QROW + 8u * (uint32_t)xb0),
                                up.qs + (row0 * (uint32_t)QROW + 8u * (uint32_t)xb0)};
  const uint8_t* const sp[2] = {gate.sc + (row0 * (uint32_t)SROW + 2u * ((uint32_t)xb0 >> 3)),
                                up.sc + (row0 * (uint32_t)SROW + 2u * ((uint32_t)xb0 >> 3))};
  XQ xl = xq;  // this lane's first x block of vector vec: mv_block's offsets become constants (vector 0, block 32 s)
  const int64_t xoff = (int64_t)vec[0] * xq.n + 32 * xb0;
  xl.hi = xq.hi + xoff, xl.lo = xq.lo + xoff, xl.scale = xq.scale + (int64_t)vec[0] * (xq.n / 32) + xb0;
  const int v0[1] = {0};
  TB t = tb;  // the lane offset through a shuffle, which ptxas cannot rematerialize (it did, with two LOP3 per lookup)
  t.lane_off = __shfl_sync(0xffffffffu, tb.lane_off, threadIdx.x & 31);
  auto load = [&](int s, RawXb(&raw)[R]) {  // row r = (matrix r / RH, row0 + r % RH)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint2 v = ld_stream8(qp[r / RH] + (r % RH) * QROW + 256 * s);
      raw[r].q[0] = v.x;
      raw[r].q[1] = v.y;
      raw[r].s0 = ld_stream2(sp[r / RH] + (r % RH) * SROW + 8 * s);
    }
  };
  RawXb cur[R];
  load(0, cur);
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    RawXb nxt[R];
    if (s + 1 < STEPS) load(s + 1, nxt);
    mv_block<QT_IQ2_XXS, 1, R, TB, false, X8>(cur, 32 * s, xl, v0, t, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) cur[r] = nxt[r];
  }
}

template <int R, typename TB, bool X8>
__device__ __forceinline__ void gu_accumulate_off32(const uint8_t* const (&qbase)[R], const uint8_t* const (&sbase)[R],
                                                    const uint32_t (&qoff)[R], const uint32_t (&soff)[R], int nxb,
                                                    int xb0, const XQ& xq, const int (&vec)[1], const TB& tb,
                                                    float (&acc)[R][1]) {
  auto load = [&](int xb, RawXb(&raw)[R]) { gu_load_off32<R>(qbase, sbase, qoff, soff, xb, raw); };
  if (xb0 >= nxb) return;
  RawXb cur[R];
  load(xb0, cur);
  for (int xb = xb0; xb < nxb; xb += 32) {
    RawXb nxt[R];
    if (xb + 32 < nxb) load(xb + 32, nxt);
    mv_block<QT_IQ2_XXS, 1, R, TB, false, X8>(cur, xb, xq, vec, tb, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) cur[r] = nxt[r];
  }
}

// OFF32: the byte offsets of a unit's rows (f0 .. f0 + RH - 1 of expert e's gate, then the same of up) in their
// planes, and the planes' bases in the same order.
__device__ __forceinline__ void gu_row_offsets(const Packed& gate, const Packed& up, uint32_t e, int f0, int n_ff,
                                               uint32_t (&qoff)[2 * GU2_RH], uint32_t (&soff)[2 * GU2_RH]) {
  constexpr int RH = GU2_RH;
#pragma unroll
  for (int i = 0; i < RH; ++i) {
    const uint32_t row = e * (uint32_t)n_ff + (uint32_t)min(f0 + i, n_ff - 1);
    qoff[i] = row * (uint32_t)gate.qs_row, soff[i] = row * (uint32_t)gate.sc_row;
    qoff[RH + i] = row * (uint32_t)up.qs_row, soff[RH + i] = row * (uint32_t)up.sc_row;
  }
}
__device__ __forceinline__ void gu_plane_bases(const Packed& gate, const Packed& up,
                                               const uint8_t* (&qbase)[2 * GU2_RH],
                                               const uint8_t* (&sbase)[2 * GU2_RH]) {
#pragma unroll
  for (int i = 0; i < GU2_RH; ++i)
    qbase[i] = gate.qs, sbase[i] = gate.sc, qbase[GU2_RH + i] = up.qs, sbase[GU2_RH + i] = up.sc;
}

// One warp unit of gate/up: rows f0 .. f0 + RH - 1 of expert e's gate (acc[0, RH)) and up (acc[RH, 2 RH)) against
// x vector vec0, each summed over the warp (lane l takes x blocks l, l + 32, ...).
template <int QT, typename TB, bool XS, bool X8, bool OFF32 = false, int STEPS = 0>
__device__ __forceinline__ void gu_unit_rows(const Packed& gate, const Packed& up, int64_t e, int f0, int n_ff,
                                             const XQ& xq, int vec0, const TB& tb, int lane,
                                             float (&acc)[2 * GU2_RH][1]) {
  constexpr int RH = GU2_RH, R = 2 * GU2_RH;
  if constexpr (OFF32 && QT == QT_IQ2_XXS && !XS) {
    const uint8_t* qbase[R];
    const uint8_t* sbase[R];
    uint32_t qoff[R], soff[R];
    int vec[1] = {vec0};
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
    if constexpr (STEPS > 0) {  // n_ff is even (the launcher checks), so rows f0 and f0 + 1 both exist
      gu_accumulate_unrolled<TB, X8, STEPS>(gate, up, (uint32_t)e * (uint32_t)n_ff + (uint32_t)f0, lane, xq, vec, tb,
                                            acc);
    } else {
      gu_plane_bases(gate, up, qbase, sbase);
      gu_row_offsets(gate, up, (uint32_t)e, f0, n_ff, qoff, soff);
      gu_accumulate_off32<R, TB, X8>(qbase, sbase, qoff, soff, (int)(gate.ncols / 32), lane, xq, vec, tb, acc);
    }
    warp_sum<R, 1>(acc);
    return;
  }
  const uint8_t* qrow[R];
  const uint8_t* srow[R];
#pragma unroll
  for (int i = 0; i < RH; ++i) {
    const int64_t row = e * n_ff + min(f0 + i, n_ff - 1);
    qrow[i] = gate.qs + row * gate.qs_row;
    srow[i] = gate.sc + row * gate.sc_row;
    qrow[RH + i] = up.qs + row * up.qs_row;
    srow[RH + i] = up.sc + row * up.sc_row;
  }
  const int nxb = (int)(gate.ncols / 32), nb = (int)(gate.ncols / 256);
  int vec[1] = {vec0};
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
  mv_accumulate<QT, 1, R, TB, XS, X8>(qrow, srow, nxb, nb, lane, 32, xq, vec, tb, acc);
  warp_sum<R, 1>(acc);
}

// SwiGLU with the clamp, times the routing weight w (1 for the shared expert).
__device__ __forceinline__ float gu_swiglu(float g, float u, float clamp, float w) {
  g = fminf(g, clamp);
  u = fminf(fmaxf(u, -clamp), clamp);
  return g / (1.0f + __expf(-g)) * u * w;
}

// LUT 2: the same with registers for 2 CTAs per SM (form 1 spills 6 values in its loop at 3 CTAs' 80 registers).
// X8: the token's x at 8 bits (the lo plane unread; see moe_x8()).
// STEPS: the unrolled form for rows of 1024 STEPS columns (gu_accumulate_unrolled; with OFF32).
template <int QT, int XM, int LUT = 0, bool X8 = false, bool OFF32 = false, int STEPS = 0>
__global__ void __launch_bounds__(GU_THREADS, LUT >= 2 ? 2 : 3) moe_gateup_rows_kernel(Packed gate, Packed up, int n_ff,
                                                                     int n_expert, XQ xq, const int32_t* ids,
                                                                     const float* wts, int k, float clamp,
                                                                     int units, float* h, const float* x,
                                                                     XQ xq_h) {
  constexpr int RH = GU2_RH, R = 2 * GU2_RH;
  constexpr bool XS = XM != GU_X_GLOBAL;
  extern __shared__ __align__(16) uint2 s_rep[];  // IQ2_XXS: the replicated grid (and LUT: sign masks); then x (XS)
  constexpr size_t table_bytes = gu_table_bytes<QT, LUT>();
  using TB = GuTables<QT, LUT>;
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const TB tb = gu_tables_init<QT, LUT>(s_rep, lane);
  pdl_wait();  // ids, x and h's readers are from earlier kernels
  if constexpr (XM == GU_X_STAGED) xq = gu_stage_x(xq, (unsigned char*)s_rep + table_bytes);
  if constexpr (XM == GU_X_QUANT) xq = gu_quantize_x(x, xq.n, (unsigned char*)s_rep + table_bytes);
  const int groups = (n_ff + RH - 1) / RH;
  for (int unit = blockIdx.x * GU_WARPS + (threadIdx.x >> 5); unit < units; unit += gridDim.x * GU_WARPS) {
    const int pair = unit / groups, f0 = (unit - pair * groups) * RH, token = pair / k;
    const int e = ids[pair];
    const bool bad = e < 0 || e >= n_expert;
    float acc[R][1];
    // XS: the one token's x is the staged vector
    gu_unit_rows<QT, TB, XS, X8, OFF32, STEPS>(gate, up, bad ? 0 : e, f0, n_ff, xq, XS ? 0 : token, tb, lane, acc);
#pragma unroll
    for (int i = 0; i < RH; ++i) {
      const int f = f0 + i;
      if (lane == i && f < n_ff)  // NaN marks an expert id out of range
        h[(int64_t)pair * n_ff + f] = bad ? __int_as_float(0x7fc00000) : gu_swiglu(acc[i][0], acc[RH + i][0], clamp, wts[pair]);
    }
    // XQ: n_ff % 256 == 0, so the RH rows of this unit lie in one x block of h
    if constexpr (XM == GU_X_QUANT)
      if (xq_h.hi) gu_quantize_h_block(h, xq_h, ((int64_t)pair * n_ff + f0) / 32, lane);  // null: mode 2
  }
}

// $DS4_GPU_MOE_SHEXP (decode, one token): the routed experts' gate/up and the shared expert's (Q8_0) in one persistent
// grid. Why: the shared expert's matvecs on a side stream held the SMs when the router ended (every trace since v16:
// the routed gate/up started ~9 us after it), and the two are complementary: the 2-bit decode is bound by instruction
// issue, the Q8_0 rows by DRAM. Units: slot j = unit % (k + 1) (j < k the token's j-th expert, j == k the shared
// expert), rows f0 = (unit / (k + 1)) RH, so every warp's units mix both. h has k + 1 rows: the shared expert's last,
// without a routing weight. The routed rows' arithmetic is the rows kernel's (the same bits).
template <int QT, int LUT>
__global__ void __launch_bounds__(GU_THREADS, 2) moe_gateup_shexp_kernel(Packed gate, Packed up, Packed sg, Packed su,
                                                                         int n_ff, int n_expert, XQ xq,
                                                                         const int32_t* ids, const float* wts, int k,
                                                                         float clamp, int units, float* h) {
  constexpr int RH = GU2_RH, R = 2 * GU2_RH;
  extern __shared__ __align__(16) uint2 s_rep[];
  using TB = GuTables<QT, LUT>;
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const TB tb = gu_tables_init<QT, LUT>(s_rep, lane);
  pdl_wait();  // ids, x and h's readers are from earlier kernels
  const int slots = k + 1;
  for (int unit = blockIdx.x * GU_WARPS + (threadIdx.x >> 5); unit < units; unit += gridDim.x * GU_WARPS) {
    const int j = unit % slots, f0 = (unit / slots) * RH;
    float acc[R][1];
    bool bad = false;
    float w = 1.0f;
    if (j == k) {
      gu_unit_rows<QT_Q8_0, TB, false, false>(sg, su, 0, f0, n_ff, xq, 0, tb, lane, acc);
    } else {
      const int e = ids[j];
      bad = e < 0 || e >= n_expert;
      w = wts[j];
      gu_unit_rows<QT, TB, false, false>(gate, up, bad ? 0 : e, f0, n_ff, xq, 0, tb, lane, acc);
    }
#pragma unroll
    for (int i = 0; i < RH; ++i) {
      const int f = f0 + i;
      if (lane == i && f < n_ff)
        h[(int64_t)j * n_ff + f] = bad ? __int_as_float(0x7fc00000) : gu_swiglu(acc[i][0], acc[RH + i][0], clamp, w);
    }
  }
}

// The down kernels' end: warp sums, then the S column slices of each row group added in order, rows r0 .. of y.
template <int R>
__device__ __forceinline__ void down_rows_out(float (&acc)[R][1], float (&red)[CTA_WARPS][R], int RG, int S,
                                              int block, int n_rows, float* y) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  warp_sum<R, 1>(acc);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) red[warp][r] = acc[r][0];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < RG * R; t += CTA_THREADS) {
    int grp = t / R, r = t % R;
    float s = 0.0f;
    for (int c = 0; c < S; ++c) s += red[grp * S + c][r];
    int row = (block * RG + grp) * R + r;
    if (row < n_rows) y[row] = s;
  }
}

// The shared expert's down rows (Q8_0, one token: h row k of xq) in blocks g_routed.. of the routed down's grid.
struct ShexpDown {
  Packed w;        // qs null: none
  int S = 1;       // column slices
  int g_routed = 0;
  float* y = nullptr;
};

template <int QT, bool X8 = false>
__global__ void __launch_bounds__(CTA_THREADS) moe_down_kernel(Packed down, int n_embd, int n_expert, XQ xq,
                                                               const int32_t* ids, int k, int S, float* y,
                                                               ShexpDown sh) {
  pdl_begin();
  constexpr int R = MOE_R;
  __shared__ unsigned long long s_grid[QT == QT_IQ2_XXS ? 256 : 1];
  __shared__ float red[CTA_WARPS][R];
  Iq2Tables tb{s_grid};
  if constexpr (QT == QT_IQ2_XXS) {
    iq2_tables_init(s_grid);
    __syncthreads();
  }
  const int token = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (sh.w.qs && (int)blockIdx.x >= sh.g_routed) {  // a shared-expert block (one token)
    const int b = blockIdx.x - sh.g_routed, RGs = CTA_WARPS / sh.S, r0 = (b * RGs + warp / sh.S) * R;
    const int nxb = (int)(sh.w.ncols / 32), nb = (int)(sh.w.ncols / 256);
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
    const uint8_t* qrow[R];
    const uint8_t* srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = min(r0 + r, n_embd - 1);
      qrow[r] = sh.w.qs + row * sh.w.qs_row;
      srow[r] = sh.w.sc + row * sh.w.sc_row;
    }
    int vec[1] = {k};
    mv_accumulate<QT_Q8_0, 1, R, Iq2Tables, false, false>(qrow, srow, nxb, nb, (warp % sh.S) * 32 + lane, 32 * sh.S,
                                                          xq, vec, tb, acc);
    down_rows_out<R>(acc, red, RGs, sh.S, b, n_embd, sh.y);
    return;
  }
  const int RG = CTA_WARPS / S, rg = warp / S, cs = warp % S;
  const int r0 = (blockIdx.x * RG + rg) * R;
  float acc[R][1];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
  // The k experts' columns are one long row: units (expert j, x block xb) are spread over the
  // lanes and warps, so no warp walks the experts one DRAM round trip after another.
  const int nxb = (int)(down.ncols / 32), nb = (int)(down.ncols / 256);
  for (int u = cs * 32 + lane; u < k * nxb; u += 32 * S) {
    const int j = u / nxb, xb = u - j * nxb;
    int e = __ldg(ids + token * k + j);
    e = (e < 0 || e >= n_expert) ? 0 : e;  // the gate/up kernel already poisoned this expert's h
    const uint8_t* qrow[R];
    const uint8_t* srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      int64_t row = (int64_t)e * n_embd + min(r0 + r, n_embd - 1);
      qrow[r] = down.qs + row * down.qs_row;
      srow[r] = down.sc + row * down.sc_row;
    }
    int vec[1] = {token * k + j};
    mv_accumulate<QT, 1, R, Iq2Tables, false, X8>(qrow, srow, xb + 1, nb, xb, 1, xq, vec, tb, acc);  // this one x block
  }
  down_rows_out<R>(acc, red, RG, S, blockIdx.x, n_embd, y + (int64_t)token * n_embd);
}

// Resident CTAs of a kernel on the whole device (occupancy x SMs).
template <typename K>
static int resident_ctas(K kernel, int threads, size_t smem) {
  int dev = 0, sms = 0, per_sm = 0;
  DS4_CHECK(cudaGetDevice(&dev));
  DS4_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return std::max(1, per_sm) * sms;
}

static bool gateup_x_shared() {  // $DS4_GPU_GU_XS=1: stage the one token's x in shared memory (A/B)
  static const bool v = [] {
    const char* e = getenv("DS4_GPU_GU_XS");
    return e && e[0] == '1';
  }();
  return v;
}

// $DS4_GPU_GU_XQ: 1 = decode's routed MoE in two launches (gate/up quantizes x and, through arrival counts, h
// itself); 2 = gate/up quantizes x only (three launches: the count's fence and atomic per unit stay out of
// gate/up); unset or 0 = four launches (the default). An A/B switch (v8: mode 1 slower; mode 2 not measured).
static int gateup_x_quant() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_GU_XQ");
    return e && (e[0] == '1' || e[0] == '2') ? e[0] - '0' : 0;
  }();
  return v;
}

// $DS4_GPU_GU_LUT: IQ2_XXS gate/up (x from global memory) with the sign-mask tables, 1 at 3 CTAs per SM, 2 at 2 (no
// spills; v18: decode 7.35 against 7.41 ms at 2k, mode 1 7.42), 3 (the default since v21) form 2's tables read by byte
// offsets from a uniform base (Iq2LutTablesU; the same bits in 13% fewer instructions: kernel bench 20.9 -> 19.0 us,
// decode 6.65 -> 6.56 ms); 0 the computed masks. set_gateup_lut overrides it for this process (0-3; -1 the environment).
static int& gateup_lut_override() {
  static int v = -1;
  return v;
}
void set_gateup_lut(int mode) { gateup_lut_override() = mode >= 0 && mode <= 3 ? mode : -1; }
static int gateup_lut_mode() {
  static const int env = [] {
    const char* e = getenv("DS4_GPU_GU_LUT");
    return e && e[0] >= '0' && e[0] <= '3' ? e[0] - '0' : 3;
  }();
  return gateup_lut_override() >= 0 ? gateup_lut_override() : env;
}

// $DS4_GPU_MOE_X8=1: the routed experts read their activations (x and h) at 8 bits, hi only (x = s hi, error <= s / 2
// per value, s = amax / 127 per 32 columns), as ds4 does (model-spec §3.9), in decode (gate/up, down) and prefill
// (mmq): half the integer products. 0 or unset: hi + lo (~16 bits). set_moe_x8 overrides it (0, 1; -1 the environment).
static int& moe_x8_override() {
  static int v = -1;
  return v;
}
void set_moe_x8(int mode) { moe_x8_override() = mode == 0 || mode == 1 ? mode : -1; }
bool moe_x8() {
  static const bool env = [] {
    const char* e = getenv("DS4_GPU_MOE_X8");
    return e && e[0] == '1';
  }();
  return moe_x8_override() >= 0 ? moe_x8_override() == 1 : env;
}

// Lets kernel take smem bytes of dynamic shared memory; limit: what it was last allowed (never lowered, so a
// later launch with a size between the default and that limit keeps working).
template <typename K>
static void raise_smem_limit(K kernel, size_t smem, size_t& limit) {
  if (smem <= limit) return;
  DS4_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  limit = smem;
}

// $DS4_GPU_GU_OFF32: 1 (the default since v46: decode +0.3-0.8% in three A/B pairs on the H100) = the IQ2_XXS gate/up
// rows kernel (LUT 3) addresses its rows by 32-bit offsets (gu_accumulate_off32; the same bits); 0 by 64-bit row
// pointers. set_gu_off32 overrides it (0, 1; -1 the environment).
static EnvSwitch gu_off32_switch{"DS4_GPU_GU_OFF32", 1, 1};
void set_gu_off32(int mode) { gu_off32_switch.set(mode); }
static long long g_gu_off32_launches = 0;
long long gu_off32_launches() { return g_gu_off32_launches; }
static bool planes_under_4g(const Packed& p) {  // every row offset of both planes fits 32 bits
  return p.nrows * p.qs_row < (int64_t(1) << 32) && p.nrows * p.sc_row < (int64_t(1) << 32);
}

// $DS4_GPU_GU_UNROLL: 1 (the default since v47: H100 kernel 18.5 -> 17.6 us, decode +0.6-1.0%) = where the
// 32-bit-offset form runs on rows of Flash's 4096 columns, its unrolled form
// (gu_accumulate_unrolled; the same bits); 0 the rolled loop. set_gu_unroll overrides it (0, 1; -1 the environment).
constexpr int GU_UNROLL_STEPS = 4;
static EnvSwitch gu_unroll_switch{"DS4_GPU_GU_UNROLL", 1, 1};
void set_gu_unroll(int mode) { gu_unroll_switch.set(mode); }
static long long g_gu_unroll_launches = 0;
long long gu_unroll_launches() { return g_gu_unroll_launches; }
static bool gu_unroll_takes(const Packed& gate, const Packed& up, int n_ff) {  // gu_accumulate_unrolled's layout
  constexpr int64_t cols = 1024 * GU_UNROLL_STEPS;
  auto dense = [](const Packed& p) { return p.ncols == cols && p.qs_row == cols / 4 && p.sc_row == cols / 128; };
  return dense(gate) && dense(up) && n_ff % GU2_RH == 0;
}

template <int QT, int XM, int LUT = 0, bool X8 = false, bool OFF32 = false, int STEPS = 0>
static void launch_gateup_rows_as(const Packed& gate, const Packed& up, int n_ff, int n_expert, const XQ& xq,
                                  const int32_t* ids, const float* wts, int pairs, int k, float clamp, float* h,
                                  cudaStream_t stream, const float* x = nullptr, const XQ& xq_h = XQ()) {
  const int units = ((n_ff + GU2_RH - 1) / GU2_RH) * pairs;
  const size_t smem = gu_table_bytes<QT, LUT>() + (XM != GU_X_GLOBAL ? gu_xs_bytes(xq.n) : 0);
  static std::map<size_t, int> resident;  // resident CTAs for this shared-memory size
  static size_t smem_set = 48 * 1024;     // the kernel's dynamic shared-memory limit: only ever raised
  raise_smem_limit(moe_gateup_rows_kernel<QT, XM, LUT, X8, OFF32, STEPS>, smem, smem_set);
  auto it = resident.find(smem);
  if (it == resident.end())
    it = resident.emplace(smem, resident_ctas(moe_gateup_rows_kernel<QT, XM, LUT, X8, OFF32, STEPS>, GU_THREADS, smem)).first;
  if constexpr (OFF32) ++g_gu_off32_launches;
  if constexpr (STEPS > 0) ++g_gu_unroll_launches;
  launch_k(moe_gateup_rows_kernel<QT, XM, LUT, X8, OFF32, STEPS>, dim3((unsigned)std::min((units + GU_WARPS - 1) / GU_WARPS, it->second)),
           dim3(GU_THREADS), smem, stream, gate, up, n_ff, n_expert, xq, ids, wts, k, clamp, units, h, x, xq_h);
}

template <int QT>
static void launch_gateup_rows(const Packed& gate, const Packed& up, int n_ff, int n_expert, const XQ& xq,
                               const int32_t* ids, const float* wts, int pairs, int k, float clamp, float* h,
                               cudaStream_t stream) {
  if (moe_x8()) {  // 8-bit x: the sign tables (IQ2_XXS, unless GU_LUT=0) or the computed masks, x from global memory
    if (QT == QT_IQ2_XXS && gateup_lut_mode() != 0)
      launch_gateup_rows_as<QT, GU_X_GLOBAL, 3, true>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h, stream);
    else
      launch_gateup_rows_as<QT, GU_X_GLOBAL, 0, true>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h, stream);
    return;
  }
  // one token (decode) and x planes that int4 copies can stage
  if (gateup_x_shared() && pairs == k && xq.n % 256 == 0 && gu_xs_bytes(xq.n) <= 32 * 1024)
    launch_gateup_rows_as<QT, GU_X_STAGED>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h, stream);
  else if (QT == QT_IQ2_XXS && gateup_lut_mode() == 1)
    launch_gateup_rows_as<QT, GU_X_GLOBAL, 1>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h, stream);
  else if (QT == QT_IQ2_XXS && gateup_lut_mode() == 2)
    launch_gateup_rows_as<QT, GU_X_GLOBAL, 2>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h, stream);
  else if (QT == QT_IQ2_XXS && gateup_lut_mode() == 3 && gu_off32_switch.get() == 1 && planes_under_4g(gate) &&
           planes_under_4g(up) && gu_unroll_switch.get() == 1 && gu_unroll_takes(gate, up, n_ff))
    launch_gateup_rows_as<QT, GU_X_GLOBAL, 3, false, true, GU_UNROLL_STEPS>(gate, up, n_ff, n_expert, xq, ids, wts,
                                                                           pairs, k, clamp, h, stream);
  else if (QT == QT_IQ2_XXS && gateup_lut_mode() == 3 && gu_off32_switch.get() == 1 && planes_under_4g(gate) &&
           planes_under_4g(up))
    launch_gateup_rows_as<QT, GU_X_GLOBAL, 3, false, true>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h,
                                                           stream);
  else if (QT == QT_IQ2_XXS && gateup_lut_mode() == 3)
    launch_gateup_rows_as<QT, GU_X_GLOBAL, 3>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h, stream);
  else
    launch_gateup_rows_as<QT, GU_X_GLOBAL>(gate, up, n_ff, n_expert, xq, ids, wts, pairs, k, clamp, h, stream);
}

// XQ (decode): gate/up from the float32 x of the one token, h also quantized into xq_h; only where
// gateup_xq_takes.
static bool gateup_xq_takes(int qtype, int tokens, int n_embd, int n_ff, int k) {
  return gateup_x_quant() != 0 && !moe_x8() && !(qtype == QT_IQ2_XXS && gateup_mma_enabled()) && tokens == 1 && n_embd % 256 == 0 &&
         n_ff % 256 == 0 && gu_xs_bytes(n_embd) <= 32 * 1024 && (int64_t)k * (n_ff / 32) <= GU_XQ_MAX_BLOCKS;
}

static void launch_gateup_xq(const Packed& gate, const Packed& up, int n_ff, int n_expert, const float* x,
                             const int32_t* ids, const float* wts, int k, float clamp, const MoeScratch& s,
                             cudaStream_t stream) {
  XQ xq;  // only n: the planes are the kernel's shared memory
  xq.n = (int)gate.ncols;
  const XQ xq_h = gateup_x_quant() == 1 ? s.xq_h : XQ();  // mode 2: h is quantized by its own launch
  switch (gate.qtype) {
    case QT_Q8_0: launch_gateup_rows_as<QT_Q8_0, GU_X_QUANT>(gate, up, n_ff, n_expert, xq, ids, wts, k, k, clamp, s.h, stream, x, xq_h); break;
    case QT_Q4_K: launch_gateup_rows_as<QT_Q4_K, GU_X_QUANT>(gate, up, n_ff, n_expert, xq, ids, wts, k, k, clamp, s.h, stream, x, xq_h); break;
    case QT_Q2_K: launch_gateup_rows_as<QT_Q2_K, GU_X_QUANT>(gate, up, n_ff, n_expert, xq, ids, wts, k, k, clamp, s.h, stream, x, xq_h); break;
    case QT_IQ2_XXS: launch_gateup_rows_as<QT_IQ2_XXS, GU_X_QUANT>(gate, up, n_ff, n_expert, xq, ids, wts, k, k, clamp, s.h, stream, x, xq_h); break;
    default: throw std::invalid_argument("moe: unsupported gate type " + std::to_string(gate.qtype));
  }
}

// sh.w set (one token): the shared expert's down rows in blocks of the same launch, after the routed ones.
template <int QT>
static void launch_down(const Packed& down, int n_embd, int n_expert, const XQ& xq, const int32_t* ids,
                        int tokens, int k, float* y, cudaStream_t stream, ShexpDown sh = ShexpDown()) {
  int S = column_splits(k * down.ncols / 32);
  int rows_per_cta = (CTA_WARPS / S) * MOE_R;
  dim3 grid((n_embd + rows_per_cta - 1) / rows_per_cta, tokens);
  if (sh.w.qs) {
    sh.S = column_splits(sh.w.ncols / 32);
    const int rows_s = (CTA_WARPS / sh.S) * MOE_R;
    sh.g_routed = (int)grid.x;
    grid.x += (n_embd + rows_s - 1) / rows_s;
  }
  if (moe_x8())
    launch_k(moe_down_kernel<QT, true>, dim3(grid), dim3(CTA_THREADS), 0, stream, down, n_embd, n_expert, xq, ids, k, S, y,
             sh);
  else
    launch_k(moe_down_kernel<QT>, dim3(grid), dim3(CTA_THREADS), 0, stream, down, n_embd, n_expert, xq, ids, k, S, y, sh);
  DS4_CHECK_LAUNCH("moe down");
}

void launch_moe_gateup(const Packed& gate, const Packed& up, int n_expert, const float* x, const int32_t* ids,
                       const float* weights, int tokens, int k, float clamp, const MoeScratch& s,
                       cudaStream_t stream, bool x_quantized) {
  if (gate.qtype != up.qtype) throw std::invalid_argument("gate and up experts must share a type");
  if (gate.qtype == QT_F16) throw std::invalid_argument("MoE needs quantized experts");
  if (n_expert < 1 || gate.nrows % n_expert)
    throw std::invalid_argument("expert count does not divide the stacked rows");
  if (up.ncols != gate.ncols || up.nrows != gate.nrows) throw std::invalid_argument("gate and up shapes differ");
  const int n_embd = (int)gate.ncols, n_ff = (int)(gate.nrows / n_expert), pairs = tokens * k;
  if (!x_quantized) launch_quantize_x(x, tokens, n_embd, s.xq_in, stream);
  switch (gate.qtype) {
    case QT_Q8_0: launch_gateup_rows<QT_Q8_0>(gate, up, n_ff, n_expert, s.xq_in, ids, weights, pairs, k, clamp, s.h, stream); break;
    case QT_Q4_K: launch_gateup_rows<QT_Q4_K>(gate, up, n_ff, n_expert, s.xq_in, ids, weights, pairs, k, clamp, s.h, stream); break;
    case QT_Q2_K: launch_gateup_rows<QT_Q2_K>(gate, up, n_ff, n_expert, s.xq_in, ids, weights, pairs, k, clamp, s.h, stream); break;
    case QT_IQ2_XXS:
      if (!gateup_mma_enabled() || moe_x8() ||
          !launch_gateup_mma(gate, up, n_ff, n_expert, s.xq_in, ids, weights, pairs, k, clamp, s.h, stream))
        launch_gateup_rows<QT_IQ2_XXS>(gate, up, n_ff, n_expert, s.xq_in, ids, weights, pairs, k, clamp, s.h, stream);
      break;
    default: throw std::invalid_argument("moe: unsupported gate type " + std::to_string(gate.qtype));
  }
}

void launch_moe(const Packed& gate, const Packed& up, const Packed& down, int n_expert, const float* x,
                const int32_t* ids, const float* weights, int tokens, int k, float clamp, float* y,
                const MoeScratch& s, cudaStream_t stream, bool x_quantized) {
  if (gate.qtype != up.qtype) throw std::invalid_argument("gate and up experts must share a type");
  if (gate.qtype == QT_F16 || down.qtype == QT_F16) throw std::invalid_argument("MoE needs quantized experts");
  if (n_expert < 1 || gate.nrows % n_expert || down.nrows % n_expert)
    throw std::invalid_argument("expert count does not divide the stacked rows");
  const int n_embd = (int)gate.ncols, n_ff = (int)(gate.nrows / n_expert);
  if (down.ncols != n_ff || down.nrows / n_expert != n_embd || up.ncols != gate.ncols || up.nrows != gate.nrows)
    throw std::invalid_argument("gate/up/down shapes do not form one expert FFN");
  const int pairs = tokens * k;
  if (!x_quantized && gateup_xq_takes(gate.qtype, tokens, n_embd, n_ff, k)) {
    launch_gateup_xq(gate, up, n_ff, n_expert, x, ids, weights, k, clamp, s, stream);
    if (gateup_x_quant() == 2) launch_quantize_x(s.h, pairs, n_ff, s.xq_h, stream);
  } else {
    launch_moe_gateup(gate, up, n_expert, x, ids, weights, tokens, k, clamp, s, stream, x_quantized);
    launch_quantize_x(s.h, pairs, n_ff, s.xq_h, stream);
  }
  switch (down.qtype) {
    case QT_Q8_0: launch_down<QT_Q8_0>(down, n_embd, n_expert, s.xq_h, ids, tokens, k, y, stream); break;
    case QT_Q4_K: launch_down<QT_Q4_K>(down, n_embd, n_expert, s.xq_h, ids, tokens, k, y, stream); break;
    case QT_Q2_K: launch_down<QT_Q2_K>(down, n_embd, n_expert, s.xq_h, ids, tokens, k, y, stream); break;
    case QT_IQ2_XXS: launch_down<QT_IQ2_XXS>(down, n_embd, n_expert, s.xq_h, ids, tokens, k, y, stream); break;
    default: throw std::invalid_argument("moe: unsupported down type " + std::to_string(down.qtype));
  }
}

template <int QT, int LUT>
static void launch_gateup_shexp_as(const Packed& gate, const Packed& up, const Packed& sg, const Packed& su, int n_ff,
                                   int n_expert, const XQ& xq, const int32_t* ids, const float* wts, int k,
                                   float clamp, float* h, cudaStream_t stream) {
  const int units = ((n_ff + GU2_RH - 1) / GU2_RH) * (k + 1);
  const size_t smem = gu_table_bytes<QT, LUT>();
  static int resident = 0;
  static size_t smem_set = 48 * 1024;
  raise_smem_limit(moe_gateup_shexp_kernel<QT, LUT>, smem, smem_set);
  if (!resident) resident = resident_ctas(moe_gateup_shexp_kernel<QT, LUT>, GU_THREADS, smem);
  launch_k(moe_gateup_shexp_kernel<QT, LUT>, dim3((unsigned)std::min((units + GU_WARPS - 1) / GU_WARPS, resident)),
           dim3(GU_THREADS), smem, stream, gate, up, sg, su, n_ff, n_expert, xq, ids, wts, k, clamp, units, h);
  DS4_CHECK_LAUNCH("moe gate/up + shared expert");
}

bool moe_shexp_takes(const Packed& gate, const Packed& down, const Packed& sg, const Packed& su, const Packed& sd,
                     int n_expert, int tokens) {
  if (tokens != 1 || moe_x8() || gate.qtype == QT_F16 || down.qtype == QT_F16 || n_expert < 1) return false;
  if (gate.qtype == QT_IQ2_XXS && gateup_mma_enabled()) return false;
  const int64_t n_ff = gate.nrows / n_expert, n_embd = gate.ncols;
  for (const Packed* w : {&sg, &su, &sd})
    if (w->qtype != QT_Q8_0) return false;
  return sg.nrows == n_ff && su.nrows == n_ff && sg.ncols == n_embd && su.ncols == n_embd && sd.nrows == n_embd &&
         sd.ncols == n_ff && n_ff % 32 == 0;
}

void launch_moe_shexp(const Packed& gate, const Packed& up, const Packed& down, const Packed& sg, const Packed& su,
                      const Packed& sd, int n_expert, const float* x, const int32_t* ids, const float* weights, int k,
                      float clamp, float* y, float* y_shexp, const MoeScratch& s, cudaStream_t stream,
                      bool x_quantized) {
  if (!moe_shexp_takes(gate, down, sg, su, sd, n_expert, 1)) throw std::invalid_argument("moe_shexp: shapes or types it does not take");
  const int n_embd = (int)gate.ncols, n_ff = (int)(gate.nrows / n_expert);
  if (!x_quantized) launch_quantize_x(x, 1, n_embd, s.xq_in, stream);
  switch (gate.qtype) {
    case QT_Q8_0: launch_gateup_shexp_as<QT_Q8_0, 0>(gate, up, sg, su, n_ff, n_expert, s.xq_in, ids, weights, k, clamp, s.h, stream); break;
    case QT_Q4_K: launch_gateup_shexp_as<QT_Q4_K, 0>(gate, up, sg, su, n_ff, n_expert, s.xq_in, ids, weights, k, clamp, s.h, stream); break;
    case QT_Q2_K: launch_gateup_shexp_as<QT_Q2_K, 0>(gate, up, sg, su, n_ff, n_expert, s.xq_in, ids, weights, k, clamp, s.h, stream); break;
    case QT_IQ2_XXS: launch_gateup_shexp_as<QT_IQ2_XXS, 3>(gate, up, sg, su, n_ff, n_expert, s.xq_in, ids, weights, k, clamp, s.h, stream); break;
    default: throw std::invalid_argument("moe: unsupported gate type " + std::to_string(gate.qtype));
  }
  launch_quantize_x(s.h, k + 1, n_ff, s.xq_h, stream);  // the k experts' h and the shared expert's
  ShexpDown sh;
  sh.w = sd;
  sh.y = y_shexp;
  switch (down.qtype) {
    case QT_Q8_0: launch_down<QT_Q8_0>(down, n_embd, n_expert, s.xq_h, ids, 1, k, y, stream, sh); break;
    case QT_Q4_K: launch_down<QT_Q4_K>(down, n_embd, n_expert, s.xq_h, ids, 1, k, y, stream, sh); break;
    case QT_Q2_K: launch_down<QT_Q2_K>(down, n_embd, n_expert, s.xq_h, ids, 1, k, y, stream, sh); break;
    case QT_IQ2_XXS: launch_down<QT_IQ2_XXS>(down, n_embd, n_expert, s.xq_h, ids, 1, k, y, stream, sh); break;
    default: throw std::invalid_argument("moe: unsupported down type " + std::to_string(down.qtype));
  }
}

namespace {
// One CTA per token; float4 columns per thread; the k rows summed in slot order (deterministic).
__global__ void moe_combine_kernel(const float4* __restrict__ y_sorted, const int64_t* __restrict__ slot_row, int k,
                                   int n4, float4* __restrict__ out) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  for (int c = threadIdx.x; c < n4; c += blockDim.x) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < k; ++j) {
      const float4 v = y_sorted[slot_row[t * k + j] * n4 + c];
      acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
    }
    out[t * n4 + c] = acc;
  }
}
}  // namespace

void launch_moe_combine(const float* y_sorted, const int64_t* slot_row, int tokens, int k, int n, float* out,
                        cudaStream_t stream) {
  if (n % 4 || tokens < 0 || k < 1) throw std::invalid_argument("moe_combine: needs n % 4 == 0 and k >= 1");
  if (tokens == 0) return;
  launch_k(moe_combine_kernel, dim3(tokens), dim3(256), 0, stream, (const float4*)y_sorted, slot_row, k, n / 4,
           (float4*)out);
  DS4_CHECK_LAUNCH("moe_combine");
}

}  // namespace ds4gpu
