// Batch-1 Q8_0 matvec that streams its weights with bulk (TMA) copies into shared memory ($DS4_GPU_MV_TMA; v17: the
// default for launches of at most 7 MB of weights).
//
// Why: ncu of the register-streaming kernel (matvec_stream.cu) on Flash's 35.6 MB matrices, launched alone: o_b
// 18.1 us at 42% of DRAM bandwidth, q_b 13.5 us at 56%, o_a 15.4 us at 50%, long-scoreboard the top stall. Each warp
// holds one step (4 KB) in registers and does only ~4 steps per call, so the loads in flight are few and the first
// round trip is not hidden; the next kernel under PDL can only load one step before griddepcontrol.wait.
// Here each warp owns NS slots of shared memory and keeps them all in flight with one bulk copy per slot (its rows'
// codes, then their scales, both contiguous in the device layout): ~200 KB per SM at once, issued before
// griddepcontrol.wait, so a matvec after a latency-bound kernel finds up to ~26 MB of its weights already arriving.
//
// Arithmetic: the bits of matvec_stream_kernel. A row is one warp's: lane l reads bytes 16 l .. 16 l + 15 of each
// 512-column chunk (as that kernel's lane does), the even lanes accumulate one fmaf per 32-column block in chunk
// order, and the same xor butterfly sums the lanes; x is staged by the same mv_stage_x. So DS4_GPU_MV_TMA switches
// kernels without changing a bit (tests/test_gpu_matvec_tma.py).
//
// Measured (v17, H200, kernel bench, launched alone; streaming kernel -> this one with 16 warps): q_a 6.7 -> 3.6 us,
// kv 6.3 -> 3.6, shared gate/up 5.8 -> 5.4, shared down 4.9 -> 4.5, o_b 14.2 -> 14.1, but q_b 9.8 -> 10.4 and o_a
// 11.6 -> 12.5; in the decode graph only the small launches gain, hence mode 2.
//
// Shape: one CTA of 16 warps per SM (per group: grid.y = groups). Row groups of RW rows (RW a power of two up to 8,
// RW * K <= 4096 by default) are dealt to the warps round-robin; a row longer than that (o_b's 8192 columns) is cut
// into slabs that its warp streams one after another, accumulating in chunk order. A slot is refilled as soon as its
// warp has consumed it.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <type_traits>

#include "grid_barrier.cuh"
#include "mbarrier.cuh"
#include "mv_stream.cuh"

