// The IQ2_XXS experts' prefill product on Hopper's warpgroup MMA (wgmma): mmf.cu's arithmetic with both operands
// read by the tensor cores from shared memory. DS4_GPU_MOE_GEMM=mmw (gate and up here, down on mmq); v14, off.
#include <cuda_fp16.h>

#include <cstdlib>

#include "common.cuh"
#include "mf_common.cuh"
#include "mbarrier.cuh"
#include "mma_ops.cuh"
#include "mv_core.cuh"

namespace ds4gpu {

namespace {

// ---- mmw (v14): the IQ2_XXS experts' product on Hopper's warpgroup MMA (wgmma) ----
// mmf's arithmetic (the codes (2 ls + 1) grid sign as exact float16 integers, x / s = hi + lo as float16, float32
// accumulation, d / 8 once per 256-column super-block), with both operands read by the tensor cores straight from
// shared memory through matrix descriptors: no ldmatrix, no fragments in registers, and the warps free while the
// products run. mmq (v14: ~15 instructions per IMMA, issue-bound in its per-32-column epilogue) and mmf on mma.sync
// (latency-bound at 8 and 16 warps) both stay far below the tensor cores' rate; here the epilogue runs once per
// super-block on a 64 x 64 warpgroup tile, and the next stage's weights are decoded while the MMAs of this one run.
// Measured (v14, H200): correct (1e-6 from mmf), but the expert gate takes 1.29 ms against mmq's 1.06: two CTA barriers
// per 64-column stage and two stages in flight keep the tensor cores a quarter busy. NOTES.md v14 item 7 has the plan
// (a warp-specialized pipeline).
//
// A CTA: two warpgroups, 128 weight rows (64 each) x 64 activation rows, stages of 64 columns, two stage buffers.
// Shared layout of a stage: K-major core matrices of 8 rows x 16 bytes (8 float16), no swizzle (the canonical
// INTERLEAVE layout): element (r, k) of the weights at byte ((k / 8) (MW_M / 8) + r / 8) 128 + (r % 8) 16 + (k % 8) 2,
// so the core matrices adjacent in K are MW_M / 8 x 128 bytes apart (the descriptor's leading byte offset) and those
// adjacent in rows 128 bytes (its stride byte offset); the activation planes alike with MW_N rows.
constexpr int MW_THREADS = 256;
constexpr int MW_M = 128;                                // weight rows per CTA (64 per warpgroup)
constexpr int MW_N = 64;                                 // activation rows per CTA (one wgmma's N)
constexpr int MW_KS = 64;                                // columns per stage
constexpr int MW_SPB = 256 / MW_KS;                      // stages per super-block
constexpr int MW_PAIRS = MW_M * (MW_KS / 32) / MW_THREADS;  // (row, 32-column block) decodes per thread and stage
static_assert(MW_PAIRS == 1, "one decode per thread and stage");

struct MwStage {
  __half a[MW_M * MW_KS];   // weights (16 KB)
  __half bh[MW_N * MW_KS];  // activations hi (8 KB)
  __half bl[MW_N * MW_KS];  // activations lo (8 KB)
};

__device__ __forceinline__ int mw_off(int r, int k, int rows) {  // element offset in the core-matrix layout
  return (((k >> 3) * (rows >> 3) + (r >> 3)) << 6) + ((r & 7) << 3) + (k & 7);
}

// Matrix descriptor (PTX ISA "matrix descriptor format"): start address, leading and stride byte offsets (all >> 4),
// base offset 0, no swizzle.
__device__ __forceinline__ uint64_t mw_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32);
}

