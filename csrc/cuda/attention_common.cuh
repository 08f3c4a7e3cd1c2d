/*
 * attention_common.cuh - device helpers shared by the sparse grouped attention kernels
 * (sparse_attention_fwd.cu, sparse_attention_bwd.cu).
 *
 * Tensor-core path: mma.sync.m16n8k16 (bf16 / fp16 inputs, fp32 accumulation), operands staged
 * in shared memory with cp.async (16-byte chunks) and read with ldmatrix (the PTX wrappers:
 * ptx.cuh). Shared-memory tiles
 * of D-element rows are padded by 8 elements (16 bytes) per row, which makes the 8 row
 * addresses of every ldmatrix fall into 8 distinct bank groups for D in {64, 96, 128, 256}.
 *
 * Fragment layouts of m16n8k16 (lane = threadIdx.x % 32, r = lane / 4, c = (lane % 4) * 2):
 *   A (16x16, row-major): a0 = (r, c..c+1), a1 = (r+8, c..), a2 = (r, c+8..), a3 = (r+8, c+8..)
 *   B (16x8, "col"):      b0 = (k = c..c+1, n = r), b1 = (k = c+8.., n = r)
 *   C (16x8):             c0,c1 = (r, c..c+1), c2,c3 = (r+8, c..c+1)
 */
#ifndef DSV_ATTENTION_COMMON_CUH
#define DSV_ATTENTION_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dsv.h"
#include "ptx.cuh"

#define DSV_LOG2E 1.4426950408889634f
#define DSV_LN2 0.6931471805599453f

