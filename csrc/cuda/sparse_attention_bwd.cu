/*
 * sparse_attention_bwd.cu - backward of sparse grouped attention on CUDA (sm_90a).
 *
 * dQ is computed query-major (one CTA per chunk of a group's queries, keys gathered per tile
 * as in the forward; S, P, dP, dS recomputed; dQ accumulated in registers, no atomics).
 *
 * dK and dV are built one of two ways, chosen per (batch, head) on the device:
 *
 *  key-major (path 1): the lists are transposed at the granularity of 64-key blocks with a
 *    counting sort in the workspace: for every key block, the groups that selected at least
 *    one of its keys, each with a 64-bit mask of which. A CTA owns one key block (4 warps x 16
 *    keys), walks its (group, mask) entries, recomputes S^T, P^T, dP^T, dS^T for the group's
 *    queries against its 64 keys (masked), and accumulates dK, dV in registers; it writes them
 *    once, with no atomics. Its work is (entries x 64 keys), which equals the gathered work
 *    when selections are coherent (whole key blocks selected) and grows up to 64 / (selected
 *    keys per block) when they are scattered.
 *
 *  query-major with reductions (path 0): the dQ CTA also forms each key tile's
 *    dV_t = P^T dO and dK_t = dS^T Q (tile keys x D, through shared memory) and adds them to
 *    fp32 accumulators, which a last pass converts to the output dtype. By default the fp32
 *    tiles are staged in shared memory and each key row goes out as one asynchronous TMA bulk
 *    reduction (cp.reduce.async.bulk .add.f32, 4 D bytes), so the warps go on with the next tile
 *    while the reductions drain; DSV_ATTN_BWD_REDUCE=v4 selects 16-byte red.global.add.v4.f32
 *    from registers instead. Both reach the same L2 rate (benchmarks/atomic_microbench.cu:
 *    962 vs 956 G floats/s); the bulk form overlaps better (S = 64k, 0.9: G = 32 174 vs 202 ms,
 *    G = 64 smooth 80 vs 85 ms, random 88 vs 87 ms). Where a head's accumulators exceed the L2
 *    (long sequences) the keys are split into R ranges handled by separate CTAs, so that the
 *    CTAs running at one time touch 1/R of a head's K, V and accumulators; dQ is then reduced
 *    over ranges in fp32 too (bwd_ranges: R per head from the L2 size and how scattered the
 *    head's lists are; S = 128k, D = 128, random lists: 438 -> 315 ms).
 *  Trailing -1 entries of a list (padding) are trimmed first (trim_count), in every path.
 *
 * A head takes path 1 when its lists are strictly ascending and in range (as topk_estimate
 * writes them), D <= 128, and (key-block entries x 64) <= ratio x (groups x K); ratio defaults
 * to 1.15 (measured crossover on the H200 at S = 64k, D = 128: path 0 costs ~110 ms whatever
 * the lists; path 1 ~57 ms of dQ pass + ~41 ms per unit of the ratio) and can be set with the
 * environment variable DSV_KM_RATIO (0 forces path 0, a large value forces path 1 where
 * allowed). Deterministic mode (DSV_FLAG_DETERMINISTIC in dsv_attn_shape.flags): every head
 * whose lists allow it takes path 1, its (group, mask) entries filled in ascending group order
 * (km_fill_ordered_kernel: a ballot scan, not atomic positions), and one key range, so dQ is
 * summed in registers too: no float atomics, bit-identical results run to run. (With ranges
 * R > 1 the default path sums dQ over the ranges with fp32 reductions in an arbitrary order.)
 * Key tiles of the query-major kernels: 32 keys x 2 cp.async stages by default
 * (DSV_ATTN_BWD_TILE = 32x2 / 64x2 / 32x3 / 32x4; see bwd_tile_cfg for the measurements). On
 * H100 / H200 the dQ-only pass runs on wgmma (sparse_attention_bwd_wg.cuh), and so does the pass
 * with reductions with DSV_ATTN_BWD_TILE = w64x2.
 */
#include <stdlib.h>
#include <string.h>

#include "attention_common.cuh"
#include "sparse_attention_bwd_wg.cuh" /* the query-major backward on wgmma (sm_90a) */

namespace dsv_attn {

int check_attn_args(const dsv_attn_shape* p); /* sparse_attention_fwd.cu */

constexpr int KB = 64; /* key block of the key-major path */

struct BwdLayout {
  size_t delta, dkacc, dvacc, dqacc, path, flags, nrh, kbcount, kbcursor, kboff, entg, entmask, total;
  int64_t nkb, cap;
  int km_enabled;
};

static size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

/* Key ranges of the query-major reduction path. R ranges make the CTAs running at one time touch
 * 1/R of a head's K, V and fp32 dK, dV accumulators, which then stay in L2; it costs an fp32 dQ
 * buffer (B H S D floats) and a few empty CTAs. Measured on the H200 (L2 reported as 60 MiB;
 * kernels v7, benchmarks/PERF_LOG.md), backward ms for R = 1 / 2 / 4 / 8, H = 24, 0.9, G = 64:
 *   S = 64k,  D = 64:  random 40.9 / 41.9 / 43.0 / 45.2   smooth 40.5 / 41.6 / 42.6 / 44.4
 *   S = 64k,  D = 128: random 84.5 / 81.7 / 82.9 / 87.0   smooth 79.1 / 81.1 / 82.9 / 86.8
 *   S = 128k, D = 64:  random 157.5 / 161.7 / 161.5 / 166.4 smooth 159.6 / 159.4 / 161.3 / 166.2
 *   S = 128k, D = 128: random 438.5 / 358.7 / 316.9 / 323.2 smooth 333.9 / 315.8 / 317.4 / 325.2
 *   (G = 32, D = 128: 64k random 172.2 / 149.5 / 152.3 / 160.7; 128k 864 / 695 / 582 / 599)
 * so the split pays once a head's accumulators (S D 8 bytes) exceed the L2, more for scattered
 * lists (concurrent CTAs touch keys all over the head) than for coherent ones (neighbouring
 * groups share keys). Automatic choice: Rmax = the power of two <= S D 8 / (0.5 L2), at most 8;
 * per head (km_scan_kernel) Rmax when its lists are scattered (key-block entries x 64 >
 * 4 x groups x K: ~10 for random lists, ~1.7 for smooth ones at 0.9), else Rmax / 2.
 * DSV_ATTN_RANGES = R (1..16) forces R ranges on every head; "aR" the automatic per-head rule
 * with Rmax = R (for tests). */
struct RangeCfg {
  int rmax;   /* ranges in the grid (blockIdx.y = h * rmax + r) */
  int forced; /* 1: every head uses rmax */
};

static RangeCfg bwd_ranges(const dsv_attn_shape* p) {
  RangeCfg c;
  c.rmax = 1;
  c.forced = 0;
  const char* re = getenv("DSV_ATTN_RANGES");
  if (re && *re) {
    if (*re == 'a') {
      c.rmax = atoi(re + 1);
    } else {
      c.rmax = atoi(re);
      c.forced = 1;
    }
  } else {
    int dev = 0, l2 = 0;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) == cudaSuccess && l2 > 0) {
      const double x = (double)p->seqlen * (double)p->head_dim * 8.0 / (0.5 * (double)l2);
      while (c.rmax < 8 && 2.0 * c.rmax <= x) c.rmax *= 2;
    }
  }
  if (c.rmax < 1) c.rmax = 1;
  if (c.rmax > 16) c.rmax = 16;
  if (p->heads * c.rmax > 65535) c.rmax = 1;
  return c;
}

