/*
 * merged_groups.cuh - merged groups of the sparse attention kernels (internal; the kernel tuning's
 * `merge`, PERF_LOG kernels v26 / v27). Groups of G = 16, 32 or 64 queries give M = 128 / G
 * groups per 128-query block u; where the union of their lists is short enough, one 128-row
 * CTA of the two-warpgroup kernels walks the union instead of M CTAs walking the lists, each
 * row's scores masked to its own group's keys: every key of the union is gathered once per
 * 128 rows, and in the backward its dK / dV reduced once (instead of once per group that
 * selected it). The backward merges G 16 / 32 / 64 (bwd_wg128_kernel), the forward G 16 / 32
 * (sparse_attn_fwd_wg_kernel; at G = 64 the 64-row forward already gathers at the 128-row
 * kernel's rate per key).
 *
 * union_build_kernel, one CTA per (u, h, b), writes block u's union into the workspace:
 *   - only strictly ascending lists in range up to their trimmed length (as topk_estimate writes
 *     them; any other list keeps the block's groups separate, so duplicates still count twice);
 *     in the backward only heads on the query-major dK / dV path; where `gate` is set (merge
 *     below 1) not scattered lists (key-block runs x 64 > 4 x K: there the union is nearly M
 *     lists long, and building it costs ~5% of the forward): in the backward the head's measure
 *     (km_scan_kernel's), in the forward that of the block's first list;
 *   - the keys in windows of W keys: a bitmap per group in shared memory (one atomicOr per run of
 *     a warp's keys in one word), then each thread turns a run of words into packed entries
 *     (key | member mask << UKEY_BITS) at its place of a block-wide prefix sum: ascending, no
 *     duplicates. More than ucap entries: ucnt = -1, the groups run separately;
 *   - non-finite elements: in a merged CTA a row multiplies masked zeros (P, and dS in the
 *     backward) with rows of other groups' keys and queries, and 0 x inf = NaN would appear
 *     where attention over the lists has none. So the kernel checks the rows that enter that
 *     way: head-wide (hc: V in the forward, K in the backward) for every block it builds, and
 *     locally (lc: Q and dO in the backward) where it merged; a non-finite element sets the
 *     head's knf, and then nothing of the head is merged. (Scores and dP enter only through the
 *     masks' selects.)
 */
#ifndef DSV_MERGED_GROUPS_CUH
#define DSV_MERGED_GROUPS_CUH

#include "attention_common.cuh"
#include "tuning.h"