// d (+)= A[64 x 16] . B[64 x 16]^T: float32 accumulators, float16 operands, both K-major (no transpose).
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The activation planes of stage k0 (cp.async, rows past the tile zero-filled): 16-byte pieces are core-matrix rows.
__device__ __forceinline__ void mw_load_x(const MfArgs& a, const MfTile& tl, int k0, MwStage& st) {
  for (int i = threadIdx.x; i < MW_N * (MW_KS / 8); i += MW_THREADS) {
    const int t = i / (MW_KS / 8), c = i % (MW_KS / 8);
    const bool ok = t < tl.an;
    const int64_t off = (tl.a0 + (ok ? t : 0)) * a.K + k0 + 8 * c;
    const int o = mw_off(t, 8 * c, MW_N);
    cp16(st.bh + o, a.xh + off, ok);
    cp16(st.bl + o, a.xl + off, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// This thread's (weight row, 32-column block) of stage k0: row tid / 2, block tid % 2.
__device__ __forceinline__ void mw_load_w(const MfArgs& a, const MfTile& tl, int k0, RawXb& raw) {
  const int row = threadIdx.x >> 1, b = threadIdx.x & 1;
  const int64_t wr = tl.wrow0 + min(tl.r0 + row, a.rows_g - 1);
  load_xb<QT_IQ2_XXS, false>(a.w.qs + wr * a.w.qs_row, a.w.sc + wr * a.w.sc_row, k0 / 32 + b, a.nb, raw);
}

// Its codes (2 ls + 1) grid sign as float16 integers into the stage; at a super-block's first block, d / 8 into sd.
__device__ __forceinline__ void mw_decode_w(const MfArgs& a, const MfTile& tl, int k0, const RawXb& raw,
                                            const unsigned long long* grid, MwStage& st, float* sd) {
  const int row = threadIdx.x >> 1, b = threadIdx.x & 1;
  const bool ok = tl.r0 + row < a.rows_g;
  XbCodes d;
  decode_xb<QT_IQ2_XXS>(raw, Iq2Tables{grid}, d);
  const __half2 m = __half2half2(__int2half_rn(2 * (int)(raw.q[1] >> 28) + 1));
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // columns 32 b + 8 j .. + 7: one core-matrix row
    const uint2 lo = codes_half<true>(d.c[2 * j], m), hi = codes_half<true>(d.c[2 * j + 1], m);
    const uint4 v = ok ? make_uint4(lo.x, lo.y, hi.x, hi.y) : make_uint4(0u, 0u, 0u, 0u);
    *(uint4*)(st.a + mw_off(row, 32 * b + 8 * j, MW_M)) = v;
  }
  if (b == 0 && (k0 & 255) == 0) sd[row] = ok ? half_bits(raw.s0) * 0.125f : 0.0f;
}

__global__ void __launch_bounds__(MW_THREADS, 2) mmw_kernel(MfArgs a) {
  extern __shared__ __align__(128) unsigned char mw_smem[];
  MwStage* st = reinterpret_cast<MwStage*>(mw_smem);
  float* sd = reinterpret_cast<float*>(mw_smem + 2 * sizeof(MwStage));  // [2][MW_M]: d / 8 per super-block parity
  unsigned long long* grid = reinterpret_cast<unsigned long long*>(sd + 2 * MW_M);
  const MfTile tl = mf_tile<MW_M, MW_N>(a);
  if (tl.an <= 0) return;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  iq2_tables_init(grid);
  float y[32], acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) y[i] = acc[i] = 0.0f;
  const int nstages = a.K / MW_KS;
  RawXb raw;
  mw_load_x(a, tl, 0, st[0]);
  mw_load_w(a, tl, 0, raw);
  __syncthreads();  // the grid table
  mw_decode_w(a, tl, 0, raw, grid, st[0], sd);
  // super-blocks outside, their stages unrolled inside: no loop edge between two stages' products (at one, ptxas
  // waited for the products in flight before looping back), and the stage buffer index is a constant
  for (int sb = 0; sb < nstages / MW_SPB; ++sb) {
#pragma unroll
    for (int q = 0; q < MW_SPB; ++q) {
      const int s = sb * MW_SPB + q;
      MwStage& S = st[q & 1];
      asm volatile("cp.async.wait_group 0;\n" ::);
      fence_async_smem();  // this thread's stores and copies of stage s, for the tensor cores
      __syncthreads();     // every thread's
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < MW_KS / 16; ++j) {  // k16 steps: core matrices 2 j, 2 j + 1 along K
        const uint64_t da = mw_desc(S.a + mw_off(64 * wg, 16 * j, MW_M), MW_M / 8 * 128, 128);
        const uint64_t dh = mw_desc(S.bh + mw_off(0, 16 * j, MW_N), MW_N / 8 * 128, 128);
        const uint64_t dl = mw_desc(S.bl + mw_off(0, 16 * j, MW_N), MW_N / 8 * 128, 128);
        wgmma_64x64x16(acc, da, dh, q == 0 && j == 0 ? 0 : 1);
        wgmma_64x64x16(acc, da, dl, 1);
      }
      wgmma_commit();
      if (s + 1 < nstages) {  // stage s + 1 into the other buffer while these run; its last readers were stage s - 1's
        mw_load_w(a, tl, (s + 1) * MW_KS, raw);
        wgmma_wait<1>();
        __syncthreads();  // both warpgroups' stage s - 1 products are done
        mw_load_x(a, tl, (s + 1) * MW_KS, st[(q + 1) & 1]);
        mw_decode_w(a, tl, (s + 1) * MW_KS, raw, grid, st[(q + 1) & 1], sd + ((s + 1) / MW_SPB & 1) * MW_M);
      }
    }
    wgmma_wait<0>();  // the super-block's sums times d / 8 onto y
    const float* d = sd + (sb & 1) * MW_M + 64 * wg + 16 * warp + (lane >> 2);
    const float d0 = d[0], d1 = d[8];
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = fmaf((i & 2) ? d1 : d0, acc[i], y[i]);
  }
  // acc[4 n + e]: weight row 16 warp + lane / 4 + 8 (e / 2) of the warpgroup, activation row 8 n + 2 (lane % 4) + e % 2
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = tl.r0 + 64 * wg + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
    const int t = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    if (r < a.rows_g && t < tl.an) a.y[(tl.a0 + t) * a.rows_g + r] = y[i] * a.s[tl.a0 + t];
  }
}