static int bwd_nranges(const dsv_attn_shape* p) { return bwd_ranges(p).rmax; }

static BwdLayout bwd_layout(const dsv_attn_shape* p) {
  BwdLayout L;
  const int64_t BH = p->batch * p->heads;
  const int64_t S = p->seqlen, D = p->head_dim;
  L.nkb = (S + KB - 1) / KB;
  L.km_enabled = D <= 128;
  L.cap = L.km_enabled ? p->num_groups * (p->kmax < L.nkb ? p->kmax : L.nkb) : 0;
  size_t o = 0;
  L.delta = o; o = align_up(o + (size_t)BH * S * sizeof(float));
  L.dkacc = o; o = align_up(o + (size_t)BH * S * D * sizeof(float));
  L.dvacc = o; o = align_up(o + (size_t)BH * S * D * sizeof(float));
  L.dqacc = o; o = align_up(o + (bwd_nranges(p) > 1 ? (size_t)BH * S * D * sizeof(float) : 0));
  L.entmask = o; o = align_up(o + (size_t)BH * L.cap * sizeof(unsigned long long));
  L.entg = o; o = align_up(o + (size_t)BH * L.cap * sizeof(int));
  L.kboff = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  /* zeroed together: */
  L.path = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.flags = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.nrh = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.kbcount = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.kbcursor = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.total = o;
  return L;
}

template <typename T>
struct BwdParams {
  const T* q;
  const T* k;
  const T* v;
  const T* out;
  const T* dout;
  const float* lse;
  T* dq;
  T* dk;
  T* dv;
  int64_t qb, qs, qh, kb, ks, kh, vb, vs, vh, ob, os, oh, gb, gs, gh;
  int64_t dqb, dqs, dqh, dkb, dks, dkh, dvb, dvs, dvh;
  const int* kv_index;
  const int* kv_count;
  float* delta;   /* [B, H, S] */
  float* dkacc;   /* [B, H, S, D] */
  float* dvacc;   /* [B, H, S, D] */
  float* dqacc;   /* [B, H, S, D], used when nranges > 1 */
  int* path;      /* [B, H] */
  int* flags;     /* [B, H] */
  int* nrh;       /* [B, H] key ranges of each query-major head (<= nranges) */
  int* kbcount;   /* [B, H, nkb] */
  int* kbcursor;  /* [B, H, nkb] */
  int* kboff;     /* [B, H, nkb] */
  int* entg;      /* [B, H, cap] */
  unsigned long long* entmask;
  int S, H, G, NG, kmax, chunks, nkb, D;
  int nranges; /* key ranges in the grid of the query-major reduction path (bwd_qmajor_kernel) */
  int ranges_forced; /* every head uses nranges (else km_scan_kernel picks per head) */
  int64_t cap;
  float scale, scale_log2, km_ratio;
  int km_enabled;
};

__device__ __forceinline__ int clamp_count(int c, int kmax) {
  return c < 0 ? 0 : (c > kmax ? kmax : c);
}

/* ---------------------------------------------------------------------------------------- */
/* delta[b, h, s] = sum_d dout * out (fp32). One warp per (b, s, h) row. */
template <typename T>
__global__ void bwd_delta_kernel(const BwdParams<T> p, int B) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  const int64_t nrows = (int64_t)B * p.S * p.H;
  if (row >= nrows) return;
  const int h = (int)(row % p.H);
  const int64_t bs = row / p.H;
  const int s = (int)(bs % p.S);
  const int b = (int)(bs / p.S);
  const T* o = p.out + b * p.ob + (int64_t)s * p.os + h * p.oh;
  const T* g = p.dout + b * p.gb + (int64_t)s * p.gs + h * p.gh;
  float acc = 0.f;
  for (int c = lane; c < p.D / 8; c += 32) {
    uint4 ov = *reinterpret_cast<const uint4*>(o + c * 8);
    uint4 gv = *reinterpret_cast<const uint4*>(g + c * 8);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* ge = reinterpret_cast<const T*>(&gv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += Elem<T>::to_float(oe[e]) * Elem<T>::to_float(ge[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) p.delta[((size_t)b * p.H + h) * p.S + s] = acc;
}

/* ---------------------------------------------------------------------------------------- */
/* Transposed index (key-major path). */

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

/* Zero the fp32 accumulators of query-major heads. grid (chunks, B*H). */
template <typename T>
__global__ void zero_acc_kernel(const BwdParams<T> p, int BH) {
  for (int bh = blockIdx.y; bh < BH; bh += gridDim.y) {
    if (p.path[bh] != 0) continue;
    const int64_t n4 = (int64_t)p.S * p.D / 4;
    float4* a = reinterpret_cast<float4*>(p.dkacc + (size_t)bh * p.S * p.D);
    float4* c = reinterpret_cast<float4*>(p.dvacc + (size_t)bh * p.S * p.D);
    float4* e = reinterpret_cast<float4*>(p.dqacc + (size_t)bh * p.S * p.D);
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (int64_t)gridDim.x * blockDim.x) {
      a[i] = z;
      c[i] = z;
      if (p.nranges > 1) e[i] = z;
    }
  }
}

/* Convert the accumulators of query-major heads into dk (times scale) and dv. */
template <typename T>
__global__ void convert_acc_kernel(const BwdParams<T> p, int B) {
  const int CH = p.D / 8;
  const int64_t n = (int64_t)B * p.S * p.H * CH;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int c = (int)(i % CH);
    int64_t r = i / CH;
    const int h = (int)(r % p.H);
    r /= p.H;
    const int s = (int)(r % p.S);
    const int b = (int)(r / p.S);
    const size_t bh = (size_t)b * p.H + h;
    if (p.path[bh] != 0) continue;
    const size_t a = (bh * p.S + s) * p.D + c * 8;
    const float4 k0 = *reinterpret_cast<const float4*>(p.dkacc + a);
    const float4 k1 = *reinterpret_cast<const float4*>(p.dkacc + a + 4);
    const float4 v0 = *reinterpret_cast<const float4*>(p.dvacc + a);
    const float4 v1 = *reinterpret_cast<const float4*>(p.dvacc + a + 4);
    uint4 ko, vo;
    const float sc = p.scale;
    ko.x = Elem<T>::pack(k0.x * sc, k0.y * sc);
    ko.y = Elem<T>::pack(k0.z * sc, k0.w * sc);
    ko.z = Elem<T>::pack(k1.x * sc, k1.y * sc);
    ko.w = Elem<T>::pack(k1.z * sc, k1.w * sc);
    vo.x = Elem<T>::pack(v0.x, v0.y);
    vo.y = Elem<T>::pack(v0.z, v0.w);
    vo.z = Elem<T>::pack(v1.x, v1.y);
    vo.w = Elem<T>::pack(v1.z, v1.w);
    *reinterpret_cast<uint4*>(p.dk + b * p.dkb + (int64_t)s * p.dks + h * p.dkh + c * 8) = ko;
    *reinterpret_cast<uint4*>(p.dv + b * p.dvb + (int64_t)s * p.dvs + h * p.dvh + c * 8) = vo;
    if (p.nranges > 1) {
      const float4 q0 = *reinterpret_cast<const float4*>(p.dqacc + a);
      const float4 q1 = *reinterpret_cast<const float4*>(p.dqacc + a + 4);
      uint4 qo;
      qo.x = Elem<T>::pack(q0.x * sc, q0.y * sc);
      qo.y = Elem<T>::pack(q0.z * sc, q0.w * sc);
      qo.z = Elem<T>::pack(q1.x * sc, q1.y * sc);
      qo.w = Elem<T>::pack(q1.z * sc, q1.w * sc);
      *reinterpret_cast<uint4*>(p.dq + b * p.dqb + (int64_t)s * p.dqs + h * p.dqh + c * 8) = qo;
    }
  }
}

