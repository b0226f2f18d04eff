// The decode MoE router in one launch: the F16 router matvec (logits = W . x, 256 experts x 4096 columns on
// Flash) and the routing (router.cuh) that used to be a second, one-CTA launch.
//
// Why: each small decode launch costs ~2-4 us of ramp and tail (v6/v7 notes); the router is two per layer.
// How: the grid is the streaming F16 matvec's (mv_stream.cuh: the same plan, the same building blocks in the
// same order as matvec_stream_kernel), so every logit is summed by one warp in the same order and the logits
// are bitwise those of ext.matvec. Each CTA then fences its logits and takes a ticket (one atomicAdd); the
// last CTA to arrive reads all logits back from L2 and runs route_token, then returns the ticket count to 0
// for the next launch (graph replays). No CTA ever waits for another, so the grid need not be co-resident.
#include <math.h>

#include <algorithm>
#include <cstdlib>
#include <map>

#include "mv_stream.cuh"
#include "router.cuh"

namespace ds4gpu {

namespace {

// CTAs of the current router_one launch that have finished their logits (one decode stream per device).
__device__ unsigned int g_router_ticket = 0;

struct RouteArgs {
  const float* bias;
  const int64_t* table;
  const int64_t* tok;
  int E, k;
  float scale;
  int32_t* ids;
  float* wts;
};

// 1-D grid of the streaming plan's CTAs (4 or 8 warps, one row per tile); dynamic shared memory: the staged x.
template <int C>
__global__ void __launch_bounds__(MV_MAX_THREADS, 2) router_one_kernel(MvArgs a, RouteArgs r) {
  extern __shared__ __align__(16) unsigned char mv_smem[];
  __shared__ int s_last;
  MvStep<QT_F16, 1, C> A;
  mv_first_load<QT_F16, 1, C>(a, 0, blockIdx.x, A);  // weights: independent of earlier kernels
  pdl_trigger();
  pdl_wait();  // x (and the logits', ids' and weights' readers) are from earlier kernels
  mv_stage_x<QT_F16>(a, 0, mv_smem);
  __syncthreads();
  mv_loop<QT_F16, 1, C>(a, 0, blockIdx.x, gridDim.x, mv_smem, A);
  __threadfence();  // this thread's logits, device-wide, before the CTA's ticket
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&g_router_ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // every other CTA's logits are visible from here on (read through L2)
  route_token<true>(a.seg[0].y, r.bias, r.table, r.tok, 0, r.E, r.k, r.scale, r.ids, r.wts);
  if (threadIdx.x == 0) g_router_ticket = 0;  // all others have arrived: ready for the next launch
}

template <int C>
void launch_c(const MvArgs& a, const RouteArgs& r, int threads, size_t smem, cudaStream_t stream) {
  auto kernel = router_one_kernel<C>;
  static std::map<std::pair<int, size_t>, int> resident;  // CTAs per SM for (threads, smem)
  const auto key = std::make_pair(threads, smem);
  auto it = resident.find(key);
  if (it == resident.end()) {
    if (smem > 48 * 1024)
      DS4_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int n = 0;
    DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    it = resident.emplace(key, std::max(1, n)).first;
  }
  // the streaming kernel's grid (matvec_stream.cu launch_rc, one group): the numerics do not depend on it
  const int W = threads / 32;
  const int per_sm = mv_ctas_per_sm() > 0 ? std::min(mv_ctas_per_sm(), it->second) : it->second;
  const int64_t ctas = std::max<int64_t>(1, (int64_t)per_sm * sm_count());
  const unsigned gx = (unsigned)std::min<int64_t>((a.tiles + W - 1) / W, ctas);
  launch_k(kernel, dim3(gx), dim3((unsigned)threads), smem, stream, a, r);
}

// $DS4_GPU_MV as matvec.cu reads it: below 4, ext.matvec's F16 products run the general kernel (other sums),
// so this launch, which must give that path's bits, declines.
int mv_variant_here() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_MV");
    return e ? atoi(e) : 4;
  }();
  return v;
}

}  // namespace

bool launch_router_one(const Packed& w, const float* x, float* logits, const float* bias, const int64_t* table,
                       const int64_t* tok, int k, float scale, int32_t* ids, float* wts, cudaStream_t stream) {
  if (mv_variant_here() < 4 || w.qtype != QT_F16 || w.nrows > ROUTER_MAX_E || k < 1 || k > ROUTER_MAX_K ||
      k > w.nrows || (table && !tok))
    return false;
  const Packed* ws[1] = {&w};
  float* ys[1] = {logits};
  MvArgs a;
  int64_t rows = 0;
  if (!mv_args(ws, ys, 1, x, nullptr, 1, MV_X_PLAIN, 0.0f, a, rows)) return false;
  const MvPlan p = mv_plan<QT_F16>(a, 1, rows);
  if (p.R != 1) return false;  // <= 256 rows: R = 1 on any GPU of 16+ SMs
  const RouteArgs r{bias, table, tok, (int)w.nrows, k, scale, ids, wts};
  if (p.C == 2) launch_c<2>(a, r, p.threads, p.smem, stream);
  else if (p.C == 4) launch_c<4>(a, r, p.threads, p.smem, stream);
  else launch_c<8>(a, r, p.threads, p.smem, stream);
  DS4_CHECK_LAUNCH("router one");
  return true;
}

}  // namespace ds4gpu