namespace dsv_attn {

/* Packed entries of the merged lists: keys below 2^UKEY_BITS (the sequence length limit of
 * merging), member masks of up to 8 groups above them (the sign bit stays clear). */
constexpr int UKEY_BITS = 23;
constexpr int UKEY_MASK = (1 << UKEY_BITS) - 1;

/* What union_build_kernel reads and writes. */
struct UnionBuild {
  const int* kv_index; /* [B, H, NG, kmax] */
  const int* kv_count; /* [B, H] */
  int S, H, G, NG, kmax, NSG, ucap, D;
  int* uidx;           /* [B, H, NSG, ucap] */
  int* ucnt;           /* [B, H, NSG] */
  int* knf;            /* [B, H], zeroed before the launch */
  /* backward: the head's path (merged only on 0) and the key-major index's kboff, kbcount (nkb
   * blocks) for the scattered-lists gate; path nullptr (the forward): no path, the gate's test
   * on the block's first list. gate 0 merges scattered lists too */
  const int* path;
  const int *kboff, *kbcount;
  int nkb, gate;
  /* rows checked for non-finite elements: hc head-wide, lc[0 .. nlc) where merged */
  const void* hc;
  int64_t hcb, hcs, hch;
  const void* lc[2];
  int64_t lcb[2], lcs[2], lch[2];
  int nlc;
};

/* The fields a pass's parameters (FwdParams, BwdParams: the same member names) give: the lists,
 * sizes, workspace and the gate (merge below 1); no path, no rows checked. */
template <typename Prm>
static UnionBuild union_build_of(const Prm& prm, int D) {
  UnionBuild ub;
  ub.kv_index = prm.kv_index;
  ub.kv_count = prm.kv_count;
  ub.S = prm.S, ub.H = prm.H, ub.G = prm.G, ub.NG = prm.NG, ub.kmax = prm.kmax;
  ub.NSG = prm.NSG, ub.ucap = prm.ucap, ub.D = D;
  ub.uidx = prm.uidx, ub.ucnt = prm.ucnt, ub.knf = prm.knf;
  ub.path = nullptr, ub.kboff = ub.kbcount = nullptr, ub.nkb = 0;
  ub.gate = prm.merge < 1.f;
  ub.hc = nullptr, ub.hcb = ub.hcs = ub.hch = 0;
  ub.nlc = 0;
  return ub;
}

/* The parameters of the merged launch: the 128-query blocks as groups of 128 (ug keeps G). */
template <typename Prm>
static Prm union_launch_params(const Prm& prm) {
  Prm pu = prm;
  pu.ug = prm.G;
  pu.G = 128;
  pu.NG = prm.NSG;
  pu.chunks = 1;
  return pu;
}

template <typename T> struct ExpBits;
template <> struct ExpBits<__half> { static constexpr uint32_t v = 0x7C007C00u; };
template <> struct ExpBits<__nv_bfloat16> { static constexpr uint32_t v = 0x7F807F80u; };

/* Whether rows [row0, row0 + nrows) of a (b, h) slice with row stride `stride` hold only finite
 * elements (this thread's share of them). */
template <typename T>
__device__ __forceinline__ bool rows_finite(const T* base, int64_t stride, int row0, int nrows,
                                            int D) {
  constexpr uint32_t E = ExpBits<T>::v;
  const int CH = D / 8;
  bool ok = true;
  for (int i = threadIdx.x; i < nrows * CH; i += blockDim.x) {
    const int r = i / CH, c = i - r * CH;
    const T* e = base + (int64_t)(row0 + r) * stride + c * 8;
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(e));
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t a = w[j] & E;
      ok &= (a & 0xFFFFu) != (E & 0xFFFFu) && (a >> 16) != (E >> 16);
    }
  }
  return ok;
}

template <typename T>
__device__ __forceinline__ bool slice_rows_finite(const void* t, int64_t sb, int64_t ss,
                                                  int64_t sh, int b, int h, int row0, int nrows,
                                                  int D) {
  return rows_finite<T>(reinterpret_cast<const T*>(t) + b * sb + h * sh, ss, row0, nrows, D);
}