/* ---------------------------------------------------------------------------------------- */
/* Query-major kernel: dQ for every head of its path; with ATOMIC also dK/dV by reductions. */
template <typename T, int D, int BM, int BN, int NS, bool ATOMIC, bool BULK>
__global__ void __launch_bounds__(BM * 2) bwd_qmajor_kernel(const BwdParams<T> p) {
  constexpr int NT = BM * 2, NW = BM / 16;
  constexpr int LD = D + 8;
  constexpr int LDP = BN + 8;
  constexpr int LDF = D + 4; /* fp32 staging rows: 16-byte aligned, float2 stores conflict-free */
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* dOs = Qs + BM * LD;
  T* Ks = dOs + BM * LD;      /* [NS][BN][LD] */
  T* Vs = Ks + NS * BN * LD;  /* [NS][BN][LD] */
  T* Ps = Vs + NS * BN * LD;  /* [BM][LDP], ATOMIC only */
  T* dSs = Ps + (ATOMIC ? BM * LDP : 0);
  float* dVst = reinterpret_cast<float*>(dSs + (ATOMIC ? BM * LDP : 0)); /* [BN][LDF], BULK */
  float* dKst = dVst + (ATOMIC && BULK ? BN * LDF : 0);                  /* [BN][LDF], BULK */
  float* lse2 = dKst + (ATOMIC && BULK ? BN * LDF : 0);                  /* [BM] */
  float* dlt = lse2 + BM;                                                 /* [BM] */
  int* kidx = reinterpret_cast<int*>(dlt + BM);                           /* [NS][BN] */
  int* qidx = kidx + NS * BN;                                             /* [BM] */

  /* With ATOMIC and nranges R > 1, blockIdx.y = h * R + r: the CTA handles only the keys of
   * its group's list in range r of [0, S) (a contiguous run of the sorted list, found by
   * binary search; unsorted lists are masked instead), so the CTAs running at one time touch
   * one range's K, V and dK / dV accumulators, which then stay in L2; dQ is reduced over the
   * ranges with vector reductions into an fp32 buffer. */
  const int RG = ATOMIC ? p.nranges : 1; /* ranges in the grid */
  const int h = blockIdx.y / RG, rr = blockIdx.y - h * RG, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != (ATOMIC ? 0 : 1)) return;
  const int R = ATOMIC ? p.nrh[bh] : 1; /* this head's ranges */
  if (rr >= R) return;
  const int g = blockIdx.x / p.chunks;
  const int chunk = blockIdx.x - g * p.chunks;
  const int row0 = g * p.G + chunk * BM;
  const int row_end = min(g * p.G + p.G, p.S);
  const int nrows = min(BM, row_end - row0);
  if (nrows <= 0) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
  const int count = trim_count<NT>(list, clamp_count(__ldg(p.kv_count + bh), p.kmax));
  const T* kbase = p.k + b * p.kb + h * p.kh;
  const T* vbase = p.v + b * p.vb + h * p.vh;
  int klo = 0, khi = p.S, j0 = 0, j1 = count;
  if (R > 1) {
    const int rlen = (p.S + R - 1) / R;
    klo = rr * rlen;
    khi = min(p.S, klo + rlen);
    if (p.flags[bh] == 0) { /* strictly ascending, in range: binary search */
      int a = 0, e = count;
      while (a < e) {
        const int m = (a + e) >> 1;
        if (__ldg(list + m) < klo) a = m + 1; else e = m;
      }
      j0 = a;
      e = count;
      while (a < e) {
        const int m = (a + e) >> 1;
        if (__ldg(list + m) < khi) a = m + 1; else e = m;
      }
      j1 = a;
    }
    if (j1 <= j0) return; /* nothing of this group in this range (uniform per CTA) */
  }

  for (int r = tid; r < BM; r += NT) {
    const bool valid = r < nrows;
    qidx[r] = valid ? row0 + r : -1;
    float l = valid ? p.lse[bh * p.S + row0 + r] : INFINITY;
    lse2[r] = l == -INFINITY ? INFINITY : l * DSV_LOG2E;
    dlt[r] = valid ? p.delta[bh * p.S + row0 + r] : 0.f;
  }
  __syncthreads();
  gather_rows_async<T, D, NT>(Qs, p.q + b * p.qb + h * p.qh, p.qs, qidx, BM);
  gather_rows_async<T, D, NT>(dOs, p.dout + b * p.gb + h * p.gh, p.gs, qidx, BM);
  const int ntiles = (j1 - j0 + BN - 1) / BN;
  /* NS-stage pipeline, as in the forward (group 0 also holds the Q and dO tiles) */
  PaddedKeyGather<T, D, NT, BN> ix; /* list entries loaded one tile ahead, as in the forward */
  ix.init(kbase, p.ks, vbase, p.vs);
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) {
    if (st < ntiles) {
      ix.load(list, j0 + st * BN, j1);
      ix.issue(Ks + st * BN * LD, Vs + st * BN * LD, klo, khi, kidx + st * BN);
    }
    cp_async_commit();
  }
  ix.load(list, j0 + (NS - 1) * BN, j1);

  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
  const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    __syncthreads(); /* tile t visible to all; stage (t - 1) % NS and Ps / dSs free again */
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        const int nb = tn % NS;
        ix.issue(Ks + nb * BN * LD, Vs + nb * BN * LD, klo, khi, kidx + nb * BN);
        ix.load(list, j0 + (tn + 1) * BN, j1);
      }
      cp_async_commit();
    }
    const T* Kt = Ks + buf * BN * LD;
    const T* Vt = Vs + buf * BN * LD;
    const int* ki = kidx + buf * BN;
    const float ls0 = lse2[lr0], ls1 = lse2[lr1];
    const float dl0 = dlt[lr0], dl1 = dlt[lr1];

    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[4], ga[4];
      load_a<LD>(qa, Qs, warp * 16, kk * 16, lane);
      load_a<LD>(ga, dOs, warp * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t kf[4], vf[4];
        load_b<LD>(kf, Kt, np * 16, kk * 16, lane);
        mma16816<T>(s[2 * np], qa, kf);
        mma16816<T>(s[2 * np + 1], qa, kf + 2);
        load_b<LD>(vf, Vt, np * 16, kk * 16, lane);
        mma16816<T>(dp[2 * np], ga, vf);
        mma16816<T>(dp[2 * np + 1], ga, vf + 2);
      }
    }
    /* P = exp(scale * s - lse), dS = P * (dP - delta) (dS without the scale factor) */
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int col = nt * 8 + (lane & 3) * 2;
      const bool v0 = ki[col] >= 0, v1 = ki[col + 1] >= 0;
      const float p0 = v0 ? fast_exp2(s[nt][0] * p.scale_log2 - ls0) : 0.f;
      const float p1 = v1 ? fast_exp2(s[nt][1] * p.scale_log2 - ls0) : 0.f;
      const float p2 = v0 ? fast_exp2(s[nt][2] * p.scale_log2 - ls1) : 0.f;
      const float p3 = v1 ? fast_exp2(s[nt][3] * p.scale_log2 - ls1) : 0.f;
      s[nt][0] = p0; s[nt][1] = p1; s[nt][2] = p2; s[nt][3] = p3;
      dp[nt][0] = p0 * (dp[nt][0] - dl0);
      dp[nt][1] = p1 * (dp[nt][1] - dl0);
      dp[nt][2] = p2 * (dp[nt][2] - dl1);
      dp[nt][3] = p3 * (dp[nt][3] - dl1);
    }
    /* dQ += dS K */
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t da[4];
      da[0] = Elem<T>::pack(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = Elem<T>::pack(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = Elem<T>::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = Elem<T>::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        uint32_t kf[4];
        load_b_t<LD>(kf, Kt, kk * 16, dd * 16, lane);
        mma16816<T>(dq[2 * dd], da, kf);
        mma16816<T>(dq[2 * dd + 1], da, kf + 2);
      }
    }
    if (ATOMIC) {
      /* stage P and dS (rows = queries, cols = keys) */
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        const int col = nt * 8 + (lane & 3) * 2;
        *reinterpret_cast<uint32_t*>(Ps + lr0 * LDP + col) = Elem<T>::pack(s[nt][0], s[nt][1]);
        *reinterpret_cast<uint32_t*>(Ps + lr1 * LDP + col) = Elem<T>::pack(s[nt][2], s[nt][3]);
        *reinterpret_cast<uint32_t*>(dSs + lr0 * LDP + col) = Elem<T>::pack(dp[nt][0], dp[nt][1]);
        *reinterpret_cast<uint32_t*>(dSs + lr1 * LDP + col) = Elem<T>::pack(dp[nt][2], dp[nt][3]);
      }
      /* the previous tile's bulk reductions must have read the fp32 staging tiles */
      if (BULK) bulk_wait_read0();
      __syncthreads();
      /* units of 16 MTP keys x 32 columns of D: dV_t = P^T dO, dK_t = dS^T Q. A warp's MTP
       * key blocks share the dO / Q fragments (fewer shared-memory reads). */
      constexpr int MT = BN / 16, DC = D / 32;
      constexpr int MTP = (MT % 2 == 0 && (MT / 2) * DC >= NW) ? 2 : 1;
      constexpr int NU = (MT / MTP) * DC;
      float* dva = p.dvacc + bh * (size_t)p.S * D;
      float* dka = p.dkacc + bh * (size_t)p.S * D;
      const int tq = lane & 3;
      for (int u = warp; u < NU; u += NW) {
        const int mp = u / DC, dc = u - mp * DC;
        float av[MTP][4][4], ak[MTP][4][4];
#pragma unroll
        for (int m = 0; m < MTP; ++m)
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) av[m][j][e] = ak[m][j][e] = 0.f;
#pragma unroll
        for (int kq = 0; kq < BM / 16; ++kq) {
          uint32_t bo[2][4], bq[2][4];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            load_b_t<LD>(bo[hh], dOs, kq * 16, dc * 32 + hh * 16, lane);
            load_b_t<LD>(bq[hh], Qs, kq * 16, dc * 32 + hh * 16, lane);
          }