namespace ds4gpu {

constexpr int MT_MAX_WARPS = 16;  // warps per CTA: $DS4_GPU_MV_TMA_WARPS (default 16)
constexpr int MT_MAX_SLOTS = 8;
constexpr size_t MT_SMEM_MAX = 227 * 1024;

struct MtArgs {
  MvArgs a;       // segments, x and its staging (kpad = ncols), tiles = row groups per group, seg[i].tile0 = first
  int rw;         // rows per row group
  int nslab;      // slabs per row group (rw == 1 when > 1): column ranges of slab_cols, consumed in order
  int slab_cols;  // ncols / nslab, a multiple of 512
  int ns;         // slots per warp
  int slot;       // bytes per slot: rw * slab_cols codes + rw * slab_cols / 16 scale bytes, a multiple of 128
  int xbytes;     // bytes of the staged x (a multiple of 128)
};

// The rows of row group rg (of group g's segments): segment view, first row in the segment and row count.
struct MtItem {
  SegView sv;
  int r0, nr;
};
__device__ __forceinline__ MtItem mt_item(const MtArgs& m, int rg) {
  MtItem o;
  o.sv = seg_of(m.a, rg);
  o.r0 = o.sv.t * m.rw;
  o.nr = min(m.rw, o.sv.rows - o.r0);
  return o;
}

// A warp's work is a sequence of (row group, slab) items: row groups first, first + NW, ..., each slab 0 .. nslab - 1
// in order. Stepped incrementally: a division per item would cost as much as a chunk's products.
struct MtCursor {
  int rg, j;
  __device__ __forceinline__ void next(int nslab, int NW) {
    if (++j == nslab) j = 0, rg += NW;
  }
};

// Lane 0: the bulk copies of slab j of row group rg (group g) into slot (codes at 0, scales after rw slabs of codes),
// counted on bar. Rows of a group are contiguous in both planes, and so is one row's slab (rw == 1 when nslab > 1).
__device__ __forceinline__ void mt_issue(const MtArgs& m, int g, int rg, int j, unsigned char* slot, uint64_t* bar) {
  const MtItem t = mt_item(m, rg);
  const uint32_t qb = (uint32_t)(t.nr * m.slab_cols), sb = (uint32_t)(t.nr * (m.slab_cols / 16));
  mbar_arrive_expect_tx(bar, qb + sb);
  const uint8_t* qs = t.sv.qs + g * m.a.gq + t.r0 * m.a.qs_row + (int64_t)j * m.slab_cols;
  const uint8_t* sc = t.sv.sc + g * m.a.gs + t.r0 * m.a.sc_row + (int64_t)j * (m.slab_cols / 16);
  if constexpr (kStreamEvictFirst) {
    bulk_copy_g2s_hint(slot, qs, qb, bar, l2_evict_first_policy());
    bulk_copy_g2s_hint(slot + m.rw * m.slab_cols, sc, sb, bar, l2_evict_first_policy());
  } else {
    bulk_copy_g2s(slot, qs, qb, bar);
    bulk_copy_g2s(slot + m.rw * m.slab_cols, sc, sb, bar);
  }
}

// acc[r] += this slab's part of row r: mv_consume's operations per 512-column chunk, in chunk order (x read once per
// chunk for all RW rows, whose chains run side by side).
template <int RW>
__device__ __forceinline__ void mt_consume(const MtArgs& m, int j, const unsigned char* slot, const unsigned char* sx,
                                           int lane, float (&acc)[RW]) {
  const int nchunks = m.slab_cols / MV_CHUNK_BYTES, c0 = j * nchunks;
  const int4* s_hi = (const int4*)sx;
  const int4* s_lo = (const int4*)(sx + m.a.kpad);
  const float* s_xs = (const float*)(sx + 2 * m.a.kpad);
  const unsigned char* q0 = slot + 16 * lane;
  const unsigned short* sc0 = (const unsigned short*)(slot + RW * m.slab_cols) + (lane >> 1);
  const int sc_row = m.slab_cols / 32;  // scales per row of the slot
#pragma unroll 2
  for (int c = 0; c < nchunks; ++c) {
    const int i16 = (c0 + c) * 32 + lane;
    const int4 xh = s_hi[i16], xl = s_lo[i16];
    const float xs = s_xs[i16 >> 1];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const uint4 q = *(const uint4*)(q0 + r * m.slab_cols + c * MV_CHUNK_BYTES);
      const uint32_t s = sc0[r * sc_row + 16 * c];
      const int v = q8_block_sum(q, xh, xl);
      if (!(lane & 1)) acc[r] = fmaf(half_bits(s) * xs, (float)v, acc[r]);
    }
  }
}

// mv_finish's butterfly and store for row group rg (kept apart from it: this form is the one measured on the H200); rows past its end (a partial last group) were computed from
// whatever the slot held and are not written.
template <int RW>
__device__ __forceinline__ void mt_finish(const MtArgs& m, int g, int rg, int lane, float (&acc)[RW]) {
  const MtItem t = mt_item(m, rg);
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);  // odd lanes hold 0
    if (lane == 2 * r && r < t.nr) t.sv.y[(int64_t)g * t.sv.rows + t.r0 + r] = acc[r];
    acc[r] = 0.0f;
  }
}