namespace dsv_attn {

/* ---------------------------------------------------------------------------------------- */
/* element types */

template <typename T> struct Elem;
template <> struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Elem<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

/* Row-major tile in shared memory, R rows of D elements padded to D + 8. Fragment loaders:
 *  load_a(frag, tile, r0, c0):   A fragment of the 16x16 block at (r0, c0), tile is [m][k]
 *  load_a_t(frag, tile, r0, c0): A fragment of the transposed tile: A(m, k) = tile[k][m],
 *                                block rows m0 = c0 .. c0+15 (tile cols), k0 = r0 .. r0+15
 *  load_b(frag, tile, n0, k0):   B fragments of two n8 tiles (n0, n0+8), k0..k0+15,
 *                                tile is [n][k]  (b for tile n0 in frag[0..1], n0+8 in [2..3])
 *  load_b_t(frag, tile, k0, n0): same but the tile is [k][n]
 */
template <int LD>
__device__ __forceinline__ void load_a(uint32_t* f, const void* tile, int r0, int c0, int lane) {
  const char* base = (const char*)tile;
  int r = r0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  int c = c0 + (lane >> 4) * 8;
  ldsm_x4(f, smem_u32(base + ((size_t)r * LD + c) * 2));
}
template <int LD>
__device__ __forceinline__ void load_a_t(uint32_t* f, const void* tile, int k0, int m0, int lane) {
  const char* base = (const char*)tile;
  int k = k0 + (lane & 7) + (lane >> 4) * 8;
  int m = m0 + ((lane >> 3) & 1) * 8;
  ldsm_x4_t(f, smem_u32(base + ((size_t)k * LD + m) * 2));
}
template <int LD>
__device__ __forceinline__ void load_b(uint32_t* f, const void* tile, int n0, int k0, int lane) {
  const char* base = (const char*)tile;
  int n = n0 + (lane & 7) + (lane >> 4) * 8;
  int k = k0 + ((lane >> 3) & 1) * 8;
  ldsm_x4(f, smem_u32(base + ((size_t)n * LD + k) * 2));
}
template <int LD>
__device__ __forceinline__ void load_b_t(uint32_t* f, const void* tile, int k0, int n0, int lane) {
  const char* base = (const char*)tile;
  int k = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  int n = n0 + (lane >> 4) * 8;
  ldsm_x4_t(f, smem_u32(base + ((size_t)k * LD + n) * 2));
}

/* Element offset of the 16-byte chunk c of row r in a tile of R rows of D 16-bit elements:
 * padded rows (stride D + 8, for ldmatrix) or, with SWZ, the 128-byte-swizzled layout of the
 * wgmma kernels (wgmma.cuh: D / 64 column blocks of R rows x 64 elements, chunk c of row r at
 * block c / 8, position (c % 8) ^ (r % 8)). */
template <int D, int R, bool SWZ>
__device__ __forceinline__ int tile_off(int r, int c) {
  if constexpr (SWZ) return (c >> 3) * (R * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
  else return r * (D + 8) + c * 8;
}

/* Gather `rows` rows of D elements into a tile of R rows (padded, or swizzled with SWZ): row r
 * is base + ridx[r] * stride_s (elements), or zeros when ridx[r] < 0. All NT threads of the
 * block take part. */
template <typename T, int D, int NT, int R = 0, bool SWZ = false>
__device__ __forceinline__ void gather_rows_async(T* tile, const T* base, int64_t stride_s,
                                                  const int* ridx, int rows) {
  constexpr int CH = D / 8; /* 16-byte chunks per row */
  for (int i = threadIdx.x; i < rows * CH; i += NT) {
    int r = i / CH, c = i - r * CH;
    int idx = ridx[r];
    bool valid = idx >= 0;
    const T* src = valid ? base + (int64_t)idx * stride_s + c * 8 : base;
    cp_async16(tile + tile_off<D, R, SWZ>(r, c), src, valid);
  }
}

/* Key j of a list (the caller keeps j below the list's key count). BLK = 1: token lists, key j
 * is entry j (a key position, checked by the gathers). BLK > 1 (kv_block 16 or 64): entry e
 * covers the BLK keys e BLK .. e BLK + BLK - 1, key j is key j % BLK of block list[j / BLK]; a
 * negative entry, or one so large that its keys pass INT32_MAX, gives -1; keys at or past S are
 * masked by the gathers' range check like any position outside [0, S). BLK is a power of two,
 * so j / BLK and j % BLK are a shift and a mask; the rows of a tile that share a block read the
 * same entry (one address: an L1 hit after the first) and are contiguous rows of K and V. */
template <int BLK>
__device__ __forceinline__ int list_key(const int* list, int j) {
  if constexpr (BLK == 1) {
    return __ldg(list + j);
  } else {
    static_assert((BLK & (BLK - 1)) == 0, "kv_block is a power of two");
    const int e = __ldg(list + ((unsigned)j / BLK));
    return (unsigned)e <= (unsigned)(0x7fffffff / BLK) ? e * BLK + (int)((unsigned)j % BLK) : -1;
  }
}

/* List entries of one key tile, held in registers so that they can be loaded one tile ahead:
 * the tile loops load the entries of tile t + NS right after issuing the copies of tile
 * t + NS - 1, so the global load's latency overlaps a tile of compute instead of stalling the
 * copy issue (Nsight Compute showed 39% of the forward's issue stalls waiting on these loads
 * when each gather read its entries just before using them). Thread tid holds the entries of
 * the rows (tid + k NT) / CH, k < N, which are the rows its chunks in gather_keys_pre copy. */
template <int D, int NT, int BN, int BLK = 1>
struct KeyTileIdx {
  static constexpr int CH = D / 8;
  static constexpr int N = (BN * CH + NT - 1) / NT;
  int v[N];
  /* keys j0 .. j0 + BN - 1 of the list (list_key); keys at or past `end` become -1 (no load) */
  __device__ __forceinline__ void load(const int* list, int j0, int end) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int i = threadIdx.x + k * NT;
      const int j = j0 + i / CH;
      v[k] = (i < BN * CH && j < end) ? list_key<BLK>(list, j) : -1;
    }
  }
};

/* Gather a padded key tile with its list entries already in registers (KeyTileIdx::load);
 * positions outside [lo, hi) become zero rows, kidx[r] records each row's position or -1. */
