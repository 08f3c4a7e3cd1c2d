/*
 * sparse_attention_bwd_index.cu - index building of the sparse attention backward: the key-major
 * (transposed) index at the granularity of 64-key blocks, a counting sort in the workspace
 * (count, scan, fill), and the choice of each head's dK / dV path and key ranges (km_scan_kernel);
 * for block lists (kv_block 16 / 64) the sorted lists and the same index in group order (below).
 * See sparse_attention_bwd.cu.
 */
#include "sparse_attention_bwd.cuh"

namespace dsv_attn {

/* Pass 1: per (b, h, g) list, count key-block runs and flag lists that are not strictly
 * ascending / in range. */
template <typename T>
__global__ void km_count_kernel(const BwdParams<T> p) {
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
  /* trailing -1 padding is not an error: those entries are not looked at */
  const int count = trim_count<128>(list, clamp_count(__ldg(p.kv_count + bh), p.kmax));
  int* cnt = p.kbcount + bh * p.nkb;
  bool bad = false;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int idx = __ldg(list + i);
    if ((unsigned)idx >= (unsigned)p.S) { bad = true; continue; }
    int prev = -1;
    if (i > 0) {
      prev = __ldg(list + i - 1);
      if (prev >= idx) bad = true;
    }
    const int kb = idx / KB;
    if (i == 0 || prev < 0 || prev / KB != kb) atomicAdd(cnt + kb, 1);
  }
  if (bad) p.flags[bh] = 1;
}

/* Pass 2: per (b, h), exclusive scan of the block counts, and the path decision. */
template <typename T>
__global__ void km_scan_kernel(const BwdParams<T> p) {
  __shared__ int warp_sums[32];
  __shared__ int s_carry;
  const size_t bh = blockIdx.x;
  const int* cnt = p.kbcount + bh * p.nkb;
  int* off = p.kboff + bh * p.nkb;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x / 32;
  if (tid == 0) s_carry = 0;
  __syncthreads();
  for (int base = 0; base < p.nkb; base += blockDim.x) {
    const int i = base + tid;
    const int x = i < p.nkb ? cnt[i] : 0;
    int incl = x;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int w = lane < nw ? warp_sums[lane] : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += y;
      }
      if (lane < nw) warp_sums[lane] = w; /* inclusive over warps */
    }
    __syncthreads();
    const int warp_excl = warp > 0 ? warp_sums[warp - 1] : 0;
    const int carry = s_carry;
    if (i < p.nkb) off[i] = carry + warp_excl + incl - x;
    __syncthreads();
    if (tid == blockDim.x - 1) s_carry = carry + warp_excl + incl;
    __syncthreads();
  }
  if (tid == 0) {
    const int total = s_carry;
    const int count = clamp_count(p.kv_count[bh], p.kmax);
    int path = 0;
    if (p.km_enabled && p.flags[bh] == 0) {
      const double km_cost = (double)total * KB;
      const double qm_cost = (double)p.NG * count;
      path = (count == 0 || km_cost <= (double)p.km_ratio * qm_cost) ? 1 : 0;
    }
    p.path[bh] = path;
    /* key ranges of the head (see bwd_ranges): all of them for scattered lists */
    int nr = p.nranges;
    if (p.flags[bh] != 0) {
      nr = 1; /* unsorted lists: each range would walk (masked) the whole list */
    } else if (!p.ranges_forced && nr > 1) {
      const bool scattered = count > 0 && (double)total * KB > 4.0 * (double)p.NG * count;
      if (!scattered) nr /= 2;
    }
    p.nrh[bh] = nr;
  }
}

/* Pass 3: fill (group, mask) entries of key-major heads. */
template <typename T>
__global__ void km_fill_kernel(const BwdParams<T> p) {
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != 1) return;
  const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
  const int count = trim_count<128>(list, clamp_count(__ldg(p.kv_count + bh), p.kmax));
  int* cur = p.kbcursor + bh * p.nkb;
  const int* off = p.kboff + bh * p.nkb;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int idx = __ldg(list + i);
    const int kb = idx / KB;
    if (i > 0 && __ldg(list + i - 1) / KB == kb) continue; /* not a run start */
    unsigned long long mask = 0ull;
    for (int j = i; j < count; ++j) {
      const int x = __ldg(list + j);
      if (x / KB != kb) break;
      mask |= 1ull << (x % KB);
    }
    const int pos = off[kb] + atomicAdd(cur + kb, 1);
    p.entg[bh * p.cap + pos] = g;
    p.entmask[bh * p.cap + pos] = mask;
  }
}