template <int RW>
__global__ void __launch_bounds__(32 * MT_MAX_WARPS, 1) matvec_tma_kernel(MtArgs m) {
  extern __shared__ __align__(128) unsigned char mt_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = blockIdx.y, W = blockDim.x >> 5;
  unsigned char* sx = mt_smem;
  uint64_t* bars = (uint64_t*)(mt_smem + m.xbytes) + warp * MT_MAX_SLOTS;
  unsigned char* slots = mt_smem + m.xbytes + MT_MAX_WARPS * MT_MAX_SLOTS * sizeof(uint64_t) + (size_t)warp * m.ns * m.slot;
  const int NW = (int)gridDim.x * W;
  MtCursor fill{(int)blockIdx.x * W + warp, 0};  // the next item to copy (uniform over the warp)
  if (lane == 0) {
    for (int s = 0; s < m.ns; ++s) mbar_init(&bars[s], 1);
    mbar_init_fence();
  }
  // the weights never depend on earlier kernels: every slot's copy goes out before griddepcontrol.wait
  for (int s = 0; s < m.ns && fill.rg < m.a.tiles; ++s, fill.next(m.nslab, NW))
    if (lane == 0) mt_issue(m, g, fill.rg, fill.j, slots + (size_t)s * m.slot, &bars[s]);
  pdl_trigger();
  pdl_wait();  // x (and y's readers) are from earlier kernels
  mv_stage_x<QT_Q8_0>(m.a, g, sx);
  __syncthreads();
  float acc[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) acc[r] = 0.0f;
  int s = 0, phase = 0;
  for (MtCursor cur{(int)blockIdx.x * W + warp, 0}; cur.rg < m.a.tiles; cur.next(m.nslab, NW)) {
    unsigned char* slot = slots + (size_t)s * m.slot;
    mbar_wait(&bars[s], phase);
    mt_consume<RW>(m, cur.j, slot, sx, lane, acc);
    __syncwarp();
    if (fill.rg < m.a.tiles) {
      if (lane == 0) {
        fence_async_smem();  // the warp's reads of this slot before the copy that refills it
        mt_issue(m, g, fill.rg, fill.j, slot, &bars[s]);
      }
      fill.next(m.nslab, NW);
    }
    if (cur.j == m.nslab - 1) mt_finish<RW>(m, g, cur.rg, lane, acc);
    if (++s == m.ns) s = 0, phase ^= 1;
  }
}

static int mt_rows_env() {  // $DS4_GPU_MV_TMA_BYTES: target code bytes per item (default 4096)
  static const int v = [] {
    const char* e = getenv("DS4_GPU_MV_TMA_BYTES");
    const int b = e ? atoi(e) : 4096;
    return b >= 512 ? b : 4096;
  }();
  return v;
}

static int mt_warps_env() {  // $DS4_GPU_MV_TMA_WARPS: warps per CTA, 4 .. 16 (default 16; v17: 8 slower everywhere)
  static const int v = [] {
    const char* e = getenv("DS4_GPU_MV_TMA_WARPS");
    const int w = e ? atoi(e) : 16;
    return std::min(MT_MAX_WARPS, std::max(4, w));
  }();
  return v;
}

// $DS4_GPU_MV_TMA_KB: shared memory per CTA in KB (default all 227). Less leaves room beside it for the kernels of
// another stream (decode's side branches) at the price of fewer slots in flight.
static size_t mt_smem_env() {
  static const size_t v = [] {
    const char* e = getenv("DS4_GPU_MV_TMA_KB");
    const long kb = e ? atol(e) : 227;
    return (size_t)std::min<long>(227, std::max<long>(16, kb)) * 1024;
  }();
  return v;
}

static int64_t& mv_tma_count() {  // launches made (tests: the kernel did take the shapes they hand it)
  static int64_t n = 0;
  return n;
}
int64_t mv_tma_launches() { return mv_tma_count(); }

static int& mv_tma_override() {  // set_mv_tma: 0, 1, 2 as $DS4_GPU_MV_TMA; -1 the environment
  static int v = -1;
  return v;
}
void set_mv_tma(int mode) { mv_tma_override() = mode >= 0 && mode <= 3 ? mode : -1; }

// $DS4_GPU_MV_TMA (read once): 2 (default) only launches of at most $DS4_GPU_MV_TMA_MAX_MB of weights (7 MB: q_a +
// kv; v17 decode at 2k 7.43 against 7.51 ms); 1 every Q8_0 launch the kernel takes (v17: 7.58 ms before the row
// slabs and the cursor); 3 every launch but the two shapes where the v17 kernel bench has it slower: rows of at most
// 1024 columns above the size limit (q_b) and grouped matrices (o_a) (prepared, not measured in a session); 0: none.
int mv_tma_mode() {
  static const int env = [] {
    const char* e = getenv("DS4_GPU_MV_TMA");
    return e && e[0] >= '0' && e[0] <= '3' ? e[0] - '0' : 2;
  }();
  return mv_tma_override() >= 0 ? mv_tma_override() : env;
}

// $DS4_GPU_MV_TMA_MIN_K: mode 2 also takes launches of at least this many columns (0, the default: none), whose rows
// are cut into slabs (o_b's 8192).
static int mt_min_k() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_MV_TMA_MIN_K");
    return e ? atoi(e) : 0;
  }();
  return v;
}

static double mt_max_bytes() {
  static const double v = [] {
    const char* e = getenv("DS4_GPU_MV_TMA_MAX_MB");
    return (e ? atof(e) : 7.0) * 1e6;
  }();
  return v;
}

