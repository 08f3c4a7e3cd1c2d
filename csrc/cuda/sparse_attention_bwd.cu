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
 *    while the reductions drain (it overlaps better than 16-byte red.global.add.v4.f32 from
 *    registers, kept in csrc/dev/). Where a head's accumulators exceed the L2 (long sequences)
 *    the keys are split into R ranges handled by separate CTAs, so that the CTAs running at one
 *    time touch 1/R of a head's K, V and accumulators; dQ is then reduced over ranges in fp32
 *    too (bwd_ranges: R per head from the L2 size and how scattered the head's lists are).
 *  Trailing -1 entries of a list (padding) are trimmed first (trim_count), in every path.
 *  Merged groups (the tuning's merge, groups of 16, 32 or 64 queries on the 128-row kernels):
 *    where the lists of the M = 128 / G groups of a 128-query block overlap, one 128-row CTA
 *    (bwd_wg128_kernel) walks the union of their lists, each row's scores masked to its own
 *    group's keys, and reduces each key once per 128 rows instead of once per group
 *    (merged_groups.cuh: union_build_kernel decides per block; PERF_LOG v26).
 *
 * A head takes path 1 when its lists are strictly ascending and in range (as topk_estimate
 * writes them), D <= 128, and (key-block entries x 64) <= ratio x (groups x K); the ratio is the
 * device tuning's km_ratio (tuning.cu: the measured crossover; 0 forces path 0, a large value
 * path 1 where allowed). Deterministic mode (DSV_FLAG_DETERMINISTIC in dsv_attn_shape.flags): every head
 * whose lists allow it takes path 1, its (group, mask) entries filled in ascending group order
 * (km_fill_ordered_kernel: a ballot scan, not atomic positions), and one key range, so dQ is
 * summed in registers too: no float atomics, bit-identical results run to run. (With ranges
 * R > 1 the default path sums dQ over the ranges with fp32 reductions in an arbitrary order.)
 * Key tiles of the query-major kernels: 32 keys x 2 cp.async stages. On H100 / H200 the dQ-only
 * pass runs on wgmma (sparse_attention_bwd_wg.cuh); the key-major pass does where the tuning's
 * km_wgmma asks for it (D 64 / 128, G >= 64; 1: token lists and 64-key block lists, 2: 16-key
 * block lists too; the default 0 keeps it on mma.sync until measured).
 *
 * Block lists (dsv_attn_shape.kv_block 16 or 64) always take a deterministic path without
 * atomics, whatever the flags: the lists are sorted into the workspace, the key-major index is
 * built from them in ascending group order (sparse_attention_bwd_index.cu), dQ comes from the
 * query-major dQ-only kernel over the list's blocks (list_key) and dK / dV from the key-major
 * kernel, both summing in registers. head_dim <= 128 (else DSV_ERR_UNSUPPORTED).
 *
 * Files: this one is the host dispatch (workspace layout, key ranges, the order of the passes)
 * with the small element-wise kernels (delta, zeroing and converting the accumulators);
 * sparse_attention_bwd_index.cu builds the key-major index and picks each head's path,
 * sparse_attention_bwd_qmajor.cu and sparse_attention_bwd_kmajor.cu hold the two passes.
 */
#include "sparse_attention_bwd.cuh"

namespace dsv_attn {

int check_attn_args(const dsv_attn_shape* p); /* sparse_attention_fwd.cu */


struct BwdLayout {
  size_t delta, dkacc, dvacc, dqacc, path, flags, nrh, kbcount, kbcursor, kboff, entg, entmask, total;
  size_t bsorted, bnsorted; /* block lists only */
  size_t uidx, ucnt, knf;   /* merged groups (ucap > 0) */
  int64_t nkb, cap, nsg, ucap;
  int km_enabled;
};

static size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

/* Key ranges of the query-major reduction path. R ranges make the CTAs running at one time touch
 * 1/R of a head's K, V and fp32 dK, dV accumulators, which then stay in L2; it costs an fp32 dQ
 * buffer (B H S D floats) and a few empty CTAs. The split pays once a head's accumulators
 * (S D 8 bytes) exceed the L2, more for scattered lists (concurrent CTAs touch keys all over the
 * head) than for coherent ones (neighbouring groups share keys; measurements: PERF_LOG v7).
 * Automatic choice: Rmax = the power of two <= S D 8 / (0.5 L2) (twice that for the 64-row
 * wgmma pass), at most 8; per head
 * (km_scan_kernel) Rmax when its lists are scattered (key-block entries x 64 > 4 x groups x K:
 * ~10 for random lists, ~1.7 for smooth ones at 0.9), else Rmax / 2. The tuning's bwd_ranges = R
 * forces R ranges on every head, bwd_rmax = R runs the automatic per-head rule with Rmax = R. */
struct RangeCfg {
  int rmax;   /* ranges in the grid (blockIdx.y = h * rmax + r) */
  int forced; /* 1: every head uses rmax */
};

static RangeCfg bwd_ranges(const dsv_attn_shape* p, const dsv_tuning* t) {
  RangeCfg c;
  c.rmax = 1;
  c.forced = 0;
  if (t->bwd_ranges > 0) {
    c.rmax = t->bwd_ranges;
    c.forced = 1;
  } else if (t->bwd_rmax > 0) {
    c.rmax = t->bwd_rmax;
  } else if (t->l2_bytes > 0) {
    double x = (double)p->seqlen * (double)p->head_dim * 8.0 / (0.5 * (double)t->l2_bytes);
    /* the 64-row pass on wgmma (G = 64, D = 128): one range more measured faster with
     * scattered lists (PERF_LOG v37: 64k 2 -> 4 ranges, 128k 4 -> 8, -3% backward) */
    if (p->group_size == 64 && p->head_dim == 128 && t->wgmma && t->qm_wgmma) x *= 2.0;
    while (c.rmax < 8 && 2.0 * c.rmax <= x) c.rmax *= 2;
  }
  if (c.rmax < 1) c.rmax = 1;
  if (c.rmax > 16) c.rmax = 16;
  if (p->heads * c.rmax > 65535) c.rmax = 1;
  return c;
}

/* Block lists (kv_block > 1): delta, the sorted lists, and the key-major index with one
 * (group, mask) entry per valid list entry at most (cap = groups x kmax); no fp32
 * accumulators. */
static BwdLayout bwd_layout_blocks(const dsv_attn_shape* p) {
  BwdLayout L;
  const int64_t BH = p->batch * p->heads;
  const int64_t S = p->seqlen;
  L.nkb = (S + KB - 1) / KB;
  L.km_enabled = 1;
  L.cap = p->num_groups * p->kmax;
  L.nsg = L.ucap = 0;
  L.uidx = L.ucnt = L.knf = 0;
  size_t o = 0;
  L.dkacc = L.dvacc = L.dqacc = 0;
  L.delta = o; o = align_up(o + (size_t)BH * S * sizeof(float));
  L.entmask = o; o = align_up(o + (size_t)BH * L.cap * sizeof(unsigned long long));
  L.entg = o; o = align_up(o + (size_t)BH * L.cap * sizeof(int));
  L.kboff = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.bsorted = o; o = align_up(o + (size_t)BH * L.cap * sizeof(int));
  L.bnsorted = o; o = align_up(o + (size_t)BH * p->num_groups * sizeof(int));
  /* zeroed together: */
  L.path = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.flags = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.nrh = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.kbcount = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.kbcursor = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.total = o;
  return L;
}

/* What the block-list backward supports beyond check_attn_args: head_dim <= 128 (the key-major
 * pass), lists of at most BLK_SORT_MAX entries (sorted in shared memory), and groups x kmax
 * entries of a head indexed by int. */
static int check_blocks_bwd(const dsv_attn_shape* p) {
  if (p->kv_block == 1) return DSV_OK;
  if (p->head_dim > 128 || p->kmax > BLK_SORT_MAX ||
      p->num_groups * p->kmax > (int64_t)INT32_MAX)
    return DSV_ERR_UNSUPPORTED;
  return DSV_OK;
}

/* Merged groups (the tuning's merge; merged_groups.cuh): where they may run, the capacity of a
 * 128-query block's union, else 0. Token lists, not deterministic (its heads are key-major),
 * the 128-row kernels (wgmma and g128 on, D 64 / 128), and union_capacity's sizes. */
static int64_t bwd_union_capacity(const dsv_attn_shape* p, const dsv_tuning* t) {
  const int64_t G = p->group_size < p->seqlen ? p->group_size : p->seqlen;
  if (!t->wgmma || !t->g128 || p->kv_block != 1 || (p->flags & DSV_FLAG_DETERMINISTIC) ||
      (p->head_dim != 64 && p->head_dim != 128))
    return 0;
  return union_capacity(t->merge, p->seqlen, G, p->kmax);
}

static BwdLayout bwd_layout(const dsv_attn_shape* p, const dsv_tuning* t) {
  if (p->kv_block > 1) return bwd_layout_blocks(p);
  BwdLayout L;
  L.bsorted = L.bnsorted = 0;
  L.nsg = (p->seqlen + 127) / 128;
  L.ucap = bwd_union_capacity(p, t);
  const int64_t BH = p->batch * p->heads;
  const int64_t S = p->seqlen, D = p->head_dim;
  L.nkb = (S + KB - 1) / KB;
  L.km_enabled = D <= 128;
  L.cap = L.km_enabled ? p->num_groups * (p->kmax < L.nkb ? p->kmax : L.nkb) : 0;
  size_t o = 0;
  L.delta = o; o = align_up(o + (size_t)BH * S * sizeof(float));
  L.dkacc = o; o = align_up(o + (size_t)BH * S * D * sizeof(float));
  L.dvacc = o; o = align_up(o + (size_t)BH * S * D * sizeof(float));
  L.dqacc = o; o = align_up(o + (bwd_ranges(p, t).rmax > 1 ? (size_t)BH * S * D * sizeof(float) : 0));
  L.entmask = o; o = align_up(o + (size_t)BH * L.cap * sizeof(unsigned long long));
  L.entg = o; o = align_up(o + (size_t)BH * L.cap * sizeof(int));
  L.kboff = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.uidx = o; o = align_up(o + (size_t)BH * L.nsg * L.ucap * sizeof(int));
  L.ucnt = o; o = align_up(o + (L.ucap ? (size_t)BH * L.nsg * sizeof(int) : 0));
  /* zeroed together: */
  L.path = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.flags = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.nrh = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.knf = o; o = align_up(o + (size_t)BH * sizeof(int));
  L.kbcount = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.kbcursor = o; o = align_up(o + (size_t)BH * L.nkb * sizeof(int));
  L.total = o;
  return L;
}

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

/* The query-major passes' launcher of each dtype: bwd_qmajor_launch ships; csrc/dev/ passes its
 * variants. */
template <typename T>
using BwdQmajorFn = int (*)(const dsv_attn_shape*, BwdParams<T>&, int, cudaStream_t);
struct BwdQmajor {
  BwdQmajorFn<__half> f16;
  BwdQmajorFn<__nv_bfloat16> bf16;
};

template <typename T>
static int bwd_run(const dsv_attn_shape* sh, dsv_bshd q, dsv_bshd k, dsv_bshd v, dsv_bshd out,
                   dsv_bshd dout, const void* lse, const int32_t* kv_index,
                   const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk, dsv_bshd dv,
                   void* workspace, const dsv_tuning* tun, BwdQmajorFn<T> qmajor,
                   cudaStream_t stream) {
  const BwdLayout L = bwd_layout(sh, tun);
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
  prm.bsorted = (int*)(ws + L.bsorted);
  prm.bnsorted = (int*)(ws + L.bnsorted);
  prm.blk = (int)sh->kv_block;
  prm.S = (int)sh->seqlen;
  prm.H = (int)sh->heads;
  /* a group longer than the sequence is one group of S queries (num_groups 1, the same
   * result): clamped, so that grids and the key-major pass's query chunks per entry
   * (G / 64) follow S, not a huge G of the C API */
  prm.G = (int)(sh->group_size < sh->seqlen ? sh->group_size : sh->seqlen);
  prm.NG = (int)sh->num_groups;
  prm.kmax = (int)sh->kmax;
  prm.chunks = 1;
  prm.nkb = (int)L.nkb;
  prm.D = (int)sh->head_dim;
  prm.cap = L.cap;
  prm.scale = (float)sh->scale;
  prm.scale_log2 = (float)(sh->scale * 1.4426950408889634);
  const bool blocks = sh->kv_block > 1; /* block lists: always the deterministic key-major path */
  const bool deterministic = blocks || (sh->flags & DSV_FLAG_DETERMINISTIC) != 0;
  float ratio = tun->km_ratio;
  if (deterministic) ratio = 3.0e38f; /* key-major for every head whose lists allow it */
  prm.km_ratio = ratio;
  prm.km_enabled = L.km_enabled && ratio > 0.f;
  prm.g128 = tun->g128;
  prm.qm_wgmma = tun->qm_wgmma;
  prm.uidx = L.ucap > 0 ? (int*)(ws + L.uidx) : nullptr;
  prm.ucnt = L.ucap > 0 ? (int*)(ws + L.ucnt) : nullptr;
  prm.knf = L.ucap > 0 ? (int*)(ws + L.knf) : nullptr;
  prm.NSG = (int)L.nsg;
  prm.ucap = (int)L.ucap;
  prm.ug = prm.G;
  prm.merge = tun->merge;
  {
    const RangeCfg rc = bwd_ranges(sh, tun);
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
  if (blocks) {
    /* sorted lists and the key-major index; dQ query-major in registers; dK / dV key-major in
     * registers: no atomics, no fp32 accumulators */
    int st = bwd_blocks_index_launch<T>(prm, B, stream);
    if (st == DSV_OK) st = bwd_blocks_dq_launch<T>(sh, prm, tun->wgmma, stream);
    if (st == DSV_OK) st = bwd_kmajor_launch<T>(sh, prm, tun->wgmma ? tun->km_wgmma : 0, stream);
    return st;
  }
  /* list checks (flags) for every head; counts, offsets and entries for key-major heads */
  if (bwd_index_launch<T>(prm, B, deterministic, stream) != DSV_OK) return DSV_ERR_CUDA;
  {
    /* path stays 0 (memset) where key-major is disabled */
    dim3 gz(64, (unsigned)(BH < 65535 ? BH : 65535));
    zero_acc_kernel<T><<<gz, 256, 0, stream>>>(prm, BH);
    if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  }
  /* query-major passes, then the key-major pass */
  int st = qmajor(sh, prm, tun->wgmma, stream);
  if (st == DSV_OK) st = bwd_kmajor_launch<T>(sh, prm, tun->wgmma ? tun->km_wgmma : 0, stream);
  if (st != DSV_OK) return st;
  {
    const int64_t n = (int64_t)B * prm.S * prm.H * (prm.D / 8);
    int64_t blocks = (n + 255) / 256;
    if (blocks > (int64_t)tun->sm_count * 16) blocks = (int64_t)tun->sm_count * 16;
    convert_acc_kernel<T><<<(unsigned)blocks, 256, 0, stream>>>(prm, B);
    if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  }
  return DSV_OK;
}

}  // namespace dsv_attn

using namespace dsv_attn;

extern "C" size_t dsv_sparse_attention_bwd_workspace_cuda(const dsv_attn_shape* p) {
  if (check_attn_args(p) != DSV_OK || check_blocks_bwd(p) != DSV_OK) return 0;
  const dsv_tuning* tun = nullptr;
  if (dsv_tuning_current(&tun) != DSV_OK) return 0; /* the backward reports the error */
  return bwd_layout(p, tun).total;
}

namespace dsv_attn {

static int bwd_entry(const BwdQmajor& qm, const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                     dsv_bshd v, dsv_bshd out, dsv_bshd dout, const void* lse,
                     const int32_t* kv_index, const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk,
                     dsv_bshd dv, void* workspace, size_t workspace_bytes, void* stream) {
  int st = check_attn_args(p);
  if (st != DSV_OK) return st;
  if (p->batch == 0 || p->seqlen == 0 || p->heads == 0) return DSV_OK;
  if (!check_bshd_aligned(q) || !check_bshd_aligned(k) || !check_bshd_aligned(v) ||
      !check_bshd_aligned(out) || !check_bshd_aligned(dout) || !check_bshd_aligned(dq) ||
      !check_bshd_aligned(dk) || !check_bshd_aligned(dv))
    return DSV_ERR_UNSUPPORTED;
  if (!kv_count || !lse || (p->kmax > 0 && !kv_index)) return DSV_ERR_INVALID;
  const dsv_tuning* tun = nullptr;
  if ((st = dsv_tuning_current(&tun)) != DSV_OK) return st;
  if ((st = check_blocks_bwd(p)) != DSV_OK) return st;
  if (!workspace || workspace_bytes < bwd_layout(p, tun).total) return DSV_ERR_NOMEM;
  /* deterministic: the key-major path for every head, which exists for head_dim <= 128 */
  if ((p->flags & DSV_FLAG_DETERMINISTIC) && p->head_dim > 128) return DSV_ERR_UNSUPPORTED;
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == DSV_BFLOAT16)
    return bwd_run<__nv_bfloat16>(p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv,
                                  workspace, tun, qm.bf16, s);
  return bwd_run<__half>(p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv, workspace,
                         tun, qm.f16, s);
}

}  // namespace dsv_attn

extern "C" int dsv_sparse_attention_bwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                                             dsv_bshd v, dsv_bshd out, dsv_bshd dout,
                                             const void* lse, const int32_t* kv_index,
                                             const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk,
                                             dsv_bshd dv, void* workspace,
                                             size_t workspace_bytes, void* stream) {
  const BwdQmajor qm = {bwd_qmajor_launch<__half>, bwd_qmajor_launch<__nv_bfloat16>};
  return bwd_entry(qm, p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv, workspace,
                   workspace_bytes, stream);
}