#pragma unroll
          for (int m = 0; m < MTP; ++m) {
            uint32_t pa[4], sa[4];
            load_a_t<LDP>(pa, Ps, kq * 16, (mp * MTP + m) * 16, lane);
            load_a_t<LDP>(sa, dSs, kq * 16, (mp * MTP + m) * 16, lane);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              mma16816<T>(av[m][2 * hh], pa, bo[hh]);
              mma16816<T>(av[m][2 * hh + 1], pa, bo[hh] + 2);
              mma16816<T>(ak[m][2 * hh], sa, bq[hh]);
              mma16816<T>(ak[m][2 * hh + 1], sa, bq[hh] + 2);
            }
          }
        }
#pragma unroll
        for (int m = 0; m < MTP; ++m) {
          const int mt = mp * MTP + m;
          if (BULK) {
            /* fp32 tiles to shared memory, rows = keys */
            const int r0 = mt * 16 + (lane >> 2);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int col = dc * 32 + j * 8 + tq * 2;
              *reinterpret_cast<float2*>(dVst + r0 * LDF + col) = make_float2(av[m][j][0], av[m][j][1]);
              *reinterpret_cast<float2*>(dVst + (r0 + 8) * LDF + col) =
                  make_float2(av[m][j][2], av[m][j][3]);
              *reinterpret_cast<float2*>(dKst + r0 * LDF + col) = make_float2(ak[m][j][0], ak[m][j][1]);
              *reinterpret_cast<float2*>(dKst + (r0 + 8) * LDF + col) =
                  make_float2(ak[m][j][2], ak[m][j][3]);
            }
          } else {
            /* 16-byte reductions straight from registers (pairs of lanes swap halves) */
            const int krow = mt * 16 + (lane >> 2) + ((tq & 1) ? 8 : 0);
            const int kid = ki[krow];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const bool even = (tq & 1) == 0;
              float x0 = __shfl_xor_sync(0xffffffffu, even ? av[m][j][2] : av[m][j][0], 1);
              float x1 = __shfl_xor_sync(0xffffffffu, even ? av[m][j][3] : av[m][j][1], 1);
              float y0 = __shfl_xor_sync(0xffffffffu, even ? ak[m][j][2] : ak[m][j][0], 1);
              float y1 = __shfl_xor_sync(0xffffffffu, even ? ak[m][j][3] : ak[m][j][1], 1);
              const float4 vv = even ? make_float4(av[m][j][0], av[m][j][1], x0, x1)
                                     : make_float4(x0, x1, av[m][j][2], av[m][j][3]);
              const float4 kv = even ? make_float4(ak[m][j][0], ak[m][j][1], y0, y1)
                                     : make_float4(y0, y1, ak[m][j][2], ak[m][j][3]);
              const int col = dc * 32 + j * 8 + (tq >> 1) * 4;
              if (kid >= 0) {
                atomicAdd(reinterpret_cast<float4*>(dva + (size_t)kid * D + col), vv);
                atomicAdd(reinterpret_cast<float4*>(dka + (size_t)kid * D + col), kv);
              }
            }
          }
        }
      }
      if (BULK) {
        /* one bulk reduction per key row of dV and dK (D fp32 each), issued by 2 BN threads */
        fence_proxy_async_smem();
        __syncthreads();
        for (int i = tid; i < 2 * BN; i += NT) {
          const int row = i < BN ? i : i - BN;
          const int kid = ki[row];
          if (kid >= 0)
            bulk_reduce_add_f32((i < BN ? dva : dka) + (size_t)kid * D,
                                (i < BN ? dVst : dKst) + row * LDF, D * sizeof(float));
        }
        bulk_commit();
      }
    }
  }
  if (BULK) bulk_wait_read0(); /* shared memory must stay until the bulk reads are done */
  cp_async_wait<0>();

  if (RG > 1) {
    /* partial dQ of this key range (every head's, once the grid has ranges): 16-byte
     * reductions (pairs of lanes swap halves) */
    float* dqa = p.dqacc + bh * (size_t)p.S * D;
    const int tq = lane & 3;
    const bool even = (tq & 1) == 0;
    const int lrow = even ? lr0 : lr1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const float x0 = __shfl_xor_sync(0xffffffffu, even ? dq[i][2] : dq[i][0], 1);
      const float x1 = __shfl_xor_sync(0xffffffffu, even ? dq[i][3] : dq[i][1], 1);
      const float4 val = even ? make_float4(dq[i][0], dq[i][1], x0, x1)
                              : make_float4(x0, x1, dq[i][2], dq[i][3]);
      if (lrow < nrows)
        atomicAdd(reinterpret_cast<float4*>(dqa + (size_t)(row0 + lrow) * D + i * 8 + (tq >> 1) * 4),
                  val);
    }
    return;
  }

  T* dqb = p.dq + b * p.dqb + h * p.dqh;
  if (lr0 < nrows) {
    T* r = dqb + (int64_t)(row0 + lr0) * p.dqs + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(r + i * 8) =
          Elem<T>::pack(dq[i][0] * p.scale, dq[i][1] * p.scale);
  }
  if (lr1 < nrows) {
    T* r = dqb + (int64_t)(row0 + lr1) * p.dqs + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(r + i * 8) =
          Elem<T>::pack(dq[i][2] * p.scale, dq[i][3] * p.scale);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* Key-major kernel: one CTA per 64-key block of a key-major head; dK, dV in registers. */
template <typename T, int D, int QC>
__global__ void __launch_bounds__(128) bwd_kmajor_kernel(const BwdParams<T> p) {
  constexpr int NT = 128;
  constexpr int LD = D + 8;
  constexpr int CH = D / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw); /* [KB][LD] */
  T* Vs = Ks + KB * LD;                   /* [KB][LD] */
  T* Qs = Vs + KB * LD;                   /* [2][QC][LD] */
  T* dOs = Qs + 2 * QC * LD;              /* [2][QC][LD] */
  float* lse2 = reinterpret_cast<float*>(dOs + 2 * QC * LD); /* [2][QC] */
  float* dlt = lse2 + 2 * QC;                                  /* [2][QC] */
  int* kidx = reinterpret_cast<int*>(dlt + 2 * QC);            /* [KB] */

  const int kblk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != 1) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int key0 = kblk * KB;
  const int nent = p.kbcount[bh * p.nkb + kblk];
  const int eoff = p.kboff[bh * p.nkb + kblk];
  const int* eg = p.entg + bh * p.cap + eoff;
  const unsigned long long* em = p.entmask + bh * p.cap + eoff;
  const int cpg = (p.G + QC - 1) / QC;
  const int nitems = nent * cpg;

  const T* qbase = p.q + b * p.qb + h * p.qh;
  const T* gbase = p.dout + b * p.gb + h * p.gh;
  const float* lrow = p.lse + bh * p.S;
  const float* drow = p.delta + bh * p.S;

  for (int r = tid; r < KB; r += NT) kidx[r] = key0 + r < p.S ? key0 + r : -1;
  __syncthreads();
  gather_rows_async<T, D, NT>(Ks, p.k + b * p.kb + h * p.kh, p.ks, kidx, KB);
  gather_rows_async<T, D, NT>(Vs, p.v + b * p.vb + h * p.vh, p.vs, kidx, KB);

  /* issue the loads of work item `it` (entry it / cpg, query chunk it % cpg) into buffer bf */
  auto issue = [&](int it, int bf) {
    const int e = it / cpg, c = it - e * cpg;
    const int g = __ldg(eg + e);
    const int q0 = g * p.G + c * QC;
    const int qend = min(g * p.G + p.G, p.S);
    T* qt = Qs + bf * QC * LD;
    T* gt = dOs + bf * QC * LD;
    for (int i = tid; i < QC * CH; i += NT) {
      const int r = i / CH, cc = i - r * CH;
      const int row = q0 + r;
      const bool valid = row < qend;
      const T* qs = valid ? qbase + (int64_t)row * p.qs + cc * 8 : qbase;
      const T* gs = valid ? gbase + (int64_t)row * p.gs + cc * 8 : gbase;
      cp_async16(qt + r * LD + cc * 8, qs, valid);
      cp_async16(gt + r * LD + cc * 8, gs, valid);
    }
    for (int r = tid; r < QC; r += NT) {
      const int row = q0 + r;
      const bool valid = row < qend;
      const float l = valid ? lrow[row] : INFINITY;
      lse2[bf * QC + r] = l == -INFINITY ? INFINITY : l * DSV_LOG2E;
      dlt[bf * QC + r] = valid ? drow[row] : 0.f;
    }
  };

  if (nitems > 0) issue(0, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
  const int kr0 = warp * 16 + (lane >> 2), kr1 = kr0 + 8;

  for (int it = 0; it < nitems; ++it) {
    const int bf = it & 1;
    if (it + 1 < nitems) {
      issue(it + 1, bf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const unsigned long long mask = __ldg(em + it / cpg);
    const bool kv0 = (mask >> kr0) & 1ull, kv1 = (mask >> kr1) & 1ull;
    /* a warp whose 16 keys this group did not select has nothing to add: skip its work */
    if (((mask >> (warp * 16)) & 0xFFFFull) != 0ull) {
    const T* Qt = Qs + bf * QC * LD;
    const T* Gt = dOs + bf * QC * LD;
    const float* ls = lse2 + bf * QC;
    const float* dl = dlt + bf * QC;

    float st[QC / 8][4], dpt[QC / 8][4];
#pragma unroll
    for (int i = 0; i < QC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      load_a<LD>(ka, Ks, warp * 16, kk * 16, lane);
      load_a<LD>(va, Vs, warp * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < QC / 16; ++np) {
        uint32_t qf[4], gf[4];
        load_b<LD>(qf, Qt, np * 16, kk * 16, lane);
        mma16816<T>(st[2 * np], ka, qf);
        mma16816<T>(st[2 * np + 1], ka, qf + 2);
        load_b<LD>(gf, Gt, np * 16, kk * 16, lane);
        mma16816<T>(dpt[2 * np], va, gf);
        mma16816<T>(dpt[2 * np + 1], va, gf + 2);
      }
    }
    /* P^T (keys x queries), dS^T */
#pragma unroll
    for (int nt = 0; nt < QC / 8; ++nt) {
      const int col = nt * 8 + (lane & 3) * 2;
      const float l0 = ls[col], l1 = ls[col + 1];
      const float d0 = dl[col], d1 = dl[col + 1];
      const float p0 = kv0 ? fast_exp2(st[nt][0] * p.scale_log2 - l0) : 0.f;
      const float p1 = kv0 ? fast_exp2(st[nt][1] * p.scale_log2 - l1) : 0.f;
      const float p2 = kv1 ? fast_exp2(st[nt][2] * p.scale_log2 - l0) : 0.f;
      const float p3 = kv1 ? fast_exp2(st[nt][3] * p.scale_log2 - l1) : 0.f;
      st[nt][0] = p0; st[nt][1] = p1; st[nt][2] = p2; st[nt][3] = p3;
      dpt[nt][0] = p0 * (dpt[nt][0] - d0);
      dpt[nt][1] = p1 * (dpt[nt][1] - d1);
      dpt[nt][2] = p2 * (dpt[nt][2] - d0);
      dpt[nt][3] = p3 * (dpt[nt][3] - d1);
    }
    /* dV += P^T dO, dK += dS^T Q */
#pragma unroll
    for (int kq = 0; kq < QC / 16; ++kq) {
      uint32_t pa[4], sa[4];
      pa[0] = Elem<T>::pack(st[2 * kq][0], st[2 * kq][1]);
      pa[1] = Elem<T>::pack(st[2 * kq][2], st[2 * kq][3]);
      pa[2] = Elem<T>::pack(st[2 * kq + 1][0], st[2 * kq + 1][1]);
      pa[3] = Elem<T>::pack(st[2 * kq + 1][2], st[2 * kq + 1][3]);
      sa[0] = Elem<T>::pack(dpt[2 * kq][0], dpt[2 * kq][1]);
      sa[1] = Elem<T>::pack(dpt[2 * kq][2], dpt[2 * kq][3]);
      sa[2] = Elem<T>::pack(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1]);
      sa[3] = Elem<T>::pack(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3]);
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        uint32_t bf4[4];
        load_b_t<LD>(bf4, Gt, kq * 16, dd * 16, lane);
        mma16816<T>(dv[2 * dd], pa, bf4);
        mma16816<T>(dv[2 * dd + 1], pa, bf4 + 2);
        load_b_t<LD>(bf4, Qt, kq * 16, dd * 16, lane);
        mma16816<T>(dk[2 * dd], sa, bf4);
        mma16816<T>(dk[2 * dd + 1], sa, bf4 + 2);
      }
    }
    } /* warp has selected keys */
    __syncthreads();
  }
  cp_async_wait<0>();

  const int key_a = key0 + kr0, key_b = key0 + kr1;
  T* dkb = p.dk + b * p.dkb + h * p.dkh;
  T* dvb = p.dv + b * p.dvb + h * p.dvh;
  const int c0 = (lane & 3) * 2;
  if (key_a < p.S) {
    T* rk = dkb + (int64_t)key_a * p.dks + c0;
    T* rv = dvb + (int64_t)key_a * p.dvs + c0;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      *reinterpret_cast<uint32_t*>(rk + i * 8) =
          Elem<T>::pack(dk[i][0] * p.scale, dk[i][1] * p.scale);
      *reinterpret_cast<uint32_t*>(rv + i * 8) = Elem<T>::pack(dv[i][0], dv[i][1]);
    }
  }
  if (key_b < p.S) {
    T* rk = dkb + (int64_t)key_b * p.dks + c0;
    T* rv = dvb + (int64_t)key_b * p.dvs + c0;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      *reinterpret_cast<uint32_t*>(rk + i * 8) =
          Elem<T>::pack(dk[i][2] * p.scale, dk[i][3] * p.scale);
      *reinterpret_cast<uint32_t*>(rv + i * 8) = Elem<T>::pack(dv[i][2], dv[i][3]);
    }
  }
}

