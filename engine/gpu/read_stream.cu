// A read-only streaming peer for the matvec benchmarks: every SM reads a large buffer (far beyond L2) with 16-byte
// non-caching loads, 8 in flight per thread, and nothing is written but one word the compiler cannot prove dead.
// Why: the floor of issue 6 and 11 divides the weight bytes by the device-to-device copy bandwidth, which counts bytes
// read plus bytes written. A matvec only reads; this kernel says how fast the H200 delivers a pure read stream, so a
// kernel's fraction of copy can be read against what reading alone reaches (ds4.speed_bench.gpu_kernels prints both).
#include <algorithm>

#include "common.cuh"
#include "mv_core.cuh"

namespace ds4gpu {

namespace {

constexpr int RS_THREADS = 512;
constexpr int RS_UNROLL = 8;

__global__ void __launch_bounds__(RS_THREADS) read_stream_kernel(const uint4* p, int64_t n16, unsigned* sink) {
  const int64_t stride = (int64_t)gridDim.x * RS_THREADS;
  int64_t i = (int64_t)blockIdx.x * RS_THREADS + threadIdx.x;
  unsigned acc = 0;
  for (; i + (RS_UNROLL - 1) * stride < n16; i += RS_UNROLL * stride) {
    uint4 v[RS_UNROLL];
#pragma unroll
    for (int u = 0; u < RS_UNROLL; ++u) v[u] = ld_stream16<false>(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < RS_UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = ld_stream16<false>(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // never true for the benchmark's fill; keeps every load live
}

}  // namespace

// ms per read of nbytes (a multiple of 16) from src, averaged over iters launches after 3 warm-up launches.
float read_stream_ms(const void* src, size_t nbytes, int iters, unsigned* sink, cudaStream_t stream) {
  const int64_t n16 = (int64_t)(nbytes / 16);
  int per_sm = 0, dev = 0, sms = 0;
  DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_stream_kernel, RS_THREADS, 0));
  DS4_CHECK(cudaGetDevice(&dev));
  DS4_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const dim3 grid((unsigned)(std::max(1, per_sm) * sms));
  auto go = [&] { read_stream_kernel<<<grid, RS_THREADS, 0, stream>>>((const uint4*)src, n16, sink); };
  for (int i = 0; i < 3; ++i) go();
  DS4_CHECK_LAUNCH("read_stream");
  return (float)time_on_stream_ms([&](int) { go(); }, iters, stream);
}

}  // namespace ds4gpu
