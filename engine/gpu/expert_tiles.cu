// The routed experts' tile table for mmq's expert products (mmq.cu launch_mmq_experts: one CTA row per table entry),
// built on the device from the experts' row counts.
#include <stdexcept>

#include "common.cuh"

namespace ds4gpu {

// The routed experts' tile table on the device, so no host sync waits for the expert counts: counts [E] (int64, as
// torch.bincount gives them) of the activation rows sorted by expert -> tiles[i] = (first row, rows <= nt, expert, 0)
// in the order of moe_gemm.expert_tiles, then (0, 0, 0, 0) up to max_tiles: those CTAs exit at once (mmq_kernel's
// an <= 0). One block, one thread per expert; the two exclusive scans by warp shuffles.
__global__ void __launch_bounds__(1024) expert_tiles_kernel(const int64_t* counts, int E, int nt, int4* tiles,
                                                            int max_tiles) {
  __shared__ int s_rows[32], s_tiles[32];
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const int c = e < E ? (int)counts[e] : 0, n = (c + nt - 1) / nt;
  int rows = c, tl = n;  // inclusive scans within the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, rows, o), b = __shfl_up_sync(0xffffffffu, tl, o);
    if (lane >= o) rows += a, tl += b;
  }
  if (lane == 31) s_rows[warp] = rows, s_tiles[warp] = tl;
  __syncthreads();
  if (warp == 0) {  // the warps' totals, scanned
    int wr = lane < (int)(blockDim.x >> 5) ? s_rows[lane] : 0, wt = lane < (int)(blockDim.x >> 5) ? s_tiles[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, wr, o), b = __shfl_up_sync(0xffffffffu, wt, o);
      if (lane >= o) wr += a, wt += b;
    }
    s_rows[lane] = wr, s_tiles[lane] = wt;
  }
  __syncthreads();
  const int row0 = rows - c + (warp ? s_rows[warp - 1] : 0), tile0 = tl - n + (warp ? s_tiles[warp - 1] : 0);
  for (int j = 0; j < n && tile0 + j < max_tiles; ++j)
    tiles[tile0 + j] = make_int4(row0 + j * nt, min(nt, c - j * nt), e, 0);
  const int total = s_tiles[(blockDim.x >> 5) - 1];
  for (int i = total + threadIdx.x; i < max_tiles; i += blockDim.x) tiles[i] = make_int4(0, 0, 0, 0);
}

void launch_expert_tiles(const int64_t* counts, int E, int nt, int4* tiles, int max_tiles, cudaStream_t stream) {
  if (E < 1 || E > 1024) throw std::invalid_argument("expert_tiles: 1 .. 1024 experts");
  if (nt < 1 || max_tiles < 1) throw std::invalid_argument("expert_tiles: tile rows and max_tiles must be positive");
  expert_tiles_kernel<<<1, (E + 31) / 32 * 32, 0, stream>>>(counts, E, nt, tiles, max_tiles);
  DS4_CHECK_LAUNCH("expert_tiles");
}

}  // namespace ds4gpu