/* ---------------------------------------------------------------------------------------- */
/* host side */

template <typename T, int D, int BM, int BN, int NS, bool ATOMIC, bool BULK>
static int launch_qmajor(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  constexpr int LD = D + 8, LDP = BN + 8, LDF = D + 4;
  const size_t smem = (size_t)(2 * BM + 2 * NS * BN) * LD * sizeof(T) +
                      (ATOMIC ? (size_t)2 * BM * LDP * sizeof(T) : 0) +
                      (ATOMIC && BULK ? (size_t)2 * BN * LDF * sizeof(float) : 0) +
                      (size_t)2 * BM * sizeof(float) + (size_t)(NS * BN + BM) * sizeof(int);
  auto kern = bwd_qmajor_kernel<T, D, BM, BN, NS, ATOMIC, BULK>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  prm.chunks = (prm.G + BM - 1) / BM;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)(sh->heads * (ATOMIC ? prm.nranges : 1)),
            (unsigned)sh->batch);
  kern<<<grid, BM * 2, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

/* Key-tile configuration of the query-major kernels for D <= 128: DSV_ATTN_BWD_TILE "32x2"
 * (default), "64x2", "32x3" or "32x4". Measured at S = 64k, D = 128, sparsity 0.9 (kernels v4,
 * same run, v4 reductions): G = 64: 32x2 89.0 ms, 32x3 100.6, 64x2 105.7, 32x4 117.8; G = 32:
 * 32x2 196.2, 32x3 197.3, 64x2 180.7, 32x4 176.1 (run-to-run spread ~10%). */