// The items of a (rw rows, or slabs of one row) and the byte sizes of a slot and of the staged x; m.a = a with its
// tiles (items of one group), kpad and nsteps filled in. ns is left to the caller (it depends on the budget).
static void mt_shape(MvArgs a, MtArgs& m) {
  // rows of RW (a power of two up to 8) while RW * K fits the target; rows longer than it are cut into slabs
  m.rw = 1;
  while (m.rw < 8 && (m.rw * 2) * a.ncols <= mt_rows_env()) m.rw *= 2;
  m.nslab = 1;
  while (a.ncols / m.nslab > mt_rows_env() && (a.ncols / (2 * m.nslab)) % MV_CHUNK_BYTES == 0) m.nslab *= 2;
  m.slab_cols = a.ncols / m.nslab;
  int items = 0;
  for (int i = 0; i < a.nseg; ++i) {
    a.seg[i].tile0 = items;
    items += (a.seg[i].rows + m.rw - 1) / m.rw;
  }
  a.tiles = items;
  a.kpad = a.ncols;
  a.nsteps = 1;
  m.xbytes = (int)(((2 * (size_t)a.kpad + (size_t)a.kpad / 32 * 4) + 127) / 128 * 128);
  m.slot = (int)((m.rw * (m.slab_cols + m.slab_cols / 16) + 127) / 128 * 128);
  m.ns = 0;
  m.a = a;
}

// a from mv_args (Q8_0 only); false (nothing launched) where the kernel does not take the shape.
bool launch_matvec_tma(MvArgs a, int groups, bool pdl, cudaStream_t stream) {
  if (!a.ncols || a.ncols % MV_CHUNK_BYTES || a.qs_row != a.ncols || a.sc_row != a.ncols / 16) return false;
  const int mode = mv_tma_mode();
  double bytes = 0;
  for (int i = 0; i < a.nseg; ++i) bytes += (double)a.seg[i].rows * groups * (a.qs_row + a.sc_row);
  if (mode == 2 && !(mt_min_k() > 0 && a.ncols >= mt_min_k()) && bytes > mt_max_bytes()) return false;
  if (mode == 3 && (groups > 1 || (a.ncols <= 1024 && bytes > mt_max_bytes()))) return false;
  MtArgs m;
  mt_shape(a, m);
  const int W = mt_warps_env();
  const size_t fixed = m.xbytes + MT_MAX_WARPS * MT_MAX_SLOTS * sizeof(uint64_t);
  const size_t budget = mt_smem_env();
  if (budget < fixed + (size_t)W * m.slot) return false;
  m.ns = (int)std::min<size_t>(MT_MAX_SLOTS, (budget - fixed) / ((size_t)W * m.slot));
  const int items = m.a.tiles;
  const size_t smem = fixed + (size_t)W * m.ns * m.slot;
  static bool smem_set[4] = {false, false, false, false};
  const int per_group = std::max(1, sm_count() / groups);
  const int gx = std::min(per_group, (items + W - 1) / W);
  const dim3 grid((unsigned)gx, (unsigned)groups), block((unsigned)(32 * W));
  auto go = [&](auto kernel, int slot) {
    if (!smem_set[slot]) {
      DS4_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)MT_SMEM_MAX));
      smem_set[slot] = true;
    }
    launch_pdl(pdl, kernel, grid, block, smem, stream, m);
  };
  if (m.rw == 1) go(matvec_tma_kernel<1>, 0);
  else if (m.rw == 2) go(matvec_tma_kernel<2>, 1);
  else if (m.rw == 4) go(matvec_tma_kernel<4>, 2);
  else go(matvec_tma_kernel<8>, 3);
  DS4_CHECK_LAUNCH("matvec_tma");
  ++mv_tma_count();
  return true;
}

// ---- two dependent matvecs in one launch (DS4_GPU_MV_CHAIN=2) ----------------------------------------------------
// Phase A (segments, or a grouped matrix: o_a), a grid barrier, phase B on A's output (o_b; the shared expert's down
// with SwiGLU staging). Why: matvec_chain.cu's register form issues only B's first step (one 4 KB load per warp)
// before its barrier and ran slower in the session (v12: 8.18 against 7.72 ms). Here each warp's slot ring runs on
// through the phase boundary: as A's items run out, its freed slots take B's first items, so up to ~26 MB of B's
// weights (every slot of every warp) are already arriving while A's tail, the barrier and B's x staging run.
// The same bits as two launches of matvec_tma_kernel (so as the streaming kernel): per row the same lanes and order,
// x staged by mv_stage_x (B's through L2: A's output was written by other CTAs of this grid).
// One CTA per SM, all resident (the barrier needs them; the launcher checks the occupancy). Phase A's group of a CTA is
// blockIdx.x % groups_a; every phase-B item is dealt over the whole grid.