template <typename T>
__global__ void __launch_bounds__(256) union_build_kernel(const UnionBuild p, int W) {
  extern __shared__ uint32_t ubits[]; /* [M][W / 32] */
  __shared__ int s_cnt[8], s_cur[8], s_end[8], s_warp[8], s_total, s_bad;
  const int u = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int M = 128 / p.G, NWD = W / 32;
  const int row0 = u * 128, nrows = min(128, p.S - row0);
  int* ucnt = p.ucnt + bh * p.NSG + u;
  const int count = clamp_count(__ldg(p.kv_count + bh), p.kmax);
  bool on = count > 0;
  if (p.path) {
    on = on && p.path[bh] == 0;
    if (on && p.gate) {
      const size_t last = bh * p.nkb + p.nkb - 1;
      on = ((double)p.kboff[last] + p.kbcount[last]) * 64.0 <= 4.0 * (double)p.NG * count;
    }
  }
  if (!on) {
    if (tid == 0) *ucnt = -1;
    return;
  }
  if (!__syncthreads_and(slice_rows_finite<T>(p.hc, p.hcb, p.hcs, p.hch, b, h, row0, nrows, p.D)) &&
      tid == 0)
    atomicOr(p.knf + bh, 1);
  for (int m = 0; m < M; ++m) {
    const int g = u * M + m; /* past the last group: an empty list */
    const int n = g < p.NG ? trim_count<256>(p.kv_index + (bh * p.NG + g) * p.kmax, count) : 0;
    if (tid == 0) {
      s_cnt[m] = n;
      s_cur[m] = 0;
    }
  }
  if (tid == 0) s_total = s_bad = 0;
  __syncthreads();
  if (!p.path && p.gate) { /* the forward: the scattered-lists test on the block's first list */
    const int* list = p.kv_index + (bh * p.NG + u * M) * p.kmax;
    int runs = 0;
    for (int j0 = 0; j0 < s_cnt[0]; j0 += 256) {
      const int j = j0 + tid;
      runs += __syncthreads_count(j < s_cnt[0] &&
                                  (j == 0 || (__ldg(list + j) >> 6) != (__ldg(list + j - 1) >> 6)));
    }
    if (runs * 64.0 > 4.0 * s_cnt[0]) {
      if (tid == 0) *ucnt = -1;
      return;
    }
  }
  int* out = p.uidx + (bh * p.NSG + u) * (size_t)p.ucap;
  for (int lo = 0; lo < p.S; lo += W) {
    const int hi = min(p.S, lo + W), nwd = (hi - lo + 31) >> 5;
    for (int i = tid; i < M * NWD; i += 256) ubits[i] = 0u;
    if (tid < M) { /* the end of the list's run in this window (its whole length in the last) */
      const int* list = p.kv_index + (bh * p.NG + u * M + tid) * p.kmax;
      s_end[tid] = hi < p.S ? list_lower_bound(list, s_cur[tid], s_cnt[tid], hi) : s_cnt[tid];
    }
    __syncthreads();
    bool bad = false;
    for (int m = 0; m < M; ++m) {
      const int* list = p.kv_index + (bh * p.NG + u * M + m) * p.kmax;
      for (int jb = s_cur[m]; jb < s_end[m]; jb += 256) {
        const int j = jb + tid;
        const bool in = j < s_end[m];
        const int x = in ? __ldg(list + j) : 0;
        /* strictly ascending and inside the window (an unsorted or out-of-range list keeps the
         * block's groups separate) */
        int prev = __shfl_up_sync(0xffffffffu, x, 1);
        if (lane == 0 && j > 0 && in) prev = __ldg(list + j - 1);
        const bool ok = !in || ((j == 0 || prev < x) && x >= lo && x < hi);
        bad |= !ok;
        const int key = in && ok ? x - lo : -1;
        /* the lanes of one word are neighbours (ascending list): OR them, one atomic per run */
        const int wd = key >= 0 ? key >> 5 : -1 - lane;
        uint32_t bits = key >= 0 ? 1u << (key & 31) : 0u;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int ow = __shfl_down_sync(0xffffffffu, wd, d);
          const uint32_t ob = __shfl_down_sync(0xffffffffu, bits, d);
          if (lane + d < 32 && ow == wd) bits |= ob;
        }
        const int pw = __shfl_up_sync(0xffffffffu, wd, 1);
        if (key >= 0 && (lane == 0 || pw != wd)) atomicOr(ubits + m * NWD + wd, bits);
      }
    }
    if (bad) s_bad = 1;
    __syncthreads();
    const int per = (nwd + 255) / 256, w0 = min(nwd, tid * per), w1 = min(nwd, w0 + per);
    int n = 0;
    for (int w = w0; w < w1; ++w) {
      uint32_t o = 0u;
      for (int m = 0; m < M; ++m) o |= ubits[m * NWD + w];
      n += __popc(o);
    }
    int incl = n; /* block-wide prefix sum of the threads' entries */
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int wex = 0, tot = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int x = s_warp[i];
      wex += i < warp ? x : 0;
      tot += x;
    }
    const int base = s_total;
    const bool stop = s_bad || base + tot > p.ucap;
    if (!stop) {
      int pos = base + wex + incl - n;
      for (int w = w0; w < w1; ++w) {
        uint32_t o = 0u;
        for (int m = 0; m < M; ++m) o |= ubits[m * NWD + w];
        while (o) {
          const int bit = __ffs(o) - 1;
          o &= o - 1u;
          uint32_t mk = 0u;
          for (int m = 0; m < M; ++m) mk |= ((ubits[m * NWD + w] >> bit) & 1u) << m;
          out[pos++] = (lo + w * 32 + bit) | (int)(mk << UKEY_BITS);
        }
      }
    }
    __syncthreads(); /* s_warp, s_total, s_bad and the bitmaps read */
    if (tid == 0) s_total = stop ? p.ucap + 1 : base + tot;
    if (tid < M) s_cur[tid] = s_end[tid];
    __syncthreads();
    if (s_total > p.ucap) break;
  }
  const int total = s_total;
  const bool merged = total <= p.ucap;
  if (merged && p.nlc > 0) {
    bool fin = true;
    for (int i = 0; i < p.nlc; ++i)
      fin = fin && slice_rows_finite<T>(p.lc[i], p.lcb[i], p.lcs[i], p.lch[i], b, h, row0, nrows,
                                        p.D);
    if (!__syncthreads_and(fin) && tid == 0) atomicOr(p.knf + bh, 1);
  }
  if (tid == 0) *ucnt = merged ? total : -1;
}

