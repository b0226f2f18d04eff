// Top-k of the indexer keys in one block per row (decode: one row of float64 keys; prefill: a row of float32 scores
// per query): radix select, then an ordered compaction. (Greedy decode's argmax: step_edges.cu.)
//
// Result: the k largest keys' row indices in ascending index order. Among keys equal to the k-th
// largest the lowest indices win, NaN counts as smaller than everything, -0.0 equals +0.0. No atomic
// decides an output position (histogram counts only), so the output is the same on every run,
// eager or inside a CUDA graph.
//
// Algorithm: keys map to uint64 codes whose unsigned order is the double order. Pass p (p = 0..7)
// builds a 256-bin histogram of byte 7-p of the codes that still share the chosen prefix and picks
// the digit holding the k-th largest; `gt` counts the codes above the prefix so far. It stops early
// once the whole chosen bucket is needed (then every code with that prefix is taken) or all codes in
// it are equal (exact ties would otherwise take all 8 passes). The compaction
// takes every code with (code >> shift) > prefix and the first k - gt with (code >> shift) == prefix,
// positions from one block-wide exclusive scan of packed (greater, equal) counts.
#include <cstdlib>

#include "common.cuh"

namespace ds4gpu {
namespace {

constexpr int TOPK_THREADS = 1024;  // the most threads of a block
// A thread's keys stay in registers between passes: 8 each up to 8192 keys, 16 each up to 16384. The block has just the
// threads that hold keys (whole warps, at least TOPK_MIN_THREADS): every warp runs every pass's loops and barriers, so
// idle warps are not free. v19 ncu at 528 keys on 1024 threads: 32.6 k warp instructions, barrier stalls first, 14.7 us.
constexpr int TOPK_REG_ITEMS = 8, TOPK_REG_ITEMS_WIDE = 16;
constexpr int TOPK_MIN_THREADS = 64;

__device__ __forceinline__ uint64_t order_code(double x) {
  if (x != x) return 0;       // NaN: below -inf (whose code is 0x000F...F)
  if (x == 0.0) x = 0.0;      // -0.0 ties with +0.0 as in the float comparison
  const uint64_t b = (uint64_t)__double_as_longlong(x);
  return (b >> 63) ? ~b : b | (1ull << 63);
}
// float keys (the prefill indexer's scores): the 32-bit code in the top half, so the low passes see equal bytes and
// end at the first pass whose candidates all agree
__device__ __forceinline__ uint64_t order_code(float x) {
  if (x != x) return 0;
  if (x == 0.0f) x = 0.0f;
  const uint32_t b = __float_as_uint(x);
  return (uint64_t)((b >> 31) ? ~b : b | (1u << 31)) << 32;
}

// Exclusive block-wide prefix sum of one uint64 per thread (all threads must call it).
__device__ uint64_t block_exclusive_scan(uint64_t v, uint64_t* warp_tot) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  uint64_t inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t t = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += t;
  }
  if (lane == 31) warp_tot[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    uint64_t w = lane < nw ? warp_tot[lane] : 0, wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t t = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += t;
    }
    if (lane < nw) warp_tot[lane] = wi - w;  // exclusive prefix of the warp totals
  }
  __syncthreads();
  return warp_tot[warp] + inc - v;
}


constexpr unsigned FULL = 0xffffffffu;

// Counts the candidate lanes' bins into hist (all lanes of the warp call it). The lanes sharing the
// first candidate's bin add once together: the first passes put nearly every key in one bin, and
// 32 lanes adding to one shared address one by one would serialize.
__device__ __forceinline__ void hist_add(unsigned* hist, bool cand, unsigned bin) {
  const unsigned lanes = __ballot_sync(FULL, cand);
  if (!lanes) return;
  const int lead = __ffs(lanes) - 1;
  const unsigned lead_bin = __shfl_sync(FULL, bin, lead);
  const unsigned same = __ballot_sync(FULL, cand && bin == lead_bin);
  if ((int)(threadIdx.x & 31) == lead) atomicAdd(&hist[bin], __popc(same));
  else if (cand && bin != lead_bin) atomicAdd(&hist[bin], 1u);
}

// Bitwise OR and AND of the candidates' codes into o[hi, lo] and a[hi, lo] (all lanes call it; 32-bit
// halves: native shared atomics). OR == AND at the end of a pass means every candidate holds the same
// code (ties: no further pass can split them).
__device__ __forceinline__ void or_and_add(unsigned* o, unsigned* a, uint64_t ov, uint64_t av, bool any) {
  if (!__any_sync(FULL, any)) return;
  const unsigned ohi = __reduce_or_sync(FULL, (unsigned)(ov >> 32)), olo = __reduce_or_sync(FULL, (unsigned)ov);
  const unsigned ahi = __reduce_and_sync(FULL, (unsigned)(av >> 32)), alo = __reduce_and_sync(FULL, (unsigned)av);
  if ((threadIdx.x & 31) == 0) {
    atomicOr(&o[0], ohi), atomicOr(&o[1], olo);
    atomicAnd(&a[0], ahi), atomicAnd(&a[1], alo);
  }
}

