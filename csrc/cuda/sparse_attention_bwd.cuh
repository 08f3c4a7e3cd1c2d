/*
 * sparse_attention_bwd.cuh - what the files of the sparse attention backward share (internal):
 * the kernels' parameters (BwdParams) and the launchers of each part, called in this order by
 * the host dispatch (sparse_attention_bwd.cu):
 *   index building     sparse_attention_bwd_index.cu   key-major (transposed) index, path choice
 *   query-major pass   sparse_attention_bwd_qmajor.cu  dQ; dK / dV by reductions (mma.sync, wgmma)
 *   key-major pass     sparse_attention_bwd_kmajor.cu  dK / dV in registers per 64-key block
 * How the backward works, and which head takes which path: sparse_attention_bwd.cu.
 */
#ifndef DSV_SPARSE_ATTENTION_BWD_CUH
#define DSV_SPARSE_ATTENTION_BWD_CUH

#include "attention_common.cuh"
#include "merged_groups.cuh"
#include "tuning.h"

namespace dsv_attn {

constexpr int KB = 64; /* key block of the key-major path */

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
  /* block lists (kv_block > 1) */
  int blk;        /* keys per list entry: 1, 16 or 64 */
  int* bsorted;   /* [B, H, NG, kmax] each list's valid entries, ascending (duplicates kept) */
  int* bnsorted;  /* [B, H, NG] how many */
  int g128;       /* the tuning's g128: groups of a multiple of 128 rows on bwd_wg128_kernel */
  int qm_wgmma;   /* the tuning's qm_wgmma: the other groups' dK / dV pass on bwd_wg_kernel */
  /* merged groups (the tuning's merge, merged_groups.cuh; built by union_build_kernel, run by
   * bwd_wg128_kernel): the groups of G = 16, 32 or 64 queries of each 128-query block u run as
   * one 128-row CTA over the union of their lists where it is short enough */
  int* uidx;      /* [B, H, NSG, ucap] block u's union, ascending: key | member mask << UKEY_BITS
                     (bit m: group M u + m selected the key); nullptr: no merging */
  int* ucnt;      /* [B, H, NSG] entries of the union; -1: the block's groups run separately */
  int* knf;       /* [B, H] 1: the head has a non-finite q, k or dout element (nothing merged) */
  int NSG, ucap;  /* 128-query blocks (ceil(S / 128)); union capacity per block */
  int ug;         /* the group size of the merged groups (bwd_wg128_kernel's launch) */
  float merge;    /* the tuning's merge */
};


/* Each thread's two query rows (row0 + lr0, row0 + lr1: the accumulator rows of its lane) of dQ
 * (scaled), written in the input dtype; rows past nrows are not written. The query-major
 * kernels end here when dQ is not reduced across key ranges. */