/* Pass 3, deterministic mode (DSV_FLAG_DETERMINISTIC): the same (group, mask) entries, written
 * in ascending group order, so that bwd_kmajor_kernel sums dK / dV in the same order on every
 * run (km_fill_kernel's atomicAdd positions order a key block's entries by arrival). One warp
 * per (b, h, key block): its lanes take 32 groups at a time, each finds the group's run of keys
 * in the block by binary search (a key-major head's list is strictly ascending and in range up
 * to its trimmed count, then negative), and a ballot ranks the groups that have one. grid
 * (ceil(nkb / 4), H, B), 128 threads. */
template <typename T>
__global__ void km_fill_ordered_kernel(const BwdParams<T> p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kb = blockIdx.x * 4 + warp, h = blockIdx.y, b = blockIdx.z;
  if (kb >= p.nkb) return;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != 1) return;
  const int count = clamp_count(__ldg(p.kv_count + bh), p.kmax);
  const int lo = kb * KB, hi = lo + KB;
  int pos = p.kboff[bh * p.nkb + kb];
  for (int g0 = 0; g0 < p.NG; g0 += 32) {
    const int g = g0 + lane;
    unsigned long long mask = 0ull;
    if (g < p.NG) {
      const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
      int a = 0, e = count; /* first entry that is negative or >= lo */
      while (a < e) {
        const int m = (a + e) >> 1;
        const int x = __ldg(list + m);
        if (x >= 0 && x < lo) a = m + 1; else e = m;
      }
      for (int j = a; j < count; ++j) {
        const int x = __ldg(list + j);
        if (x < lo || x >= hi) break; /* negative (padding) or past the block */
        mask |= 1ull << (x - lo);
      }
    }
    const unsigned has = __ballot_sync(0xffffffffu, mask != 0ull);
    if (mask != 0ull) {
      const int at = pos + __popc(has & ((1u << lane) - 1u));
      p.entg[bh * p.cap + at] = g;
      p.entmask[bh * p.cap + at] = mask;
    }
    pos += __popc(has);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* Block lists (kv_block b = 16 or 64). Entry e of a list covers keys e b .. e b + b - 1 (cut at
 * S); entries outside [0, ceil(S / b)) are skipped, duplicates count twice. The key-major pass
 * (bwd_kmajor_kernel) is reused unchanged: its 64-key block kt is one list block (b = 64) or
 * four (b = 16), and a (group, mask) entry covers the keys of the group's blocks in it. A group
 * that lists a block m times gets m entries (for b = 16: entry i masks the blocks listed more
 * than i times), so duplicates add twice as in the forward. Built without atomics, in an order
 * fixed by the input alone (dK / dV are then bit-identical run to run):
 *   blk_sort_kernel   each list's valid entries sorted ascending into bsorted (bitonic sort in
 *                     shared memory; lists of at most BLK_SORT_MAX entries, checked on the host)
 *   blk_entries_kernel<false>  one warp per (b, h, 64-key block) counts its entries: 32 groups
 *                     at a time, each lane binary-searches its group's sorted list
 *   km_scan_kernel    offsets (and path 1 for every head: km_ratio is set to the maximum)
 *   blk_entries_kernel<true>   the same walk writes the entries in ascending group order, each
 *                     lane's position from a warp prefix sum of the lanes' entry counts. */