// ---- the warp-specialized form (DS4_GPU_MMW_PIPE=1; v14, prepared, not yet run on a GPU) ----
// Why: the form above runs every stage in lock step (two CTA barriers per 64 columns; the decode, the copies and the
// products of a CTA take turns), and measured 1.29 ms for the expert gate, a quarter of the tensor cores' rate. Here
// warpgroup 0 produces and warpgroups 1 and 2 consume, through MP_S stage slots handed over by mbarriers:
//   - the producer copies a stage's raw IQ2_XXS rows (16 bytes per row: two 32-column blocks) and its activation
//     planes with cp.async MP_PD stages ahead, decodes the raw rows of the current stage into the float16 codes, and
//     arrives on the slot's `full` barrier once its copies have landed and its stores are fenced for the async proxy;
//   - each consumer waits on `full`, issues the stage's four m64n128k16 products (B = the 64 activations' hi rows, then
//     their lo rows: each weight fragment read once for both), and after the next stage's products are issued
//     (wgmma.wait_group 1) releases the previous slot on its `empty` barrier; at a super-block's end it waits for all,
//     adds d / 8 (hi + lo) onto y.
// 384 threads, one CTA per SM (~144 KB of shared memory).
constexpr int MP_THREADS = 384;
constexpr int MP_S = 4;   // stage slots
constexpr int MP_PD = 2;  // stages copied ahead of the one being decoded
static_assert(MP_PD < MP_S, "a slot is refilled only after the consumers release it");

struct MpSlot {
  __half a[MW_M * MW_KS];      // the weights' codes (16 KB)
  __half b[2 * MW_N * MW_KS];  // activations: rows 0 .. 63 hi, 64 .. 127 lo (16 KB)
  uint4 raw[MW_M];             // each weight row's two IQ2_XXS blocks of the stage (2 KB)
  float sd[MW_M];              // d / 8 of the stage's super-block per row
};

// d (+)= A[64 x 16] . B[128 x 16]^T (float32 accumulators, float16 operands, both K-major).
__device__ __forceinline__ void wgmma_64x128x16(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accumulate));
}

// Producer thread t (of 128): the raw row t and 8 of the 1024 activation pieces of stage kb into slot sl.
__device__ __forceinline__ void mp_copy(const MfArgs& a, const MfTile& tl, int kb, MpSlot& sl, int t) {
  const int k0 = kb * MW_KS;
  const int64_t wr = tl.wrow0 + min(tl.r0 + t, a.rows_g - 1);
  cp16(&sl.raw[t], a.w.qs + wr * a.w.qs_row + 8 * (k0 / 32), tl.r0 + t < a.rows_g);
#pragma unroll
  for (int i = t; i < MW_N * (MW_KS / 8); i += 128) {
    const int r = i / (MW_KS / 8), c = i % (MW_KS / 8);
    const bool ok = r < tl.an;
    const int64_t off = (tl.a0 + (ok ? r : 0)) * a.K + k0 + 8 * c;
    cp16(sl.b + mw_off(r, 8 * c, 2 * MW_N), a.xh + off, ok);
    cp16(sl.b + mw_off(MW_N + r, 8 * c, 2 * MW_N), a.xl + off, ok);
  }
}