// REG > 0: n <= REG * blockDim.x, keys read once into registers. REG == 0: keys re-read from global
// memory each pass (striped for coalescing; the compaction reads them blocked).
// One block per row: row b reads keys + b * ld, pos + b (when pos is set) and writes sel + b * k.
template <int REG, typename Key>
__global__ void __launch_bounds__(TOPK_THREADS) topk_rows_kernel(const Key* keys, int n, int64_t ld, int k,
                                                                 const int64_t* pos, int ratio, int64_t* sel,
                                                                 bool pre) {
  keys += (int64_t)blockIdx.x * ld;
  sel += (int64_t)blockIdx.x * k;
  if (pos) pos += blockIdx.x;
  // pre ($DS4_GPU_PREWAIT=2): the position (written before the step's graph starts) is read before the wait
  pdl_trigger();
  const int64_t p_early = pre && pos ? *pos : 0;
  pdl_wait();
  // two histograms (and OR/AND words): a pass clears the next one's, saving a barrier per pass
  __shared__ unsigned hist[2][256];
  __shared__ unsigned sh_or[2][2], sh_and[2][2];  // [buffer][hi, lo]
  __shared__ uint64_t warp_tot[32];
  __shared__ uint64_t sh_prefix;
  __shared__ int sh_gt, sh_eq;
  const int tid = threadIdx.x;
  if (pos) {
    const int64_t n_vis = ((pre ? p_early : *pos) + 1) / ratio;
    if (n_vis <= k) {  // every visible row fits; the attention masks rows >= n_vis itself
      for (int i = tid; i < k; i += blockDim.x) sel[i] = i;
      return;
    }
    // Rows at or past n_vis are no candidates (index_keys writes -inf there): a decode graph sized for the session's
    // whole context selects among the visible rows only, so its cost follows the position, not the capacity (v34:
    // ds4-bench's 32k session decoding at 2k ran 8208 keys where 512 are visible).
    n = (int)min((int64_t)n, n_vis);
  }
  // blocked ownership: thread t has rows [begin, end)
  const int chunk = REG ? REG : (n + (int)blockDim.x - 1) / (int)blockDim.x;
  const int begin = min(tid * chunk, n), end = min(begin + chunk, n);
  // Warps that own no key (a decode graph sized for the whole context: 17 warps for 8208 keys, 2 holding the 530
  // visible ones at 2k) skip the key loops and only meet the barriers: the same counts, so the same selection.
  const bool busy = REG == 0 || (tid & ~31) * chunk < n;
  uint64_t code[REG ? REG : 1];
  if (REG) {
#pragma unroll
    for (int j = 0; j < (REG ? REG : 1); ++j) code[j] = begin + j < end ? order_code(keys[begin + j]) : 0;
  }
  for (int i = tid; i < 256; i += blockDim.x) hist[0][i] = 0;
  if (tid < 2) sh_or[0][tid] = 0, sh_and[0][tid] = ~0u;
  __syncthreads();

  uint64_t prefix = 0;  // the chosen top bytes of the k-th largest code
  int gt = 0;           // codes whose top bytes are above prefix
  int shift = 64;       // prefix = code >> shift for the tied codes
  for (int pass = 0; pass < 8; ++pass) {
    const int s = 56 - 8 * pass, cur = pass & 1;
    unsigned* h = hist[cur];
    // the other buffer's last readers finished before the barrier that ended the previous pass
    for (int i = tid; i < 256; i += blockDim.x) hist[cur ^ 1][i] = 0;
    if (tid < 2) sh_or[cur ^ 1][tid] = 0, sh_and[cur ^ 1][tid] = ~0u;
    uint64_t ov = 0, av = ~0ull;
    bool any = false;
    if (REG && busy) {
#pragma unroll
      for (int j = 0; j < (REG ? REG : 1); ++j) {
        const uint64_t c = code[j];
        const bool cand = begin + j < end && (pass == 0 || (c >> (s + 8)) == prefix);
        hist_add(h, cand, (unsigned)(c >> s) & 255u);
        if (cand) ov |= c, av &= c, any = true;
      }
    } else if (!REG) {
      const int n_up = (n + (int)blockDim.x - 1) / (int)blockDim.x * (int)blockDim.x;  // same trip count per warp
      for (int i = tid; i < n_up; i += blockDim.x) {
        const uint64_t c = i < n ? order_code(keys[i]) : 0;
        const bool cand = i < n && (pass == 0 || (c >> (s + 8)) == prefix);
        hist_add(h, cand, (unsigned)(c >> s) & 255u);
        if (cand) ov |= c, av &= c, any = true;
      }
    }
    or_and_add(sh_or[cur], sh_and[cur], ov, av, any);
    __syncthreads();
    if (sh_or[cur][0] == sh_and[cur][0] && sh_or[cur][1] == sh_and[cur][1]) {  // all candidates equal (uniform)
      prefix = (uint64_t)sh_or[cur][0] << 32 | sh_or[cur][1];
      shift = 0;
      break;
    }
    if (tid < 32) {
      // lane l owns digits 255-8l .. 248-8l (descending), so lane order is code order from the top
      unsigned mine = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) mine += h[255 - 8 * tid - i];
      unsigned inc = mine;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned t = __shfl_up_sync(FULL, inc, o);
        if (tid >= o) inc += t;
      }
      int above = gt + (int)(inc - mine);  // codes above this lane's first digit
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int d = 255 - 8 * tid - i, c = (int)h[d];
        if (above < k && above + c >= k) {  // exactly one digit satisfies this
          sh_prefix = prefix << 8 | (uint64_t)d;
          sh_gt = above;
          sh_eq = c;
        }
        above += c;
      }
    }
    __syncthreads();
    prefix = sh_prefix;
    gt = sh_gt;
    shift = s;
    if (sh_eq == k - gt) break;  // the whole bucket is taken: no need to resolve it further (uniform)
  }

  // compaction in ascending index order
  const uint64_t need = (uint64_t)(k - gt);
  uint64_t n_gt = 0, n_eq = 0;
  if (busy) {
#pragma unroll
    for (int j = 0; j < (REG ? REG : chunk); ++j) {
      if (begin + j < end) {
        const uint64_t c = (REG ? code[REG ? j : 0] : order_code(keys[begin + j])) >> shift;
        n_gt += c > prefix;
        n_eq += c == prefix;
      }
    }
  }
  const uint64_t before = block_exclusive_scan(n_gt << 32 | n_eq, warp_tot);
  uint64_t gt_before = before >> 32, eq_before = before & 0xffffffffu;
  if (!busy) return;
