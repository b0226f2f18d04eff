// Grid-wide barriers (grid_barrier.cuh) inside one resident grid: the brick a persistent decode kernel stands on
// (NOTES.md v8: one resident grid that runs a layer's ops in order, a barrier between dependent ops instead of a
// kernel launch).
// What it costs decides whether that plan can beat ~1 us of launch gap plus ramp per op, so barrier_check runs
// `iters` barriers back to back in one of three forms and checks them:
//   0  the chain kernel's barrier (matvec_chain.cu): fence, atomicAdd, spin on a generation word with __nanosleep
//   1  the same with acquire/release atomics (red.release / ld.acquire) instead of the fences, and no sleep
//   2  cooperative groups' grid.sync() (cooperative launch): the library's barrier, the named peer
// Before barrier i every CTA adds 1 to slot i of a counter array, and its last thread stores i + 1 to its entry of row i
// of a data array with a plain store; after it, thread 0 reads slot i and another thread the next CTA's data entry
// with a plain (L1-cacheable) load, warmed before the barrier: a violation unless all gridDim.x arrivals and the
// neighbour's store are visible. So a barrier that orders atomics but does not publish plain stores to other threads
// fails too. violations[0] must stay 0. The barrier words are global: one barrier kernel at a time per device.
// flag_relay measures the other brick: one CTA handing a result to one other through a flag (store-release, then
// load-acquire spins), the dependency a persistent kernel would use between ops on a few CTAs; cluster_relay the same
// inside one thread block cluster through distributed shared memory.
#include <algorithm>

#include <cooperative_groups.h>

#include "common.cuh"
#include "grid_barrier.cuh"

namespace ds4gpu {

namespace {

__device__ unsigned int g_bar_count = 0;
__device__ unsigned int g_bar_gen = 0;

template <int MODE>
__global__ void barrier_check_kernel(unsigned* slots, unsigned* data, int iters, unsigned* violations) {
  const unsigned G = gridDim.x, next = (blockIdx.x + 1) % G;
  const int writer = blockDim.x - 1, reader = 1 % blockDim.x;
  unsigned warm = 0;
  for (int i = 0; i < iters; ++i) {
    unsigned* row = data + (size_t)i * G;
    if (threadIdx.x == 0) atomicAdd(&slots[i], 1u);
    if (threadIdx.x == writer) row[blockIdx.x] = i + 1;
    if (threadIdx.x == reader) warm += row[next];  // the line in this SM's L1 before the barrier
    if constexpr (MODE == 0) grid_barrier_fenced(&g_bar_count, &g_bar_gen, G);
    else if constexpr (MODE == 1) grid_barrier_acq_rel(&g_bar_count, &g_bar_gen, G);
    else cooperative_groups::this_grid().sync();
    if (threadIdx.x == 0 && *(volatile unsigned*)&slots[i] != G) atomicAdd(violations, 1u);
    if (threadIdx.x == reader && row[next] != (unsigned)(i + 1)) atomicAdd(violations, 1u);
  }
  if (warm == 0xffffffffu) atomicAdd(violations, 0u);  // keeps the warming loads
}

template <int MODE>
void launch_as(int ctas, int threads, unsigned* slots, unsigned* data, int iters, unsigned* violations,
               cudaStream_t stream) {
  if constexpr (MODE == 2) {
    void* args[] = {&slots, &data, &iters, &violations};
    DS4_CHECK(cudaLaunchCooperativeKernel((const void*)barrier_check_kernel<2>, dim3(ctas), dim3(threads), args, 0,
                                          stream));
  } else {
    barrier_check_kernel<MODE><<<ctas, threads, 0, stream>>>(slots, data, iters, violations);
  }
  DS4_CHECK_LAUNCH("barrier_check");
}

__global__ void empty_kernel() {}

__device__ __forceinline__ void st_release_gpu(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// The relay: a ring of gridDim.x CTAs, one per SM (the launch's shared memory allows no second), passes a token
// around `laps` times. CTA k waits for flags[k] to reach the lap (acquire), checks the plain store its predecessor made
// before releasing it, makes its own plain store for its successor, and releases flags[k + 1]. CTA 0 opens each lap. So
// each hop is one producer-to-consumer handoff through L2 with nothing else queued on the word: the least a
// persistent kernel's dependency between two ops can cost. A spin that outlasts `patience` polls counts a violation
// and moves on (a test fails instead of hanging).
__global__ void flag_relay_kernel(unsigned* flags, unsigned* data, int laps, unsigned* violations) {
  extern __shared__ unsigned char one_per_sm[];
  if (threadIdx.x != 0) return;
  const unsigned R = gridDim.x, k = blockIdx.x, next = (k + 1) % R;
  const unsigned patience = 1u << 22;  // a few seconds of polls
  if (laps == 0) one_per_sm[0] = 0;  // the allocation stays
  for (int lap = 1; lap <= laps; ++lap) {
    if (k != 0 || lap > 1) {  // CTA 0's first lap has no predecessor; later ones wait for the ring's last CTA
      const unsigned want = k == 0 ? lap - 1 : lap;
      unsigned polls = 0;
      while (ld_acquire_gpu(&flags[k]) < want && ++polls < patience) {
      }
      const unsigned prev = (k + R - 1) % R;
      if (polls >= patience || *(volatile unsigned*)&data[(size_t)prev] != want * R + prev) atomicAdd(violations, 1u);
    }
    data[k] = lap * R + k;  // plain store, published by the release below
    st_release_gpu(&flags[next], lap);
  }
}

__device__ __forceinline__ unsigned ld_acquire_cluster(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.cluster.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_cluster(unsigned* p, unsigned v) {
  asm volatile("st.release.cluster.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// flag_relay inside one thread block cluster: the token and the checked store go into the next CTA's shared memory
// (distributed shared memory, cluster-scope release / acquire), so no hop touches L2. Why: whether a handoff that
// stays inside a GPC escapes the queueing behind DRAM traffic that flag_relay's L2 hops suffer.
__global__ void cluster_relay_kernel(int laps, unsigned* violations, unsigned* received) {
  namespace cg = cooperative_groups;
  extern __shared__ unsigned char one_per_sm[];
  __shared__ unsigned flag, data;
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned R = cluster.num_blocks(), k = cluster.block_rank(), next = (k + 1) % R, prev = (k + R - 1) % R;
  if (threadIdx.x == 0) flag = 0, data = 0;
  if (laps == 0 && threadIdx.x == 0) one_per_sm[0] = 0;
  cluster.sync();  // every CTA's words are zero before any remote store
  if (threadIdx.x == 0) {
    unsigned* next_flag = cluster.map_shared_rank(&flag, (int)next);
    unsigned* next_data = cluster.map_shared_rank(&data, (int)next);
    const unsigned patience = 1u << 22;
    unsigned got = 0;
    for (int lap = 1; lap <= laps; ++lap) {
      if (k != 0 || lap > 1) {
        const unsigned want = k == 0 ? lap - 1 : lap;
        unsigned polls = 0;
        while (ld_acquire_cluster(&flag) < want && ++polls < patience) {
        }
        if (polls >= patience || *(volatile unsigned*)&data != want * R + prev) atomicAdd(violations, 1u);
        ++got;
      }
      *(volatile unsigned*)next_data = lap * R + k;
      st_release_cluster(next_flag, lap);
    }
    atomicAdd(received, got);  // the hops this CTA took: ctas x laps - 1 in all
  }
  cluster.sync();  // no CTA leaves while another may still store into its shared memory
}

}  // namespace

int barrier_max_ctas(int threads) {
  int sms = 0, dev = 0, a = 0, b = 0, c = 0;
  DS4_CHECK(cudaGetDevice(&dev));
  DS4_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, barrier_check_kernel<0>, threads, 0));
  DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, barrier_check_kernel<1>, threads, 0));
  DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c, barrier_check_kernel<2>, threads, 0));
  return std::min(a, std::min(b, c)) * sms;  // modes 0 and 1 are plain launches: other work on the device could still
                                              // take SMs (then they would wait forever); mode 2's launch is checked
}