static int bwd_tile_cfg() {
  const char* e = getenv("DSV_ATTN_BWD_TILE");
  if (e && !strcmp(e, "64x2")) return 0;
  if (e && !strcmp(e, "32x3")) return 1;
  if (e && !strcmp(e, "32x4")) return 2;
  return 3; /* 32x2 */
}

/* How the query-major kernel adds dK / dV into the fp32 accumulators: DSV_ATTN_BWD_REDUCE =
 * "bulk" (default: tiles staged in shared memory, one asynchronous TMA bulk reduction per key
 * row, cp.reduce.async.bulk) or "v4" (red.global.add.v4.f32 from registers; 32x2 tiles only). */
static int bwd_reduce_bulk() {
  const char* e = getenv("DSV_ATTN_BWD_REDUCE");
  return !(e && !strcmp(e, "v4"));
}

template <typename T, int D, int BM, bool ATOMIC>
static int qmajor_cfg(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  constexpr bool B = ATOMIC; /* the bulk form only matters where dK / dV are reduced */
  if (ATOMIC && !bwd_reduce_bulk()) return launch_qmajor<T, D, BM, 32, 2, ATOMIC, false>(sh, prm, stream);
  if constexpr (D > 128) {
    return launch_qmajor<T, D, BM, 32, 2, ATOMIC, B>(sh, prm, stream);
  } else {
    switch (bwd_tile_cfg()) {
      case 0: return launch_qmajor<T, D, BM, 64, 2, ATOMIC, B>(sh, prm, stream);
      case 1: return launch_qmajor<T, D, BM, 32, 3, ATOMIC, B>(sh, prm, stream);
      case 2: return launch_qmajor<T, D, BM, 32, 4, ATOMIC, B>(sh, prm, stream);
      default: return launch_qmajor<T, D, BM, 32, 2, ATOMIC, B>(sh, prm, stream);
    }
  }
}