template <typename T, int D, int NT, int BN, int BLK>
__device__ __forceinline__ void gather_keys_pre(T* ktile, T* vtile, const T* kbase,
                                                int64_t kstride, const T* vbase, int64_t vstride,
                                                const KeyTileIdx<D, NT, BN, BLK>& ix, int lo,
                                                int hi, int* kidx) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int k = 0; k < KeyTileIdx<D, NT, BN, BLK>::N; ++k) {
    const int i = threadIdx.x + k * NT;
    if ((BN * CH) % NT != 0 && i >= BN * CH) break;
    const int r = i / CH, c = i - r * CH;
    int idx = ix.v[k];
    if (idx < lo || idx >= hi) idx = -1;
    if (c == 0) kidx[r] = idx;
    const bool valid = idx >= 0;
    const T* ks = valid ? kbase + (int64_t)idx * kstride + c * 8 : kbase;
    const int off = tile_off<D, BN, false>(r, c);
    cp_async16(ktile + off, ks, valid);
    if (vtile) {
      const T* vs = valid ? vbase + (int64_t)idx * vstride + c * 8 : vbase;
      cp_async16(vtile + off, vs, valid);
    }
  }
}

/* Key-tile gather in which each thread copies one fixed 16-byte chunk c = tid % CH of the rows
 * r0 + k RS (r0 = tid / CH, RS = NT / CH, k < N), so that its destination offsets and list
 * positions are fixed and computed once per kernel instead of once per tile (the wgmma forward
 * is issue-bound: the generic loop of gather_keys_pre cost it ~290 instructions per tile and
 * warp, mostly 64-bit address arithmetic). RS is a multiple of 8 (KeyGatherFits), so row
 * r0 + k RS keeps the swizzle phase of row r0 and lies k RS rows further. A row's address is one
 * 32 x 32 -> 64-bit multiply-add when the row strides are below 4 GB (the caller checks), or
 * two with WIDE. load() reads the list entries of a tile one tile ahead (as KeyTileIdx; with
 * BLK > 1 the keys of block lists, list_key);
 * issue() copies the K and V rows (entries outside [lo, hi) give zero rows) and records each
 * row's mask: MaskT float: 0 or -inf (a score bias), int: the position or -1. KM > 0: packed
 * entries (merged groups, merged_groups.cuh): the key is entry & KM, and the int
 * mask records the whole entry. Rows wider than the threads cover 8 at a time (D 256 with 128
 * threads, swizzled tiles only: KeyGatherWide) give each thread CPT chunks of a row, c and
 * c + TPR ..., TPR / 8 column blocks apart in the tile and at the same swizzle phase. */
template <int D, int NT, int BN>
struct KeyGatherFits {
  static constexpr int CH = D / 8, RS = NT / CH;
  static constexpr bool value = NT % CH == 0 && RS % 8 == 0 && BN % RS == 0;
};
template <int D, int NT, int BN>
struct KeyGatherWide {
  static constexpr int CH = D / 8, TPR = NT / 8, CPT = CH / TPR, RS = 8;
  static constexpr bool value = NT % 64 == 0 && CH % TPR == 0 && CPT > 1 && BN % RS == 0;
};

template <typename T, int D, int NT, int BN, bool SWZ, typename MaskT = float, bool WIDE = false,
          int BLK = 1, int KM = 0>