// Producer thread t: row t's two blocks of the slot's raw copy as float16 codes, and d / 8 (dv) for the consumers.
__device__ __forceinline__ void mp_decode(const MfArgs& a, const MfTile& tl, MpSlot& sl, int t, float dv,
                                          const unsigned long long* grid) {
  const bool ok = tl.r0 + t < a.rows_g;
  const uint4 r = sl.raw[t];
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    RawXb raw{};
    raw.q[0] = b ? r.z : r.x;
    raw.q[1] = b ? r.w : r.y;
    XbCodes d;
    decode_xb<QT_IQ2_XXS>(raw, Iq2Tables{grid}, d);
    const __half2 m = __half2half2(__int2half_rn(2 * (int)(raw.q[1] >> 28) + 1));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint2 lo = codes_half<true>(d.c[2 * j], m), hi = codes_half<true>(d.c[2 * j + 1], m);
      const uint4 v = ok ? make_uint4(lo.x, lo.y, hi.x, hi.y) : make_uint4(0u, 0u, 0u, 0u);
      *(uint4*)(sl.a + mw_off(t, 32 * b + 8 * j, MW_M)) = v;
    }
  }
  sl.sd[t] = ok ? dv : 0.0f;
}

// d / 8 of row t's super-block sb (its f16 scale in the sc plane)
__device__ __forceinline__ float mp_d(const MfArgs& a, const MfTile& tl, int t, int sb) {
  const int64_t wr = tl.wrow0 + min(tl.r0 + t, a.rows_g - 1);
  return half_bits(__ldg((const unsigned short*)(a.w.sc + wr * a.w.sc_row) + sb)) * 0.125f;
}

__global__ void __launch_bounds__(MP_THREADS, 1) mmw_pipe_kernel(MfArgs a) {
  extern __shared__ __align__(128) unsigned char mp_smem[];
  MpSlot* slot = reinterpret_cast<MpSlot*>(mp_smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(mp_smem + MP_S * sizeof(MpSlot));
  uint64_t* empty = full + MP_S;
  unsigned long long* grid = reinterpret_cast<unsigned long long*>(empty + MP_S);
  const MfTile tl = mf_tile<MW_M, MW_N>(a);
  if (tl.an <= 0) return;
  const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;
  const int nstages = a.K / MW_KS;
  if (threadIdx.x == 0) {
    for (int i = 0; i < MP_S; ++i) {
      mbar_init(&full[i], 128);  // every producer thread
      mbar_init(&empty[i], 2);   // one thread of each consumer warpgroup
    }
  }
  iq2_tables_init(grid);  // threads 0 .. 255 write one entry each; the producer reads them
  __syncthreads();
  if (wg == 0) {  // producer
    for (int kb = 0; kb < MP_PD && kb < nstages; ++kb) {
      mp_copy(a, tl, kb, slot[kb % MP_S], t);
      asm volatile("cp.async.commit_group;\n" ::);
    }
    float dnext = mp_d(a, tl, t, 0), dcur = 0.0f;
    for (int kb = 0; kb < nstages; ++kb) {
      const int ahead = kb + MP_PD;
      if (ahead < nstages) {
        if (ahead >= MP_S) mbar_wait(&empty[ahead % MP_S], (ahead / MP_S - 1) & 1);
        mp_copy(a, tl, ahead, slot[ahead % MP_S], t);
      }
      asm volatile("cp.async.commit_group;\n" ::);  // possibly empty: one group per iteration
      if (kb % MW_SPB == 0) {  // a new super-block: its d, and the next one's requested
        dcur = dnext;
        if (kb / MW_SPB + 1 < nstages / MW_SPB) dnext = mp_d(a, tl, t, kb / MW_SPB + 1);
      }
      asm volatile("cp.async.wait_group %0;\n" ::"n"(MP_PD));  // this thread's copies of stage kb have landed
      MpSlot& sl = slot[kb % MP_S];
      mp_decode(a, tl, sl, t, dcur, grid);
      fence_async_smem();  // its copies and stores, for the tensor cores
      mbar_arrive(&full[kb % MP_S]);
    }
    return;
  }
  // consumers: warpgroup c = wg - 1 takes weight rows 64 c ..
  const int c = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  float y[32], acc[64];
#pragma unroll
  for (int i = 0; i < 32; ++i) y[i] = acc[i] = acc[32 + i] = 0.0f;
  for (int kb = 0; kb < nstages; ++kb) {
    MpSlot& sl = slot[kb % MP_S];
    mbar_wait(&full[kb % MP_S], (kb / MP_S) & 1);
    fence_async_smem();
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < MW_KS / 16; ++j) {
      const uint64_t da = mw_desc(sl.a + mw_off(64 * c, 16 * j, MW_M), MW_M / 8 * 128, 128);
      const uint64_t db = mw_desc(sl.b + mw_off(0, 16 * j, 2 * MW_N), 2 * MW_N / 8 * 128, 128);
      wgmma_64x128x16(acc, da, db, kb % MW_SPB == 0 && j == 0 ? 0 : 1);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous stage's products are done: its slot goes back to the producer
    if (kb > 0 && t == 0) mbar_arrive(&empty[(kb - 1) % MP_S]);
    if (kb % MW_SPB == MW_SPB - 1) {  // the super-block's end: (hi + lo) times d / 8 onto y
      wgmma_wait<0>();
      const float d0 = sl.sd[64 * c + 16 * warp + (lane >> 2)], d1 = sl.sd[64 * c + 16 * warp + (lane >> 2) + 8];
#pragma unroll
      for (int i = 0; i < 32; ++i) y[i] = fmaf((i & 2) ? d1 : d0, acc[i] + acc[32 + i], y[i]);
    }
  }
  // y[4 n + e]: weight row 16 warp + lane / 4 + 8 (e / 2) of the consumer's 64, activation row 8 n + 2 (lane % 4) + e % 2
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = tl.r0 + 64 * c + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
    const int tt = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    if (r < a.rows_g && tt < tl.an) a.y[(tl.a0 + tt) * a.rows_g + r] = y[i] * a.s[tl.a0 + tt];
  }
}

