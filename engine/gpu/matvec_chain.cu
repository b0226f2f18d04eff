// Two dependent batch-1 matvecs in one launch: phase A (the streaming kernel's work, e.g. o_a over its 8
// groups, or the shared expert's gate + up), a grid-wide barrier, then phase B, whose x is A's output (o_b;
// the shared expert's down with SwiGLU applied while staging).
//
// Why: a matvec_stream grid holds the whole register file (2 CTAs x 256 threads x up to 127 registers), so
// under programmatic dependent launch the next matvec cannot become resident before this one ends, and every
// launch pays its ramp: CTA launch, the first DRAM round trip, x staging. Here each warp issues phase B's
// first weight loads before it arrives at the barrier (weights never depend on A), so B's first round trip
// overlaps A's tail and the barrier.
//
// The barrier needs every CTA resident at once: the grid is the occupancy of this kernel (never more CTAs
// than fit), and a CTA only waits for CTAs that are already running or will be once earlier kernels end.
// Numerics are the streaming kernel's: each row is summed by one warp in the same order, and B stages x
// with the same arithmetic from L2-coherent loads (A's output was written by this grid), so a chained call
// gives the bits of the two separate launches.
#include <algorithm>
#include <cstdlib>
#include <map>

#include "grid_barrier.cuh"
#include "mv_stream.cuh"

namespace ds4gpu {

// One barrier at a time per device (the decode stream); count returns to 0 after each use.
__device__ unsigned int g_chain_count = 0;
__device__ unsigned int g_chain_gen = 0;

// 1-D grid: CTA c works on group c % groups_a of phase A (as CTA c / groups_a of that group's CTAs), then on
// phase B (one group) as CTA c of all of them. groups_a divides gridDim.x.
template <int QT, int RA, int CA, int RB, int CB>
__global__ void __launch_bounds__(MV_MAX_THREADS, 2) matvec_chain_kernel(MvArgs a, MvArgs b, int groups_a) {
  extern __shared__ __align__(16) unsigned char mv_smem[];
  const int g = blockIdx.x % groups_a, cta = blockIdx.x / groups_a, nctas = gridDim.x / groups_a;
  MvStep<QT, RA, CA> A;
  mv_first_load<QT, RA, CA>(a, g, cta, A);
  pdl_trigger();
  pdl_wait();  // A's x is from earlier kernels
  mv_stage_x<QT>(a, g, mv_smem);
  __syncthreads();
  mv_loop<QT, RA, CA>(a, g, cta, nctas, mv_smem, A);
  MvStep<QT, RB, CB> B;
  mv_first_load<QT, RB, CB>(b, 0, blockIdx.x, B);
  // also: every warp of this CTA is done with A's x in shared memory. v12: the acquire/release form (no fences, no
  // sleep; bench_barrier compares the forms), where v7's 25 us for o_a + o_b used the fenced one.
  grid_barrier_acq_rel(&g_chain_count, &g_chain_gen, gridDim.x);
  mv_stage_x<QT, true>(b, 0, mv_smem);  // A's output: written by this grid
  __syncthreads();
  mv_loop<QT, RB, CB>(b, 0, blockIdx.x, gridDim.x, mv_smem, B);
}

// False (nothing launched) when fewer CTAs than groups_a fit at once: the barrier needs all of them resident.
template <int QT, int RA, int CA, int RB, int CB>
static bool launch_chain_rc(const MvArgs& a, const MvArgs& b, int groups_a, size_t smem, cudaStream_t stream) {
  auto kernel = matvec_chain_kernel<QT, RA, CA, RB, CB>;
  static std::map<size_t, int> resident;  // CTAs per SM for this shared-memory size (Q8_0 x: <= 34 KB)
  auto it = resident.find(smem);
  if (it == resident.end()) {
    if (smem > 48 * 1024)
      DS4_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int n = 0;
    DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, MV_MAX_THREADS, smem));
    it = resident.emplace(smem, n).first;
  }
  const int per_sm = mv_ctas_per_sm() > 0 ? std::min(mv_ctas_per_sm(), it->second) : it->second;
  const int grid = per_sm * sm_count() / groups_a * groups_a;  // every CTA resident; groups_a divides it
  if (grid < groups_a) return false;
  launch_k(kernel, dim3((unsigned)grid), dim3(MV_MAX_THREADS), smem, stream, a, b, groups_a);
  return true;
}