#pragma unroll
  for (int j = 0; j < (REG ? REG : chunk); ++j) {
    if (begin + j < end) {
      const uint64_t c = (REG ? code[REG ? j : 0] : order_code(keys[begin + j])) >> shift;
      if (c > prefix) {
        sel[gt_before + min(eq_before, need)] = begin + j;
        ++gt_before;
      } else if (c == prefix) {
        if (eq_before < need) sel[gt_before + eq_before] = begin + j;
        ++eq_before;
      }
    }
  }
}

}  // namespace

namespace {
template <typename Key>
void launch_rows(const Key* keys, int n, int64_t ld, int rows, int k, const int64_t* pos, int ratio, int64_t* sel,
                 cudaStream_t s) {
  if (k < 1 || k > n) throw std::invalid_argument("topk_rows: need 1 <= k <= n");
  if (rows < 1 || ld < n) throw std::invalid_argument("topk_rows: need rows >= 1 and a row stride >= n");
  if (pos && ratio < 1) throw std::invalid_argument("topk_rows: ratio must be >= 1");
  // whole warps holding REG keys each (blocked ownership covers [0, n) with threads * REG >= n)
  // $DS4_GPU_TOPK_FULL=1: 1024 threads at every n (the v19 launch; benchmark A/B)
  static const bool full = [] {
    const char* e = std::getenv("DS4_GPU_TOPK_FULL");
    return e && e[0] == '1';
  }();
  auto threads_for = [n](int reg) {
    const int t = (n + reg - 1) / reg;
    return full ? TOPK_THREADS : std::max(TOPK_MIN_THREADS, std::min(TOPK_THREADS, (t + 31) / 32 * 32));
  };
  if (n <= TOPK_REG_ITEMS * TOPK_THREADS)
    launch_k(topk_rows_kernel<TOPK_REG_ITEMS, Key>, dim3(rows), dim3(threads_for(TOPK_REG_ITEMS)), 0, s, keys, n, ld, k,
             pos, ratio, sel, prewait_mode() >= 2);
  else if (n <= TOPK_REG_ITEMS_WIDE * TOPK_THREADS)
    launch_k(topk_rows_kernel<TOPK_REG_ITEMS_WIDE, Key>, dim3(rows), dim3(threads_for(TOPK_REG_ITEMS_WIDE)), 0, s, keys,
             n, ld, k, pos, ratio, sel, prewait_mode() >= 2);
  else
    launch_k(topk_rows_kernel<0, Key>, dim3(rows), dim3(TOPK_THREADS), 0, s, keys, n, ld, k, pos, ratio, sel,
             prewait_mode() >= 2);
  DS4_CHECK_LAUNCH("topk_rows");
}
}  // namespace

void launch_topk_rows(const double* keys, int n, int k, const int64_t* pos, int ratio, int64_t* sel, cudaStream_t s) {
  launch_rows(keys, n, (int64_t)n, 1, k, pos, ratio, sel, s);
}

void launch_topk_rows_f32(const float* keys, int n, int64_t ld, int rows, int k, const int64_t* pos, int ratio,
                          int64_t* sel, cudaStream_t s) {
  launch_rows(keys, n, ld, rows, k, pos, ratio, sel, s);
}

}  // namespace ds4gpu