void launch_barrier_check(int mode, int ctas, int threads, unsigned* slots, unsigned* data, int iters,
                          unsigned* violations, cudaStream_t stream) {
  if (threads < 32 || threads > 1024 || threads % 32) throw std::invalid_argument("barrier_check: 32..1024 threads");
  if (ctas < 1 || ctas > barrier_max_ctas(threads))
    throw std::invalid_argument("barrier_check: every CTA must be resident at once (1.." +
                                std::to_string(barrier_max_ctas(threads)) + " CTAs of " + std::to_string(threads) +
                                " threads)");
  if (iters < 0) throw std::invalid_argument("barrier_check: iters >= 0");
  switch (mode) {
    case 0: launch_as<0>(ctas, threads, slots, data, iters, violations, stream); break;
    case 1: launch_as<1>(ctas, threads, slots, data, iters, violations, stream); break;
    case 2: launch_as<2>(ctas, threads, slots, data, iters, violations, stream); break;
    default: throw std::invalid_argument("barrier_check: mode 0 (fenced), 1 (acquire/release) or 2 (grid.sync)");
  }
}

int flag_relay_max_ctas() {
  int sms = 0, dev = 0;
  DS4_CHECK(cudaGetDevice(&dev));
  DS4_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

void launch_flag_relay(int ctas, unsigned* flags, unsigned* data, int laps, unsigned* violations, cudaStream_t stream) {
  if (ctas < 2 || ctas > flag_relay_max_ctas())
    throw std::invalid_argument("flag_relay: 2.." + std::to_string(flag_relay_max_ctas()) +
                                " CTAs (one per SM, all resident at once)");
  if (laps < 0) throw std::invalid_argument("flag_relay: laps >= 0");
  int dev = 0, smem_sm = 0;
  DS4_CHECK(cudaGetDevice(&dev));
  DS4_CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  const int smem = smem_sm / 2 + 1024;  // more than half an SM's shared memory: one CTA per SM
  DS4_CHECK(cudaFuncSetAttribute(flag_relay_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  flag_relay_kernel<<<ctas, 32, smem, stream>>>(flags, data, laps, violations);
  DS4_CHECK_LAUNCH("flag_relay");
}

void launch_cluster_relay(int ctas, int laps, unsigned* violations, unsigned* received, cudaStream_t stream) {
  if (ctas < 2 || ctas > 8) throw std::invalid_argument("cluster_relay: 2..8 CTAs (one cluster of a portable size)");
  if (laps < 0) throw std::invalid_argument("cluster_relay: laps >= 0");
  int dev = 0, smem_sm = 0;
  DS4_CHECK(cudaGetDevice(&dev));
  DS4_CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  const int smem = smem_sm / 2 + 1024;  // one CTA per SM, as flag_relay
  DS4_CHECK(cudaFuncSetAttribute(cluster_relay_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)ctas);
  cfg.blockDim = dim3(32);
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)ctas;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DS4_CHECK(cudaLaunchKernelEx(&cfg, cluster_relay_kernel, laps, violations, received));
  DS4_CHECK_LAUNCH("cluster_relay");
}

void launch_empty(int n, cudaStream_t stream) {
  for (int i = 0; i < n; ++i) empty_kernel<<<1, 32, 0, stream>>>();
  DS4_CHECK_LAUNCH("empty_kernel");
}

}  // namespace ds4gpu