template <int QT, int CA>
static bool launch_chain_cb(int cb, const MvArgs& a, const MvArgs& b, int groups_a, size_t smem, cudaStream_t s) {
  if (cb == 2) return launch_chain_rc<QT, 1, CA, 1, 2>(a, b, groups_a, smem, s);
  if (cb == 4) return launch_chain_rc<QT, 1, CA, 1, 4>(a, b, groups_a, smem, s);
  return launch_chain_rc<QT, 1, CA, 1, 8>(a, b, groups_a, smem, s);
}

template <int QT>
static bool launch_chain_c(int ca, int cb, const MvArgs& a, const MvArgs& b, int groups_a, size_t smem,
                           cudaStream_t s) {
  if (ca == 2) return launch_chain_cb<QT, 2>(cb, a, b, groups_a, smem, s);
  if (ca == 4) return launch_chain_cb<QT, 4>(cb, a, b, groups_a, smem, s);
  return launch_chain_cb<QT, 8>(cb, a, b, groups_a, smem, s);
}

// Byte ranges [p, p + n) and [q, q + m) overlap.
static bool overlaps(const void* p, int64_t n, const void* q, int64_t m) {
  const uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
  return a < b + (uintptr_t)m && b < a + (uintptr_t)n;
}

// $DS4_GPU_MV_CHAIN=2 (read once; set_mv_chain_form overrides it: 1 register form, 2 bulk-copy form first, -1 the
// environment): the bulk-copy chain of matvec_tma.cu where it takes the shapes, else this file's register form.
static int& mv_chain_override() {
  static int v = -1;
  return v;
}
void set_mv_chain_form(int form) { mv_chain_override() = form == 1 || form == 2 ? form : -1; }
static int mv_chain_form() {
  static const int env = [] {
    const char* e = std::getenv("DS4_GPU_MV_CHAIN");
    return e && e[0] == '2' ? 2 : 1;
  }();
  return mv_chain_override() > 0 ? mv_chain_override() : env;
}
bool launch_matvec_tma_chain(const MvArgs& a, int groups_a, const MvArgs& b, cudaStream_t stream);

bool launch_matvec_chain(const Packed* const* wa, float* const* ya, int na, int groups_a, const float* x,
                         const Packed& wb, float* yb, int x_op_b, float clamp, cudaStream_t stream) {
  MvArgs a, b;
  int64_t rows_a = 0, rows_b = 0;
  if (wa[0]->qtype != QT_Q8_0 || wb.qtype != QT_Q8_0) return false;
  if (!mv_args(wa, ya, na, x, nullptr, groups_a, MV_X_PLAIN, 0.0f, a, rows_a)) return false;
  // B's x is A's output as one vector: one segment (o_a's groups are contiguous rows), or [g | u] of two
  // equal segments that follow each other in memory (SwiGLU)
  const int64_t width = x_op_b == MV_X_SWIGLU ? wa[0]->nrows : wa[0]->nrows * (na == 1 ? 1 : 0);
  if (width == 0 || wb.ncols != width) return false;
  if (x_op_b == MV_X_SWIGLU && (na != 2 || wa[1]->nrows != wa[0]->nrows || ya[1] != ya[0] + wa[0]->nrows))
    return false;
  const Packed* wbs[1] = {&wb};
  float* ybs[1] = {yb};
  if (!mv_args(wbs, ybs, 1, ya[0], nullptr, 1, x_op_b, clamp, b, rows_b)) return false;
  // one grid reads what other CTAs write: no output may overlap an input of a later phase
  const int64_t in_a = 4 * wa[0]->ncols * groups_a, out_a = 4 * width * (x_op_b == MV_X_SWIGLU ? 2 : 1);
  if (overlaps(ya[0], out_a, x, in_a) || overlaps(yb, 4 * wb.nrows, ya[0], out_a) || overlaps(yb, 4 * wb.nrows, x, in_a))
    return false;
  if (mv_chain_form() == 2 && launch_matvec_tma_chain(a, groups_a, b, stream)) return true;
  const MvPlan pa = mv_plan<QT_Q8_0>(a, groups_a, rows_a), pb = mv_plan<QT_Q8_0>(b, 1, rows_b);
  const size_t smem = std::max(pa.smem, pb.smem);
  // one row per tile in both phases (the chains' shapes: Flash o_a -> o_b is C 8 -> 8, gate + up -> down
  // 8 -> 4; the small test model's 4 -> 2 and 2 -> 2)
  if (pa.R != 1 || pb.R != 1) return false;
  if (!launch_chain_c<QT_Q8_0>(pa.C, pb.C, a, b, groups_a, smem, stream)) return false;
  DS4_CHECK_LAUNCH("matvec chain");
  return true;
}

}  // namespace ds4gpu