template <typename T, int D>
__device__ __forceinline__ void dq_store(const BwdParams<T>& p, int b, int h, int row0, int lr0, int lr1,
                                         int nrows, int lane, const float (&dq)[D / 8][4]) {
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

/* The query-major wgmma kernels' common steps (sparse_attention_bwd_wg.cuh; bwd_qmajor_kernel has
 * the same steps inline: moving it onto these changed its machine code). */

/* A query-major CTA's place in the grid (blockIdx.x = group x chunks + chunk of BM rows,
 * blockIdx.y = head x RG + key range, blockIdx.z = batch) and its rows [row0, row0 + nrows) of
 * group g. */
struct QmajorCta {
  int b, h, rr, R, g, row0, nrows;
  size_t bh;
};

/* Fills c; false when the CTA has nothing to do (uniform per CTA): its head is not on path
 * `path` (0 query-major dK / dV, 1 key-major), the head uses fewer key ranges than rr + 1 (the
 * head's count with `ranges`, else 1), or the chunk is past a partial last group's end. */
template <int BM, typename Prm>
__device__ __forceinline__ bool qmajor_cta(const Prm& p, int RG, int path, bool ranges,
                                           QmajorCta& c) {
  c.h = blockIdx.y / RG, c.rr = blockIdx.y - c.h * RG, c.b = blockIdx.z;
  c.bh = (size_t)c.b * p.H + c.h;
  if (p.path[c.bh] != path) return false;
  c.R = ranges ? p.nrh[c.bh] : 1;
  if (c.rr >= c.R) return false;
  c.g = blockIdx.x / p.chunks;
  const int chunk = blockIdx.x - c.g * p.chunks;
  c.row0 = c.g * p.G + chunk * BM;
  c.nrows = min(BM, min(c.g * p.G + p.G, p.S) - c.row0);
  return c.nrows > 0;
}

/* The keys and list entries of key range rr (of R) of a head's query-major pass: keys [klo,
 * khi), entries [j0, j1) of the group's list (count entries, BLK keys each). One range: the whole
 * list; several: a binary search where the head's list is strictly ascending and in range
 * (flags 0), else the whole list with the keys outside the range masked by the gathers. false:
 * nothing of the group in this range (uniform per CTA). */
template <int BLK, int KM = 0, typename Prm>
__device__ __forceinline__ bool qmajor_range(const Prm& p, size_t bh, const int* list, int count,
                                             int R, int rr, int& klo, int& khi, int& j0, int& j1) {
  klo = 0, khi = p.S, j0 = 0, j1 = count * BLK;
  if (R > 1) {
    const int rlen = (p.S + R - 1) / R;
    klo = rr * rlen;
    khi = min(p.S, klo + rlen);
    if (p.flags[bh] == 0) { /* strictly ascending, in range: binary search */
      j0 = list_lower_bound<KM>(list, 0, count, klo);
      j1 = list_lower_bound<KM>(list, j0, count, khi);
    }
    if (j1 <= j0) return false;
  }
  return true;
}

/* The CTA's BM query rows [row0, row0 + nrows): their positions (-1 past nrows), lse in base 2
 * (+inf for an empty row's -inf, so that its P is 0) and delta, into shared memory. */
template <int BM, int NT, typename Prm>
__device__ __forceinline__ void qmajor_rows(const Prm& p, size_t bh, int row0, int nrows,
                                            int* qidx, float* lse2, float* dlt) {
  for (int r = threadIdx.x; r < BM; r += NT) {
    const bool valid = r < nrows;
    qidx[r] = valid ? row0 + r : -1;
    const float l = valid ? p.lse[bh * p.S + row0 + r] : INFINITY;
    lse2[r] = l == -INFINITY ? INFINITY : l * DSV_LOG2E;
    dlt[r] = valid ? p.delta[bh * p.S + row0 + r] : 0.f;
  }
}

/* Index building (sparse_attention_bwd_index.cu): list checks (flags) and the path and key
 * ranges of every head; counts, offsets and (group, mask) entries of key-major heads. */
template <typename T>
int bwd_index_launch(BwdParams<T>& prm, int B, bool deterministic, cudaStream_t stream);

/* Query-major passes (sparse_attention_bwd_qmajor.cu): dQ of the key-major heads, then dQ and
 * the dK / dV reductions of the others; wgmma: the tuning's choice of the Hopper kernels. */
template <typename T>
int bwd_qmajor_launch(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma, cudaStream_t stream);

/* Block lists (kv_block 16 or 64, sparse_attention_bwd_index.cu): the lists sorted, then the
 * key-major (group, mask) entries of every 64-key block in ascending group order, all heads on
 * the key-major path. */
template <typename T>
int bwd_blocks_index_launch(BwdParams<T>& prm, int B, cudaStream_t stream);

/* dQ of block lists (sparse_attention_bwd_qmajor.cu), head_dim <= 128; wgmma as for
 * bwd_qmajor_launch. */
template <typename T>
int bwd_blocks_dq_launch(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                         cudaStream_t stream);

/* The most entries of a block list the backward sorts (in shared memory: 4 bytes each). */
constexpr int BLK_SORT_MAX = 16384;

/* Key-major pass (sparse_attention_bwd_kmajor.cu), head_dim <= 128; wgmma: the tuning's
 * km_wgmma where its wgmma is on, else 0 (1: the wgmma kernel where it applies, D 64 / 128,
 * G >= 64, not 16-key block lists; 2: 16-key block lists too). */
template <typename T>
int bwd_kmajor_launch(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                      cudaStream_t stream);

}  // namespace dsv_attn

#endif /* DSV_SPARSE_ATTENTION_BWD_CUH */