template <typename T>
__global__ void blk_sort_kernel(const BwdParams<T> p) {
  extern __shared__ int sk[];
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
  const int count = clamp_count(__ldg(p.kv_count + bh), p.kmax);
  const int nblk = (p.S + p.blk - 1) / p.blk;
  int n2 = 1;
  while (n2 < count) n2 <<= 1;
  for (int i = threadIdx.x; i < n2; i += blockDim.x) {
    const int e = i < count ? __ldg(list + i) : -1;
    sk[i] = (unsigned)e < (unsigned)nblk ? e : INT32_MAX; /* invalid entries sort last */
  }
  __syncthreads();
  for (int k = 2; k <= n2; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n2; i += blockDim.x) {
        const int ij = i ^ j;
        if (ij > i) {
          const int a = sk[i], c = sk[ij];
          if ((a > c) == ((i & k) == 0)) {
            sk[i] = c;
            sk[ij] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  int* out = p.bsorted + (bh * p.NG + g) * p.kmax;
  int nvalid = 0;
  for (int i0 = 0; i0 < n2; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    const bool ok = i < n2 && sk[i] != INT32_MAX;
    if (ok) out[i] = sk[i];
    nvalid += __syncthreads_count(ok);
  }
  if (threadIdx.x == 0) p.bnsorted[bh * p.NG + g] = nvalid;
}

/* Count (FILL false) or write (FILL true) the (group, mask) entries of key-major block kt (64
 * keys: SUB = 64 / blk list blocks). grid (ceil(nkb / 4), H, B), 128 threads: warp w takes
 * block 4 blockIdx.x + w. */
template <typename T, bool FILL>
__global__ void blk_entries_kernel(const BwdParams<T> p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kt = blockIdx.x * 4 + warp, h = blockIdx.y, b = blockIdx.z;
  if (kt >= p.nkb) return;
  const size_t bh = (size_t)b * p.H + h;
  const int sub = KB / p.blk; /* list blocks per key-major block: 1 or 4 */
  const int blo = kt * sub;
  const int nk = min(KB, p.S - kt * KB); /* keys of the block below S */
  const unsigned long long keymask = nk >= KB ? ~0ull : (1ull << nk) - 1ull;
  int pos = FILL ? p.kboff[bh * p.nkb + kt] : 0;
  int total = 0;
  for (int g0 = 0; g0 < p.NG; g0 += 32) {
    const int g = g0 + lane;
    int c0 = 0, c1 = 0, c2 = 0, c3 = 0; /* how often the group lists blocks blo .. blo + 3 */
    if (g < p.NG) {
      const int n = p.bnsorted[bh * p.NG + g];
      const int* lst = p.bsorted + (bh * p.NG + g) * p.kmax;
      int a = 0, e = n; /* first entry >= blo */
      while (a < e) {
        const int m = (a + e) >> 1;
        if (lst[m] < blo) a = m + 1; else e = m;
      }
      for (int j = a; j < n; ++j) {
        const int x = lst[j] - blo;
        if (x >= sub) break;
        c0 += x == 0;
        c1 += x == 1;
        c2 += x == 2;
        c3 += x == 3;
      }
    }
    const int items = max(max(c0, c1), max(c2, c3));
    int incl = items; /* warp inclusive prefix sum of the lanes' entry counts */
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    const int wsum = __shfl_sync(0xffffffffu, incl, 31);
    if (FILL) {
      int at = pos + incl - items;
      for (int i = 0; i < items; ++i, ++at) {
        unsigned long long mask;
        if (sub == 1) {
          mask = ~0ull;
        } else {
          mask = (c0 > i ? 0xFFFFull : 0ull) | (c1 > i ? 0xFFFFull << 16 : 0ull) |
                 (c2 > i ? 0xFFFFull << 32 : 0ull) | (c3 > i ? 0xFFFFull << 48 : 0ull);
        }
        p.entg[bh * p.cap + at] = g;
        p.entmask[bh * p.cap + at] = mask & keymask;
      }
    }
    pos += wsum;
    total += wsum;
  }
  if (!FILL && lane == 0) p.kbcount[bh * p.nkb + kt] = total;
}

template <typename T>
int bwd_blocks_index_launch(BwdParams<T>& prm, int B, cudaStream_t stream) {
  const int BH = B * prm.H;
  int n2 = 1;
  while (n2 < prm.kmax) n2 <<= 1;
  const size_t smem = (size_t)n2 * sizeof(int);
  if (cudaFuncSetAttribute(blk_sort_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           (int)smem) != cudaSuccess)
    return DSV_ERR_CUDA;
  dim3 g3((unsigned)prm.NG, (unsigned)prm.H, (unsigned)B);
  blk_sort_kernel<T><<<g3, 256, smem, stream>>>(prm);
  dim3 ge((unsigned)((prm.nkb + 3) / 4), (unsigned)prm.H, (unsigned)B);
  blk_entries_kernel<T, false><<<ge, 128, 0, stream>>>(prm);
  km_scan_kernel<T><<<(unsigned)BH, 1024, 0, stream>>>(prm);
  blk_entries_kernel<T, true><<<ge, 128, 0, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

template int bwd_blocks_index_launch<__half>(BwdParams<__half>&, int, cudaStream_t);
template int bwd_blocks_index_launch<__nv_bfloat16>(BwdParams<__nv_bfloat16>&, int, cudaStream_t);

template <typename T>
int bwd_index_launch(BwdParams<T>& prm, int B, bool deterministic, cudaStream_t stream) {
  const int BH = B * prm.H;
  dim3 g3((unsigned)prm.NG, (unsigned)prm.H, (unsigned)B);
  km_count_kernel<T><<<g3, 128, 0, stream>>>(prm);
  km_scan_kernel<T><<<(unsigned)BH, 1024, 0, stream>>>(prm);
  if (prm.km_enabled && deterministic) {
    dim3 gf((unsigned)((prm.nkb + 3) / 4), (unsigned)prm.H, (unsigned)B);
    km_fill_ordered_kernel<T><<<gf, 128, 0, stream>>>(prm);
  } else if (prm.km_enabled) {
    km_fill_kernel<T><<<g3, 128, 0, stream>>>(prm);
  }
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

template int bwd_index_launch<__half>(BwdParams<__half>&, int, bool, cudaStream_t);
template int bwd_index_launch<__nv_bfloat16>(BwdParams<__nv_bfloat16>&, int, bool, cudaStream_t);

}  // namespace dsv_attn