struct KeyGather {
  static_assert(KM == 0 || (BLK == 1 && sizeof(MaskT) == sizeof(int) && (MaskT)0.5f == 0),
                "packed entries: token lists, int masks");
  static constexpr bool W = !KeyGatherFits<D, NT, BN>::value;
  static_assert(!W || (SWZ && KeyGatherWide<D, NT, BN>::value),
                "one chunk per thread and row, or several of a swizzled tile's rows");
  static constexpr int CH = D / 8;
  static constexpr int CPT = W ? KeyGatherWide<D, NT, BN>::CPT : 1; /* chunks per thread and row */
  static constexpr int TPR = CH / CPT;                               /* threads per row */
  static constexpr int RS = NT / TPR, N = BN / RS;
  static constexpr int ROW = SWZ ? 64 : D + 8; /* elements from row r to row r + 1 in a block */
  /* elements from a thread's chunk i to chunk i + 1: TPR / 8 column blocks of BN rows */
  static constexpr int CSTEP = (TPR / 8) * BN * 64;
  const char* kb;   /* kbase + c * 8 elements */
  const char* vb;
  uint64_t ks, vs;  /* row strides in bytes */
  int r0, off0;     /* first row, its element offset in the tile */
  bool writer;      /* c == 0: writes the rows' mask entries */
  int v[N];
  __device__ __forceinline__ void init(const T* kbase, int64_t kstride, const T* vbase,
                                       int64_t vstride, int tid = threadIdx.x) {
    const int c = tid % TPR;
    r0 = tid / TPR;
    off0 = tile_off<D, BN, SWZ>(r0, c);
    writer = c == 0;
    kb = reinterpret_cast<const char*>(kbase + c * 8);
    vb = reinterpret_cast<const char*>(vbase + c * 8);
    ks = (uint64_t)kstride * sizeof(T);
    vs = (uint64_t)vstride * sizeof(T);
  }
  /* keys j0 .. j0 + BN - 1 (j0 a multiple of BN) */
  __device__ __forceinline__ void load(const int* list, int j0, int end) {
    if constexpr (BLK >= BN) {
      /* block lists whose blocks hold whole tiles (BN divides BLK): the thread's rows r0 + k RS
       * are keys of one block, so one entry gives them all, as consecutive positions RS apart
       * (the tile lies below `end` exactly when its first key does) */
      static_assert(BLK % BN == 0, "a tile within one block");
      const int j = j0 + r0;
      const int p0 = j < end ? list_key<BLK>(list, j) : -1;
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = p0 < 0 ? -1 : p0 + k * RS;
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const int j = j0 + r0 + k * RS;
        v[k] = j < end ? list_key<BLK>(list, j) : -1;
      }
    }
  }
  /* ktile, vtile: shared addresses of the stage's K and V tiles */
  __device__ __forceinline__ void issue(uint32_t ktile, uint32_t vtile, int lo, int hi,
                                        MaskT* mask) const {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int key = KM && v[k] >= 0 ? v[k] & KM : v[k];
      const bool valid = (unsigned)key - (unsigned)lo < (unsigned)(hi - lo);
      const uint32_t row = valid ? (uint32_t)key : 0u;
      if (writer) {
        if constexpr (sizeof(MaskT) == sizeof(float) && (MaskT)0.5f != 0)
          mask[r0 + k * RS] = valid ? 0.f : -INFINITY;
        else
          mask[r0 + k * RS] = valid ? v[k] : -1;
      }
      const uint32_t so = (uint32_t)(off0 + k * RS * ROW) * (uint32_t)sizeof(T);
      const uint64_t ko = WIDE ? (uint64_t)row * ks : (uint64_t)row * (uint32_t)ks;
      const uint64_t vo = WIDE ? (uint64_t)row * vs : (uint64_t)row * (uint32_t)vs;
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
        const uint32_t si = so + (uint32_t)(i * CSTEP * (int)sizeof(T));
        const uint32_t gi = (uint32_t)(i * TPR * 8 * (int)sizeof(T));
        cp_async16_s(ktile + si, kb + ko + gi, valid);
        cp_async16_s(vtile + si, vb + vo + gi, valid);
      }
    }
  }
};

/* Gather of padded key tiles (ldmatrix kernels) with int masks and any strides: KeyGather where
 * its fixed per-thread plan fits (D 64 or 128 with 128 threads), else KeyTileIdx +
 * gather_keys_pre. Same interface: init once, load one tile ahead, issue. */
template <typename T, int D, int NT, int BN, int BLK = 1,
          bool FIXED = KeyGatherFits<D, NT, BN>::value>