template <typename T, int D, int QC>
static int launch_kmajor(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  constexpr int LD = D + 8;
  const size_t smem = (size_t)(2 * KB + 4 * QC) * LD * sizeof(T) +
                      (size_t)4 * QC * sizeof(float) + (size_t)KB * sizeof(int);
  auto kern = bwd_kmajor_kernel<T, D, QC>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  dim3 grid((unsigned)prm.nkb, (unsigned)sh->heads, (unsigned)sh->batch);
  kern<<<grid, 128, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

template <typename T, int D>
static int bwd_main(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  int st = DSV_OK;
  /* query-major: dQ of key-major heads (no dK/dV), then dQ + dK/dV reductions of the others */
  int wg = 0; /* wgmma backward (sparse_attention_bwd_wg.cuh): 1 dQ-only pass, 2 both passes */
  if constexpr (D == 64 || D == 128) wg = bwd_wg_mode<T, D>(prm);
  if (prm.G <= 32) {
    if (prm.km_enabled && (st = qmajor_cfg<T, D, 32, false>(sh, prm, stream)) != DSV_OK) return st;
    if ((st = qmajor_cfg<T, D, 32, true>(sh, prm, stream)) != DSV_OK) return st;
  } else {
    if (prm.km_enabled) {
      if constexpr (D == 64 || D == 128)
        if (wg > 0) st = bwd_wg_launch_one<T, D, false>(sh, prm, stream);
      if (wg == 0) st = qmajor_cfg<T, D, 64, false>(sh, prm, stream);
      if (st != DSV_OK) return st;
    }
    if constexpr (D == 64 || D == 128)
      if (wg == 2) st = bwd_wg_launch_reduce<T, D>(sh, prm, stream);
    if (wg < 2) st = qmajor_cfg<T, D, 64, true>(sh, prm, stream);
    if (st != DSV_OK) return st;
  }
  if constexpr (D <= 128) {
    if (prm.km_enabled) {
      if (prm.G % 64 == 0) {
        if ((st = launch_kmajor<T, D, 64>(sh, prm, stream)) != DSV_OK) return st;
      } else {
        if ((st = launch_kmajor<T, D, 32>(sh, prm, stream)) != DSV_OK) return st;
      }
    }
  }
  return DSV_OK;
}

template <typename T>
static int bwd_run(const dsv_attn_shape* sh, dsv_bshd q, dsv_bshd k, dsv_bshd v, dsv_bshd out,
                   dsv_bshd dout, const void* lse, const int32_t* kv_index,
                   const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk, dsv_bshd dv,
                   void* workspace, cudaStream_t stream) {
  const BwdLayout L = bwd_layout(sh);
  char* ws = (char*)workspace;
  BwdParams<T> prm;
  prm.q = (const T*)q.data;
  prm.k = (const T*)k.data;
  prm.v = (const T*)v.data;
  prm.out = (const T*)out.data;
  prm.dout = (const T*)dout.data;
  prm.lse = (const float*)lse;
  prm.dq = (T*)dq.data;
  prm.dk = (T*)dk.data;
  prm.dv = (T*)dv.data;
  prm.qb = q.stride_b; prm.qs = q.stride_s; prm.qh = q.stride_h;
  prm.kb = k.stride_b; prm.ks = k.stride_s; prm.kh = k.stride_h;
  prm.vb = v.stride_b; prm.vs = v.stride_s; prm.vh = v.stride_h;
  prm.ob = out.stride_b; prm.os = out.stride_s; prm.oh = out.stride_h;
  prm.gb = dout.stride_b; prm.gs = dout.stride_s; prm.gh = dout.stride_h;
  prm.dqb = dq.stride_b; prm.dqs = dq.stride_s; prm.dqh = dq.stride_h;
  prm.dkb = dk.stride_b; prm.dks = dk.stride_s; prm.dkh = dk.stride_h;
  prm.dvb = dv.stride_b; prm.dvs = dv.stride_s; prm.dvh = dv.stride_h;
  prm.kv_index = kv_index;
  prm.kv_count = kv_count;
  prm.delta = (float*)(ws + L.delta);
  prm.dkacc = (float*)(ws + L.dkacc);
  prm.dvacc = (float*)(ws + L.dvacc);
  prm.dqacc = (float*)(ws + L.dqacc);
  prm.path = (int*)(ws + L.path);
  prm.flags = (int*)(ws + L.flags);
  prm.nrh = (int*)(ws + L.nrh);
  prm.kbcount = (int*)(ws + L.kbcount);
  prm.kbcursor = (int*)(ws + L.kbcursor);
  prm.kboff = (int*)(ws + L.kboff);
  prm.entg = (int*)(ws + L.entg);
  prm.entmask = (unsigned long long*)(ws + L.entmask);
  prm.S = (int)sh->seqlen;
  prm.H = (int)sh->heads;
  prm.G = (int)sh->group_size;
  prm.NG = (int)sh->num_groups;
  prm.kmax = (int)sh->kmax;
  prm.chunks = 1;
  prm.nkb = (int)L.nkb;
  prm.D = (int)sh->head_dim;
  prm.cap = L.cap;
  prm.scale = (float)sh->scale;
  prm.scale_log2 = (float)(sh->scale * 1.4426950408889634);
  const bool deterministic = (sh->flags & DSV_FLAG_DETERMINISTIC) != 0;
  float ratio = 1.15f;
  const char* env = getenv("DSV_KM_RATIO");
  if (env && *env) ratio = (float)atof(env);
  if (deterministic) ratio = 3.0e38f; /* key-major for every head whose lists allow it */
  prm.km_ratio = ratio;
  prm.km_enabled = L.km_enabled && ratio > 0.f;
  {
    const RangeCfg rc = bwd_ranges(sh);
    /* deterministic: one key range, so that dQ is summed in registers (no fp32 reductions) */
    prm.nranges = deterministic ? 1 : rc.rmax;
    prm.ranges_forced = deterministic ? 1 : rc.forced;
  }

  const int B = (int)sh->batch;
  const int BH = B * prm.H;
  if (cudaMemsetAsync(ws + L.path, 0, L.total - L.path, stream) != cudaSuccess)
    return DSV_ERR_CUDA;
  {
    const int64_t rows = (int64_t)B * prm.S * prm.H;
    const int wpb = 8;
    bwd_delta_kernel<T><<<(unsigned)((rows + wpb - 1) / wpb), wpb * 32, 0, stream>>>(prm, B);
    if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  }
  {
    /* list checks (flags) for every head; counts, offsets and entries for key-major heads */
    dim3 g3((unsigned)prm.NG, (unsigned)prm.H, (unsigned)B);
    km_count_kernel<T><<<g3, 128, 0, stream>>>(prm);
    km_scan_kernel<T><<<(unsigned)BH, 1024, 0, stream>>>(prm);
    if (prm.km_enabled && deterministic) {
      dim3 gf((unsigned)((prm.nkb + 3) / 4), (unsigned)prm.H, (unsigned)B);
      km_fill_ordered_kernel<T><<<gf, 128, 0, stream>>>(prm);
    } else if (prm.km_enabled) {
      km_fill_kernel<T><<<g3, 128, 0, stream>>>(prm);
    }
    if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  }
  {
    /* path stays 0 (memset) where key-major is disabled */
    dim3 gz(64, (unsigned)(BH < 65535 ? BH : 65535));
    zero_acc_kernel<T><<<gz, 256, 0, stream>>>(prm, BH);
    if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  }
  int st;
  switch (sh->head_dim) {
    case 64: st = bwd_main<T, 64>(sh, prm, stream); break;
    case 96: st = bwd_main<T, 96>(sh, prm, stream); break;
    case 128: st = bwd_main<T, 128>(sh, prm, stream); break;
    case 256: st = bwd_main<T, 256>(sh, prm, stream); break;
    default: return DSV_ERR_UNSUPPORTED;
  }
  if (st != DSV_OK) return st;
  {
    const int64_t n = (int64_t)B * prm.S * prm.H * (prm.D / 8);
    int64_t blocks = (n + 255) / 256;
    if (blocks > 132 * 16) blocks = 132 * 16;
    convert_acc_kernel<T><<<(unsigned)blocks, 256, 0, stream>>>(prm, B);
    if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  }
  return DSV_OK;
}

}  // namespace dsv_attn