/* The capacity of a 128-query block's union, min(S, merge x (128 / G) x kmax), where merging may
 * run for these sizes (G 16 / 32 / 64 with the G a warp's 16 rows fit in, S below
 * 2^UKEY_BITS), else 0. */
static inline int64_t union_capacity(float merge, int64_t S, int64_t G, int64_t kmax) {
  if (!(merge > 0.f) || (G != 16 && G != 32 && G != 64) || S > ((int64_t)1 << UKEY_BITS) ||
      kmax <= 0)
    return 0;
  const double c = ceil((double)merge * (double)(128 / G) * (double)kmax);
  return c < (double)S ? (int64_t)c : S;
}

/* Workspace of the merged groups: the unions, their counts, the heads' knf; offsets from the
 * start of the region (its bytes in `total`). */
struct UnionLayout {
  size_t uidx, ucnt, knf, total;
};

static inline UnionLayout union_layout(int64_t BH, int64_t nsg, int64_t ucap) {
  UnionLayout L;
  size_t o = 0;
  L.uidx = o; o = (o + (size_t)BH * nsg * ucap * sizeof(int) + 255) & ~(size_t)255;
  L.ucnt = o; o = (o + (size_t)BH * nsg * sizeof(int) + 255) & ~(size_t)255;
  L.knf = o; o = (o + (size_t)BH * sizeof(int) + 255) & ~(size_t)255;
  L.total = ucap > 0 ? o : 0;
  return L;
}

/* Launch (grid NSG x H x B); knf must be zero. The window: the bitmaps of M x W bits within
 * 40 KB of shared memory, or the tuning's merge_window keys where it is set (tests: several
 * windows at small S). */
template <typename T>
static int union_build_launch(const UnionBuild& ub, int B, cudaStream_t stream) {
  const dsv_tuning* tun = nullptr;
  const int st = dsv_tuning_current(&tun);
  if (st != DSV_OK) return st;
  const int M = 128 / ub.G;
  int wmax = (40 * 1024 * 8 / M) & ~31;
  if (tun->merge_window > 0 && tun->merge_window < wmax) wmax = tun->merge_window;
  const int s32 = (ub.S + 31) & ~31;
  const int W = s32 < wmax ? s32 : wmax;
  const size_t smem = (size_t)M * (W / 32) * sizeof(uint32_t);
  dim3 grid((unsigned)ub.NSG, (unsigned)ub.H, (unsigned)B);
  union_build_kernel<T><<<grid, 256, smem, stream>>>(ub, W);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

}  // namespace dsv_attn

#endif /* DSV_MERGED_GROUPS_CUH */
