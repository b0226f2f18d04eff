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

#include <cooperative_groups.h>

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

// The router in one thread block cluster ($DS4_GPU_ROUTER_CLUSTER=1, the default since v23, under DS4_GPU_ROUTER_ONE=1):
// RC_CTAS CTAs of 16 warps; warp w of CTA c computes logit c * ceil(E / 16) + w with the streaming F16 kernel's
// arithmetic (lane l: columns 256 j + 8 l .. + 7 of chunk j, an 8-term product chain per chunk added to the lane's
// sum in chunk order, then the xor butterfly: the bits of ext.matvec), its weights loaded before griddepcontrol.wait.
// The logits go into CTA 0's shared memory (map_shared_rank), one cluster barrier, and CTA 0 routes them
// (route_token). Why: router_one_kernel's arrival count (fence, atomic, the last CTA's L2 reads) lost to the two
// launches (v8, v18); the mHC pre's cluster kernel (v22) beat its arrival-count form by 1.6 us per call.
constexpr int RC_CTAS = 16, RC_WARPS = 16, RC_MAX_CHUNKS = 16;  // E <= 256, K <= 4096 (a multiple of 256)

__global__ void __cluster_dims__(RC_CTAS, 1, 1) __launch_bounds__(RC_WARPS * 32, 1)
    router_cluster_kernel(const uint8_t* qs, int64_t qs_row, int K, const float* x, float* logits, RouteArgs r,
                          bool pre) {
  namespace cg = cooperative_groups;
  __shared__ __align__(16) float s_x[RC_MAX_CHUNKS * 256];
  __shared__ float s_logits[ROUTER_MAX_E];  // CTA 0's: every CTA writes its logits here
  __shared__ float s_bias[ROUTER_MAX_E];    // pre: CTA 0's copy of the bias (a weight), read after the barrier
  cg::cluster_group cluster = cg::this_cluster();
  const int c = (int)cluster.block_rank(), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows_per_cta = (r.E + RC_CTAS - 1) / RC_CTAS, row = c * rows_per_cta + warp;
  const bool mine = warp < rows_per_cta && row < r.E;
  const int nch = K / 256;
  uint4 q[RC_MAX_CHUNKS];
  const uint8_t* qrow = qs + (int64_t)(mine ? row : 0) * qs_row;
#pragma unroll
  for (int j = 0; j < RC_MAX_CHUNKS; ++j)
    q[j] = mine && j < nch ? ld_stream16(qrow + 2 * (256 * j + 8 * lane)) : make_uint4(0, 0, 0, 0);
  pdl_trigger();
  // pre ($DS4_GPU_PREWAIT=2): the routing's bias loads leave the chain after the cluster barrier (the same values)
  const bool staged = pre && c == 0 && r.bias;
  if (staged)
    for (int e = threadIdx.x; e < r.E; e += blockDim.x) s_bias[e] = r.bias[e];
  pdl_wait();  // x, and the readers of logits, ids and wts, are earlier kernels
  for (int i = threadIdx.x; i < K / 4; i += blockDim.x) ((float4*)s_x)[i] = __ldg((const float4*)x + i);
  __syncthreads();
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < RC_MAX_CHUNKS; ++j) {
    if (j < nch) {
      const float4 x0 = *(const float4*)(s_x + 256 * j + 8 * lane), x1 = *(const float4*)(s_x + 256 * j + 8 * lane + 4);
      acc += f16_chunk_dot(q[j], x0, x1);  // mv_consume's F16 chain
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);  // mv_finish's order
  if (mine && lane == 0) {
    logits[row] = acc;
    cluster.map_shared_rank(s_logits, 0)[row] = acc;
  }
  cluster.sync();  // every logit is in CTA 0's shared memory
  if (c == 0) route_token<false>(s_logits, staged ? s_bias : r.bias, r.table, r.tok, 0, r.E, r.k, r.scale, r.ids, r.wts);
}

// $DS4_GPU_ROUTER_CLUSTER (default 1 since v23: decode 6.12 -> 6.02 ms at 2k; 0: router_one_kernel, the arrival-count
// form, which lost to two launches; set_router_cluster overrides it: 0, 1, -1 the environment). Taken where the device
// can place a cluster of 16 (non-portable) and E <= 256, K a multiple of 256 of at most 4096; where it cannot,
// launch_router_one declines and the caller runs the two launches.
int& router_cluster_override() {
  static int v = -1;
  return v;
}
bool router_cluster_on() {
  static const bool env = [] {
    const char* e = getenv("DS4_GPU_ROUTER_CLUSTER");
    return !(e && e[0] == '0');
  }();
  return router_cluster_override() >= 0 ? router_cluster_override() == 1 : env;
}
bool router_cluster_available() {
  static const bool ok = cluster_fits(router_cluster_kernel, RC_CTAS, RC_WARPS * 32);
  return ok;
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

void set_router_cluster(int mode) { router_cluster_override() = mode == 0 || mode == 1 ? mode : -1; }
bool router_cluster_takes(int E, int K) {
  return router_cluster_on() && K % 256 == 0 && K <= 256 * RC_MAX_CHUNKS && E <= RC_CTAS * RC_WARPS &&
         router_cluster_available();
}

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
  if (router_cluster_on()) {
    if (!router_cluster_takes((int)w.nrows, (int)w.ncols)) return false;  // two launches beat the arrival count
    launch_k(router_cluster_kernel, dim3(RC_CTAS), dim3(RC_WARPS * 32), 0, stream, w.qs, w.qs_row, (int)w.ncols, x,
             logits, r, prewait_mode() >= 2);
    DS4_CHECK_LAUNCH("router cluster");
    return true;
  }
  if (p.C == 2) launch_c<2>(a, r, p.threads, p.smem, stream);
  else if (p.C == 4) launch_c<4>(a, r, p.threads, p.smem, stream);
  else launch_c<8>(a, r, p.threads, p.smem, stream);
  DS4_CHECK_LAUNCH("router one");
  return true;
}

}  // namespace ds4gpu