// $DS4_GPU_MMW_PIPE: 1 the warp-specialized form, 0 (default) the lock-step one; mmw_experts' pipe argument overrides.
bool mmw_pipe_default() {
  static const bool v = [] {
    const char* e = getenv("DS4_GPU_MMW_PIPE");
    return e && *e && atoi(e) != 0;
  }();
  return v;
}

}  // namespace

int mmw_tile_rows() { return MW_N; }

bool mmw_takes(const Packed& w, int n_expert) {
  return w.qtype == QT_IQ2_XXS && n_expert >= 1 && w.nrows % n_expert == 0 && w.ncols % 256 == 0;
}

void launch_mmw_experts(const Packed& w, int n_expert, const MmfActivations& x, const int4* tiles, int ntiles,
                        float* y, cudaStream_t stream, int pipe) {
  if (!mmw_takes(w, n_expert)) throw std::invalid_argument("mmw_experts: IQ2_XXS experts only");
  if (ntiles <= 0) return;
  if (ntiles > 65535) throw std::invalid_argument("mmw_experts: more than 65535 activation tiles");
  const MfArgs a = mf_args(w, n_expert, x, tiles, y);
  if (pipe < 0 ? mmw_pipe_default() : pipe != 0) {
    const size_t shm = MP_S * (sizeof(MpSlot) + 2 * sizeof(uint64_t)) + 256 * sizeof(unsigned long long);
    static bool pipe_shm_set = false;
    if (!pipe_shm_set) {
      DS4_CHECK(cudaFuncSetAttribute(mmw_pipe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
      pipe_shm_set = true;
    }
    mmw_pipe_kernel<<<dim3((a.rows_g + MW_M - 1) / MW_M, ntiles, 1), MP_THREADS, shm, stream>>>(a);
    DS4_CHECK_LAUNCH("mmw (pipelined)");
    return;
  }
  const size_t shm = 2 * sizeof(MwStage) + 2 * MW_M * sizeof(float) + 256 * sizeof(unsigned long long);
  static bool shm_set = false;
  if (!shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(mmw_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = true;
  }
  mmw_kernel<<<dim3((a.rows_g + MW_M - 1) / MW_M, ntiles, 1), MW_THREADS, shm, stream>>>(a);
  DS4_CHECK_LAUNCH("mmw");
}

}  // namespace ds4gpu