// One barrier at a time per device (the decode stream); the count returns to 0 after each use.
__device__ unsigned int g_tchain_count = 0;
__device__ unsigned int g_tchain_gen = 0;

// A phase as this CTA sees it: its group, the first item of its warp 0 and the stride between a warp's items.
struct MtPhase {
  int g, first, NW;
};
__device__ __forceinline__ MtPhase mt_phase(int groups, int W) {
  const int g = (int)blockIdx.x % groups;
  const int nctas = ((int)gridDim.x - g + groups - 1) / groups;  // CTAs of group g
  return MtPhase{g, (int)blockIdx.x / groups * W, nctas * W};
}

// The copy side of a warp's slot ring over A's items, then B's (uniform over the warp; lane 0 issues).
struct MtChainFill {
  MtCursor cur;
  bool in_b;
  __device__ __forceinline__ void start_b(const MtPhase& pb, int warp) {
    in_b = true;
    cur = MtCursor{pb.first + warp, 0};
  }
  __device__ __forceinline__ bool pending(const MtArgs& B) const { return !in_b || cur.rg < B.a.tiles; }
  __device__ __forceinline__ void issue(const MtArgs& A, const MtArgs& B, const MtPhase& pa, int lane,
                                        unsigned char* slot, uint64_t* bar) const {
    if (lane == 0) {
      if (in_b) mt_issue(B, 0, cur.rg, cur.j, slot, bar);
      else mt_issue(A, pa.g, cur.rg, cur.j, slot, bar);
    }
  }
  __device__ __forceinline__ void advance(const MtArgs& A, const MtArgs& B, const MtPhase& pa, const MtPhase& pb,
                                          int warp) {
    if (in_b) {
      cur.next(B.nslab, pb.NW);
    } else {
      cur.next(A.nslab, pa.NW);
      if (cur.rg >= A.a.tiles) start_b(pb, warp);
    }
  }
};

// The consume loop of one phase (matvec_tma_kernel's), refilling each slot from the ring's next item.
template <int R>
__device__ __forceinline__ void mt_chain_run(const MtArgs& m, const MtArgs& A, const MtArgs& B, const MtPhase& pa,
                                             const MtPhase& pb, const MtPhase& self, int warp, int lane,
                                             const unsigned char* sx, unsigned char* slots, uint64_t* bars,
                                             MtChainFill& fill, int& s, int& phase) {
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (MtCursor cur{self.first + warp, 0}; cur.rg < m.a.tiles; cur.next(m.nslab, self.NW)) {
    unsigned char* slot = slots + (size_t)s * m.slot;
    mbar_wait(&bars[s], phase);
    mt_consume<R>(m, cur.j, slot, sx, lane, acc);
    __syncwarp();
    if (fill.pending(B)) {
      if (lane == 0) fence_async_smem();  // the warp's reads of this slot before the copy that refills it
      fill.issue(A, B, pa, lane, slot, &bars[s]);
      fill.advance(A, B, pa, pb, warp);
    }
    if (cur.j == m.nslab - 1) mt_finish<R>(m, self.g, cur.rg, lane, acc);
    if (++s == m.ns) s = 0, phase ^= 1;
  }
}