using namespace dsv_attn;

extern "C" size_t dsv_sparse_attention_bwd_workspace_cuda(const dsv_attn_shape* p) {
  if (check_attn_args(p) != DSV_OK) return 0;
  return bwd_layout(p).total;
}

extern "C" int dsv_sparse_attention_bwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                                             dsv_bshd v, dsv_bshd out, dsv_bshd dout,
                                             const void* lse, const int32_t* kv_index,
                                             const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk,
                                             dsv_bshd dv, void* workspace,
                                             size_t workspace_bytes, void* stream) {
  int st = check_attn_args(p);
  if (st != DSV_OK) return st;
  if (p->batch == 0 || p->seqlen == 0 || p->heads == 0) return DSV_OK;
  if (!check_bshd_aligned(q) || !check_bshd_aligned(k) || !check_bshd_aligned(v) ||
      !check_bshd_aligned(out) || !check_bshd_aligned(dout) || !check_bshd_aligned(dq) ||
      !check_bshd_aligned(dk) || !check_bshd_aligned(dv))
    return DSV_ERR_UNSUPPORTED;
  if (!kv_count || !lse || (p->kmax > 0 && !kv_index)) return DSV_ERR_INVALID;
  if (!workspace || workspace_bytes < bwd_layout(p).total) return DSV_ERR_NOMEM;
  /* deterministic: the key-major path for every head, which exists for head_dim <= 128 */
  if ((p->flags & DSV_FLAG_DETERMINISTIC) && p->head_dim > 128) return DSV_ERR_UNSUPPORTED;
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == DSV_BFLOAT16)
    return bwd_run<__nv_bfloat16>(p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv,
                                  workspace, s);
  return bwd_run<__half>(p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv, workspace,
                         s);
}