struct PaddedKeyGather {
  KeyGather<T, D, NT, BN, false, int, true, BLK> g;
  __device__ __forceinline__ void init(const T* kbase, int64_t ks, const T* vbase, int64_t vs) {
    g.init(kbase, ks, vbase, vs);
  }
  __device__ __forceinline__ void load(const int* list, int j0, int end) { g.load(list, j0, end); }
  __device__ __forceinline__ void issue(T* ktile, T* vtile, int lo, int hi, int* kidx) const {
    g.issue(smem_u32(ktile), smem_u32(vtile), lo, hi, kidx);
  }
};
template <typename T, int D, int NT, int BN, int BLK>
struct PaddedKeyGather<T, D, NT, BN, BLK, false> {
  KeyTileIdx<D, NT, BN, BLK> ix;
  const T* kb;
  const T* vb;
  int64_t ks, vs;
  __device__ __forceinline__ void init(const T* kbase, int64_t kstride, const T* vbase,
                                       int64_t vstride) {
    kb = kbase;
    vb = vbase;
    ks = kstride;
    vs = vstride;
  }
  __device__ __forceinline__ void load(const int* list, int j0, int end) { ix.load(list, j0, end); }
  __device__ __forceinline__ void issue(T* ktile, T* vtile, int lo, int hi, int* kidx) const {
    gather_keys_pre<T, D, NT, BN>(ktile, vtile, kb, ks, vb, vs, ix, lo, hi, kidx);
  }
};

/* A list's length without its trailing negative entries: the -1 padding of lists shorter than
 * kv_count (query rows padded with all -1 lists, lists of fewer valid keys). Negative entries
 * are skipped anyway; trimming them saves their tiles. A CTA-wide backward scan, NT entries at
 * a time, stopping at the first chunk that holds a valid entry (for a full list: one chunk).
 * Every thread of the CTA must call it; all get the result. */
template <int NT>
__device__ __forceinline__ int trim_count(const int* list, int count) {
  __shared__ int s_last;
  for (int end = count; end > 0; end -= NT) {
    const int j = end - 1 - (int)threadIdx.x;
    const bool ok = j >= 0 && __ldg(list + j) >= 0;
    if (__syncthreads_or(ok)) {
      if (threadIdx.x == 0) s_last = -1;
      __syncthreads();
      if (ok) atomicMax(&s_last, j);
      __syncthreads();
      const int n = s_last + 1;
      __syncthreads(); /* s_last may be reused by the next call */
      return n;
    }
  }
  return 0;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

/* A list's count clamped to [0, kmax] (kv_count is the caller's: any value). */
__device__ __forceinline__ int clamp_count(int c, int kmax) {
  return c < 0 ? 0 : (c > kmax ? kmax : c);
}

/* First position in [a, e) of an ascending list whose entry is >= key (e if none): the part of a
 * group's list inside one key range of the query-major backward, or inside one window of the
 * union builder (merged_groups.cuh). KM > 0: packed entries, the key is entry & KM. */
template <int KM = 0>
__device__ __forceinline__ int list_lower_bound(const int* list, int a, int e, int key) {
  while (a < e) {
    const int m = (a + e) >> 1;
    const int x = __ldg(list + m);
    if ((KM ? x & KM : x) < key) a = m + 1; else e = m;
  }
  return a;
}

/* ---------------------------------------------------------------------------------------- */
/* host-side helpers */

static inline int check_bshd_aligned(dsv_bshd t) {
  /* Rows are read with 16-byte vectors: base 16-byte aligned and strides multiples of 8. */
  if (((uintptr_t)t.data & 15u) != 0) return 0;
  if ((t.stride_b & 7) || (t.stride_s & 7) || (t.stride_h & 7)) return 0;
  return 1;
}

static inline int clamp_count_host(int64_t c, int64_t kmax) {
  return (int)(c < 0 ? 0 : (c > kmax ? kmax : c));
}

}  // namespace dsv_attn

#endif /* DSV_ATTENTION_COMMON_CUH */