template <int RA, int RB>
__global__ void __launch_bounds__(32 * MT_MAX_WARPS, 1) matvec_tma_chain_kernel(MtArgs A, int groups_a, MtArgs B) {
  extern __shared__ __align__(128) unsigned char mt_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
  unsigned char* sx = mt_smem;  // A.xbytes == B.xbytes, A.slot == B.slot, A.ns == B.ns (the launcher's)
  uint64_t* bars = (uint64_t*)(mt_smem + A.xbytes) + warp * MT_MAX_SLOTS;
  unsigned char* slots = mt_smem + A.xbytes + MT_MAX_WARPS * MT_MAX_SLOTS * sizeof(uint64_t) + (size_t)warp * A.ns * A.slot;
  const MtPhase pa = mt_phase(groups_a, W), pb = mt_phase(1, W);
  MtChainFill fill{MtCursor{pa.first + warp, 0}, false};
  if (fill.cur.rg >= A.a.tiles) fill.start_b(pb, warp);
  if (lane == 0) {
    for (int i = 0; i < A.ns; ++i) mbar_init(&bars[i], 1);
    mbar_init_fence();
  }
  for (int i = 0; i < A.ns && fill.pending(B); ++i) {  // weights never depend on earlier kernels
    fill.issue(A, B, pa, lane, slots + (size_t)i * A.slot, &bars[i]);
    fill.advance(A, B, pa, pb, warp);
  }
  pdl_trigger();
  pdl_wait();  // A's x (and the outputs' readers) are from earlier kernels
  mv_stage_x<QT_Q8_0>(A.a, pa.g, sx);
  __syncthreads();
  int s = 0, phase = 0;
  mt_chain_run<RA>(A, A, B, pa, pb, pa, warp, lane, sx, slots, bars, fill, s, phase);
  // every CTA's A rows are written, and every warp of this CTA is done with A's x
  grid_barrier_acq_rel(&g_tchain_count, &g_tchain_gen, gridDim.x);
  mv_stage_x<QT_Q8_0, true>(B.a, 0, sx);
  __syncthreads();
  mt_chain_run<RB>(B, A, B, pa, pb, pb, warp, lane, sx, slots, bars, fill, s, phase);
}

// a, b from mv_args (Q8_0). False (nothing launched) where the kernel does not take the shapes, or where fewer than
// one CTA per SM would be resident.
bool launch_matvec_tma_chain(const MvArgs& a, int groups_a, const MvArgs& b, cudaStream_t stream) {
  for (const MvArgs* p : {&a, &b})
    if (!p->ncols || p->ncols % MV_CHUNK_BYTES || p->qs_row != p->ncols || p->sc_row != p->ncols / 16) return false;
  MtArgs A, B;
  mt_shape(a, A);
  mt_shape(b, B);
  if (A.rw > 4 || B.rw > 4 || groups_a > sm_count()) return false;
  const int W = mt_warps_env();
  const int xbytes = std::max(A.xbytes, B.xbytes), slot = std::max(A.slot, B.slot);
  const size_t fixed = xbytes + MT_MAX_WARPS * MT_MAX_SLOTS * sizeof(uint64_t);
  const size_t budget = mt_smem_env();
  if (budget < fixed + (size_t)W * slot) return false;
  const int ns = (int)std::min<size_t>(MT_MAX_SLOTS, (budget - fixed) / ((size_t)W * slot));
  for (MtArgs* m : {&A, &B}) m->xbytes = xbytes, m->slot = slot, m->ns = ns;
  const size_t smem = fixed + (size_t)W * ns * slot;
  bool ok = false;
  auto go = [&](auto kernel) {
    // CTAs per SM by (kernel, shared-memory size); threads: W is fixed per process. Every instantiation shares this
    // lambda's one body, so the kernel is part of the key (each needs its own shared-memory attribute).
    static std::map<std::pair<const void*, size_t>, int> resident;
    const auto key = std::make_pair((const void*)kernel, smem);
    auto it = resident.find(key);
    if (it == resident.end()) {
      DS4_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)MT_SMEM_MAX));
      int n = 0;
      DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, 32 * W, smem));
      it = resident.emplace(key, n).first;
    }
    if (it->second < 1) return;
    launch_k(kernel, dim3((unsigned)sm_count()), dim3((unsigned)(32 * W)), smem, stream, A, groups_a, B);
    ok = true;
  };
  auto by_rb = [&](auto ra) {
    constexpr int RA = decltype(ra)::value;
    if (B.rw == 1) go(matvec_tma_chain_kernel<RA, 1>);
    else if (B.rw == 2) go(matvec_tma_chain_kernel<RA, 2>);
    else go(matvec_tma_chain_kernel<RA, 4>);
  };
  if (A.rw == 1) by_rb(std::integral_constant<int, 1>{});
  else if (A.rw == 2) by_rb(std::integral_constant<int, 2>{});
  else by_rb(std::integral_constant<int, 4>{});
  if (!ok) return false;
  DS4_CHECK_LAUNCH("matvec_tma chain");
  ++mv_tma_count();
  return true;
}

}  // namespace ds4gpu
