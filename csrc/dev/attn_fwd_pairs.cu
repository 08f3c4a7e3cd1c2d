/*
 * attn_fwd_pairs.cu - G = 32 with two groups per warpgroup over the union of their key lists
 * (measurement variant; the shipped kernels run G = 32 on mma.sync, BM = 32): the forward, and
 * the backward's query-major pass with dK / dV reductions (pair_bwd_kernel, below). Design and
 * prediction: benchmarks/PERF_LOG.md (v11).
 *
 *   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
 *        -DDSV_WGMMA -Icsrc -Xcompiler -fPIC -shared csrc/dev/attn_fwd_pairs.cu -o fwd_pairs.so
 *
 * Groups 2 p and 2 p + 1 (a pair: 64 consecutive queries) share one CTA of the shipped wgmma
 * forward (one warpgroup, 32-key tiles x 2 stages, 4 CTAs per SM): rows 0-31 (warps 0, 1) are
 * group A, rows 32-63 (warps 2, 3) group B. A merge pass (pair_merge_kernel, one thread per
 * pair, into the workspace) walks both lists once: equal heads become one union entry that both
 * groups use, otherwise the smaller head becomes an entry of its own group; entries outside
 * [0, S) and past the clamped count are dropped. Each list entry is consumed exactly once, so
 * duplicates count once per occurrence and per group, for any list order (sorted lists give
 * the smallest union). An entry is key | (in A) << 30 | (in B) << 31 (seqlen < 2^30). The
 * attention kernel gathers the union's tiles with the shipped KeyGather (each key loaded once
 * for both groups) and masks per warp: a row's score of a key outside its group's list becomes
 * -inf by a select (so a NaN or inf of the other group's key never enters it through S).
 * The other group's keys still enter O += P V with P = 0, and 0 x NaN = NaN: a CTA that ends
 * with a NaN in its accumulators therefore runs both groups again, each over its own list as
 * the shipped kernels do (the rows of the other group discarded), which is exact whatever the
 * inputs; NaN-free inputs never take that path.
 *
 * Applies to token lists, G = 32, D = 64 / 128, where the shipped forward could use wgmma (an
 * sm_90a build on a 9.0 device, K / V row strides below 4 GB) and the workspace holds the union
 * (dsv_sparse_attention_fwd_workspace_cuda of this library asks for it: B H ceil(NG / 2) (2 kmax
 * + 2) ints); every other call runs the shipped forward. The library also exports the rest of
 * the shipped C API and
 *   int dsv_dev_sparse_attention_fwd_pairs_cuda(int pairs, <dsv_sparse_attention_fwd_cuda's
 *                                               arguments>)
 *   int dsv_dev_sparse_attention_bwd_pairs_cuda(int pairs, <dsv_sparse_attention_bwd_cuda's
 *                                               arguments>)
 * with pairs 0 (the shipped kernels) or 1 (the pairs: what dsv_sparse_attention_fwd_cuda and
 * _bwd_cuda run). The backward's workspace is the shipped one plus the union (same size as the
 * forward's). Not thread-safe (the workspace of the running call is a global).
 */
#include <string.h>

/* the shipped forward's entry points keep other names here; this file defines the C API */
#define dsv_sparse_attention_fwd_cuda dsv_shipped_sparse_attention_fwd_cuda
#define dsv_sparse_attention_fwd_workspace_cuda dsv_shipped_sparse_attention_fwd_workspace_cuda
#define dsv_sparse_attention_bwd_cuda dsv_shipped_sparse_attention_bwd_cuda
#define dsv_sparse_attention_bwd_workspace_cuda dsv_shipped_sparse_attention_bwd_workspace_cuda
#include "cuda/tuning.cu"
#include "cuda/sparse_attention_fwd.cu"
#include "cuda/sparse_attention_bwd.cu"
#undef dsv_sparse_attention_fwd_cuda
#undef dsv_sparse_attention_fwd_workspace_cuda
#undef dsv_sparse_attention_bwd_cuda
#undef dsv_sparse_attention_bwd_workspace_cuda
#include "cuda/sparse_attention_bwd_index.cu"
#include "cuda/sparse_attention_bwd_kmajor.cu"
#include "cuda/sparse_attention_bwd_qmajor.cu"

namespace dsv_attn {

#define PAIR_KEY 0x3fffffff
#define PAIR_IN_A 0x40000000u
#define PAIR_IN_B 0x80000000u

template <typename T>
struct PairParams {
  FwdParams<T> f;
  int* uni;   /* [B][H][NP][2 kmax]: union entries */
  int* meta;  /* [B][H][NP][2]: union length, (A has a valid key) | (B has one) << 1 */
  int NP;
};

/* Next valid entry of a list at or after *i (advanced past it), or INT32_MAX at its end. */
__device__ __forceinline__ int pair_next(const int* list, int& i, int n, int S) {
  while (i < n) {
    const int x = __ldg(list + i++);
    if ((unsigned)x < (unsigned)S) return x;
  }
  return 0x7fffffff;
}

/* One thread per (pair, head, batch): the merged union of the pair's two lists. Writes are
 * buffered 4 entries at a time (16-byte stores; the union row starts 16-byte aligned when
 * kmax is even, else plain stores). */
__global__ void pair_merge_kernel(const int* kv_index, const int* kv_count, int S, int H, int NG,
                                  int kmax, int NP, int* uni, int* meta) {
  const int pr = blockIdx.x * blockDim.x + threadIdx.x;
  if (pr >= NP) return;
  const size_t bh = (size_t)blockIdx.z * H + blockIdx.y;
  int count = __ldg(kv_count + bh);
  count = count < 0 ? 0 : (count > kmax ? kmax : count);
  const int gA = 2 * pr;
  const int* la = kv_index + (bh * NG + gA) * (size_t)kmax;
  const int* lb = la + kmax;
  const int nb = gA + 1 < NG ? count : 0;
  int* u = uni + (bh * NP + pr) * (size_t)(2 * kmax);
  const bool vec = (kmax & 1) == 0;
  int i = 0, j = 0, n = 0;
  unsigned any = 0;
  int a = pair_next(la, i, count, S), b = pair_next(lb, j, nb, S);
  int buf[4];
  while (a != 0x7fffffff || b != 0x7fffffff) {
    unsigned e;
    if (a == b) {
      e = (unsigned)a | PAIR_IN_A | PAIR_IN_B;
      a = pair_next(la, i, count, S);
      b = pair_next(lb, j, nb, S);
    } else if (a < b) {
      e = (unsigned)a | PAIR_IN_A;
      a = pair_next(la, i, count, S);
    } else {
      e = (unsigned)b | PAIR_IN_B;
      b = pair_next(lb, j, nb, S);
    }
    any |= e >> 30;
    if (vec) {
      buf[n & 3] = (int)e;
      if ((n & 3) == 3) *reinterpret_cast<int4*>(u + n - 3) = make_int4(buf[0], buf[1], buf[2], buf[3]);
    } else {
      u[n] = (int)e;
    }
    ++n;
  }
  if (vec)
    for (int r = n & ~3; r < n; ++r) u[r] = buf[r & 3];
  int* m = meta + 2 * (bh * NP + pr);
  m[0] = n;
  m[1] = (int)any;
}

/* Epilogue for the rows [rlo, rhi) of the CTA's 64 (store_out_lse with the group's "has a
 * valid key" known from the merge instead of a scan of the list). */
template <typename T, int D>
__device__ __forceinline__ void pair_store(const FwdParams<T>& p, const float (&o)[D / 8][4],
                                           float m0, float m1, float l0, float l1, int b, int h,
                                           int row0, int rlo, int rhi, bool has_key, int warp,
                                           int lane) {
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;
  const float nan = __int_as_float(0x7fc00000);
  const float zero_out = has_key ? nan : 0.f, zero_lse = has_key ? nan : -INFINITY;
  const float inv0 = l0 == 0.f ? zero_out : 1.f / l0;
  const float inv1 = l1 == 0.f ? zero_out : 1.f / l1;
  const bool w0 = lr0 >= rlo && lr0 < rhi, w1 = lr1 >= rlo && lr1 < rhi;
  T* obase = p.out + b * p.ob + h * p.oh;
  if (w0) {
    T* orow = obase + (int64_t)(row0 + lr0) * p.os + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(orow + i * 8) = Elem<T>::pack(o[i][0] * inv0, o[i][1] * inv0);
  }
  if (w1) {
    T* orow = obase + (int64_t)(row0 + lr1) * p.os + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(orow + i * 8) = Elem<T>::pack(o[i][2] * inv1, o[i][3] * inv1);
  }
  if ((lane & 3) == 0) {
    float* lrow = p.lse + ((size_t)b * p.H + h) * p.S + row0;
    if (w0) lrow[lr0] = l0 == 0.f ? zero_lse : (m0 + log2f(l0)) * DSV_LN2;
    if (w1) lrow[lr1] = l1 == 0.f ? zero_lse : (m1 + log2f(l1)) * DSV_LN2;
  }
}

/* Shared memory of the pair kernel (bytes past the 1024-byte alignment pad). */
template <int D, int BN, int NS, typename T>
struct PairSmem {
  static constexpr size_t bytes = 1024 + (size_t)(64 + 2 * NS * BN) * D * sizeof(T) +
                                  3 * NS * BN * sizeof(int) + 64 * sizeof(int);
};

/* The tile loop of sparse_attn_fwd_wg_kernel over `nkeys` entries of `list`. UNI: the list is
 * the pair's union (entries coded), each warp masks by its group's membership; else a plain
 * list whose missing / out-of-range keys are masked for every row. Leaves O, the running max
 * and the (per-thread partial) sums. */
template <typename T, int D, int BN, int NS, bool UNI>
__device__ __forceinline__ void pair_loop(const FwdParams<T>& p, const T* kbase, const T* vbase,
                                          const int* list, int nkeys, unsigned char* smem,
                                          float (&o)[D / 8][4], float& m0, float& m1, float& l0,
                                          float& l1) {
  constexpr int NT = 128, QE = 64 * D, KE = BN * D;
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + QE;
  T* Vs = Ks + NS * KE;
  int* kmask = reinterpret_cast<int*>(Vs + NS * KE); /* [NS][BN]: position or -1 */
  int* amask = kmask + NS * BN;                      /* [NS][BN]: 0 in A's list, else -1 */
  int* bmask = amask + NS * BN;                      /* [NS][BN]: the same for B */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ntiles = (nkeys + BN - 1) / BN;
  KeyGather<T, D, NT, BN, true, int, false, 1> ix;
  ix.init(kbase, p.ks, vbase, p.vs);
  const uint32_t ks0 = smem_u32(Ks), vs0 = smem_u32(Vs);
  unsigned fl = 0; /* thread tid < BN: the membership bits of row tid of the tile loaded next */
  auto load = [&](int j0) {
    ix.load(list, j0, nkeys);
    if constexpr (UNI) {
#pragma unroll
      for (int k = 0; k < KeyGather<T, D, NT, BN, true, int, false, 1>::N; ++k)
        ix.v[k] = ix.v[k] == -1 ? -1 : ix.v[k] & PAIR_KEY; /* -1: past the union (no code is -1) */
      if (tid < BN) fl = j0 + tid < nkeys ? (unsigned)__ldg(list + j0 + tid) >> 30 : 0u;
    }
  };
  auto issue = [&](int st) {
    ix.issue(ks0 + st * KE * 2, vs0 + st * KE * 2, 0, p.S, kmask + st * BN);
    if constexpr (UNI) {
      if (tid < BN) {
        amask[st * BN + tid] = (fl & 1u) ? 0 : -1;
        bmask[st * BN + tid] = (fl & 2u) ? 0 : -1;
      }
    }
  };
  __syncthreads(); /* the previous loop's reads of the stages are done */
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) {
    if (st < ntiles) {
      load(st * BN);
      issue(st);
    }
    cp_async_commit();
  }
  load((NS - 1) * BN);

  float s[BN / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
  m0 = m1 = -INFINITY;
  l0 = l1 = 0.f;
  const uint64_t qdesc = wg_desc(smem_u32(Qs), 16, 1024);
  const uint64_t kdesc0 = wg_desc(ks0, 16, 1024);
  const uint64_t vdesc0 = wg_desc(vs0, BN * 128, 1024);
  const int* wmask = UNI ? (warp < 2 ? amask : bmask) : kmask;

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    fence_proxy_async_smem();
    __syncthreads();
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        issue(tn % NS);
        load((tn + 1) * BN);
      }
      cp_async_commit();
    }
    wg_fence();
    wg_scores<T, D, BN>(s, qdesc, wg_desc_add(kdesc0, buf * KE * 2));
    wg_commit();
    wg_wait<0>();
    wg_fence_regs<BN / 2>(&s[0][0]);
    float a0, a1;
    softmax_tile<BN>(s, wmask + buf * BN, p.scale_log2, lane, m0, m1, l0, l1, a0, a1);
    rescale_out<D>(o, a0, a1);
    wg_pv<T, D, BN>(o, s, wg_desc_add(vdesc0, buf * KE * 2));
    wg_commit();
    wg_wait<0>();
    wg_fence_regs<D / 2>(&o[0][0]);
  }
  cp_async_wait<0>();
}

template <typename T, int D, int BN, int NS, int MINB>
__global__ void __launch_bounds__(128, MINB) sparse_attn_fwd_pair_kernel(const PairParams<T> pp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const FwdParams<T>& p = pp.f;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  constexpr int QE = 64 * D, KE = BN * D;
  T* Qs = reinterpret_cast<T*>(smem);
  int* qidx = reinterpret_cast<int*>(Qs + QE + 2 * NS * KE) + 3 * NS * BN;
  const int pr = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  FwdChunk<T> c;
  c.g = 2 * pr;
  c.h = h;
  c.b = b;
  c.row0 = pr * 64;
  c.nrows = min(64, p.S - c.row0);
  c.qbase = p.q + b * p.qb + h * p.qh;
  c.kbase = p.k + b * p.kb + h * p.kh;
  c.vbase = p.v + b * p.vb + h * p.vh;
  const size_t pi = ((size_t)b * p.H + h) * pp.NP + pr;
  const int* uni = pp.uni + pi * (size_t)(2 * p.kmax);
  const int nuni = __ldg(pp.meta + 2 * pi), has = __ldg(pp.meta + 2 * pi + 1);
  fwd_load_q<T, D, 128, 64, true>(Qs, qidx, p, c);

  float o[D / 8][4];
  float m0, m1, l0, l1;
  pair_loop<T, D, BN, NS, true>(p, c.kbase, c.vbase, uni, nuni, smem, o, m0, m1, l0, l1);
  bool bad = l0 != l0 || l1 != l1;
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    bad |= o[i][0] != o[i][0] || o[i][1] != o[i][1] || o[i][2] != o[i][2] || o[i][3] != o[i][3];
  const bool own = warp < 2 ? (has & 1) : (has & 2);
  if (!__syncthreads_or(bad)) {
    pair_store<T, D>(p, o, m0, m1, l0, l1, b, h, c.row0, 0, c.nrows, own, warp, lane);
    return;
  }
  /* a NaN somewhere: each group over its own list, exactly as the shipped kernels */
  int count = __ldg(p.kv_count + (size_t)b * p.H + h);
  count = count < 0 ? 0 : (count > p.kmax ? p.kmax : count);
  for (int gi = 0; gi < 2; ++gi) {
    const int g = 2 * pr + gi;
    if (g >= p.NG) break;
    const int* list = p.kv_index + (((size_t)b * p.H + h) * p.NG + g) * p.kmax;
    const int n = trim_count<128>(list, count);
    pair_loop<T, D, BN, NS, false>(p, c.kbase, c.vbase, list, n, smem, o, m0, m1, l0, l1);
    pair_store<T, D>(p, o, m0, m1, l0, l1, b, h, c.row0, gi * 32, min(gi * 32 + 32, c.nrows),
                     (has >> gi) & 1, warp, lane);
  }
#endif
}

static size_t pair_ws_bytes(const dsv_attn_shape* sh) {
  if (!sh || sh->group_size != 32 || sh->kv_block != 1 ||
      (sh->head_dim != 64 && sh->head_dim != 128) || sh->batch <= 0 || sh->heads <= 0 ||
      sh->num_groups <= 0 || sh->kmax < 0)
    return 0;
  const size_t np = (size_t)(sh->num_groups + 1) / 2;
  const size_t rows = (size_t)sh->batch * (size_t)sh->heads * np;
  return rows * (size_t)(2 * sh->kmax) * sizeof(int) + rows * 2 * sizeof(int) + 16;
}

static void* g_pair_ws = nullptr;
static size_t g_pair_ws_bytes = 0;
static int g_pairs_on = 1;

template <typename T, int D>
static int launch_fwd_pairs(const dsv_attn_shape* sh, FwdParams<T>& prm, cudaStream_t stream) {
  constexpr int BN = 32, NS = 2, MINB = 4;
  PairParams<T> pp;
  pp.f = prm;
  pp.NP = (prm.NG + 1) / 2;
  const size_t rows = (size_t)sh->batch * (size_t)prm.H * (size_t)pp.NP;
  /* 16-byte aligned union rows first, then the lengths */
  char* ws = (char*)(((uintptr_t)g_pair_ws + 15) & ~(uintptr_t)15);
  pp.uni = (int*)ws;
  pp.meta = pp.uni + rows * (size_t)(2 * prm.kmax);
  dim3 mgrid((unsigned)((pp.NP + 127) / 128), (unsigned)prm.H, (unsigned)sh->batch);
  pair_merge_kernel<<<mgrid, 128, 0, stream>>>(prm.kv_index, prm.kv_count, prm.S, prm.H, prm.NG,
                                               prm.kmax, pp.NP, pp.uni, pp.meta);
  if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  const size_t smem = PairSmem<D, BN, NS, T>::bytes;
  auto kern = sparse_attn_fwd_pair_kernel<T, D, BN, NS, MINB>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  dim3 grid((unsigned)pp.NP, (unsigned)prm.H, (unsigned)sh->batch);
  kern<<<grid, 128, smem, stream>>>(pp);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

/* The pair forward where it applies, else the shipped dispatch. */
template <typename T>
static int fwd_pairs(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma, const char* tile,
                     cudaStream_t stream) {
  (void)tile;
  const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T);
  const size_t need = pair_ws_bytes(sh);
  if (g_pairs_on && wgmma && need > 0 && g_pair_ws && g_pair_ws_bytes >= need &&
      prm.ks <= lim && prm.vs <= lim && (int64_t)prm.S <= PAIR_KEY) {
    if (sh->head_dim == 64) return launch_fwd_pairs<T, 64>(sh, prm, stream);
    return launch_fwd_pairs<T, 128>(sh, prm, stream);
  }
  return fwd_dispatch<T>(sh, prm, wgmma, stream);
}

/* ---------------------------------------------------------------------------------------- */
/* backward: the query-major pass with dK / dV reductions for pairs (wgmma, 64-key tiles) */

template <typename T> struct PairExp { static constexpr uint32_t m = 0x7c00u; };      /* fp16 */
template <> struct PairExp<__nv_bfloat16> { static constexpr uint32_t m = 0x7f80u; }; /* bf16 */

/* Whether rows [row0, row0 + n) of q and dout (batch b, head h) are all finite (CTA-wide; an
 * element is not when its exponent bits are all ones). */
template <typename T, int D>
__device__ __forceinline__ bool pair_rows_finite(const BwdParams<T>& p, int b, int h, int row0,
                                                 int n) {
  constexpr int CH = D / 8;
  constexpr uint32_t M = PairExp<T>::m;
  bool bad = false;
  for (int i = threadIdx.x; i < 2 * n * CH; i += blockDim.x) {
    const int t = i / (n * CH), rc = i - t * (n * CH), r = rc / CH, c = rc - r * CH;
    const T* src = t == 0 ? p.q + b * p.qb + h * p.qh + (int64_t)(row0 + r) * p.qs
                          : p.dout + b * p.gb + h * p.gh + (int64_t)(row0 + r) * p.gs;
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(src + c * 8));
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) bad |= (w[e] & M) == M || ((w[e] >> 16) & M) == M;
  }
  return !__syncthreads_or(bad);
}

/* One pass of bwd_wg_kernel (ATOMIC, BN = 64) over entries [j0, j1) of `list` for the query rows
 * [rlo, rhi) of the CTA's 64 (the others are zero rows with P = 0). UNI: the list is the pair's
 * union (coded entries), P and dS of a key outside a row's group are selected to 0; else a plain
 * list. RED: dK / dV reductions (16-byte red.global.add from registers), else dQ only. Leaves dQ
 * (unscaled) in dq; returns the number of key tiles. */
template <typename T, int D, int NS, bool UNI, bool RED>
__device__ __forceinline__ int pair_bwd_pass(const BwdParams<T>& p, int b, int h, size_t bh,
                                             int row0, int rlo, int rhi, const int* list, int n,
                                             int klo, int khi, bool search, unsigned char* smem,
                                             float (&dq)[D / 8][4]) {
  constexpr int BM = 64, BN = 64, NT = 128;
  constexpr int QE = BM * D, KE = BN * D, PE = BM * BN;
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + QE;
  T* Ks = dOs + QE;
  T* Vs = Ks + NS * KE;
  T* PSs = Vs + NS * KE;
  float* lse2 = reinterpret_cast<float*>(PSs + PE);
  float* dlt = lse2 + BM;
  int* kidx = reinterpret_cast<int*>(dlt + BM); /* [NS][BN] */
  int* qidx = kidx + NS * BN;                   /* [BM] */
  int* amask = qidx + BM;                       /* [NS][BN] */
  int* bmask = amask + NS * BN;                 /* [NS][BN] */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  int j0 = 0, j1 = n;
  if (search) { /* ascending keys: the entries of [klo, khi) */
    int a = 0, e = n;
    while (a < e) {
      const int m = (a + e) >> 1;
      const int x = UNI ? (__ldg(list + m) & PAIR_KEY) : __ldg(list + m);
      if (x < klo) a = m + 1; else e = m;
    }
    j0 = a;
    e = n;
    while (a < e) {
      const int m = (a + e) >> 1;
      const int x = UNI ? (__ldg(list + m) & PAIR_KEY) : __ldg(list + m);
      if (x < khi) a = m + 1; else e = m;
    }
    j1 = a;
  }
  __syncthreads(); /* a previous pass is done with the shared tiles */
  for (int r = tid; r < BM; r += NT) {
    const bool valid = r >= rlo && r < rhi;
    qidx[r] = valid ? row0 + r : -1;
    const float l = valid ? p.lse[bh * p.S + row0 + r] : INFINITY;
    lse2[r] = l == -INFINITY ? INFINITY : l * DSV_LOG2E;
    dlt[r] = valid ? p.delta[bh * p.S + row0 + r] : 0.f;
  }
  __syncthreads();
  gather_rows_async<T, D, NT, BM, true>(Qs, p.q + b * p.qb + h * p.qh, p.qs, qidx, BM);
  gather_rows_async<T, D, NT, BM, true>(dOs, p.dout + b * p.gb + h * p.gh, p.gs, qidx, BM);
  const int ntiles = j1 > j0 ? (j1 - j0 + BN - 1) / BN : 0;
  using Gather = KeyGather<T, D, NT, BN, true, int, false, 1>;
  Gather ix;
  ix.init(p.k + b * p.kb + h * p.kh, p.ks, p.v + b * p.vb + h * p.vh, p.vs);
  const uint32_t ks0 = smem_u32(Ks), vs0 = smem_u32(Vs);
  unsigned fl = 0;
  auto load = [&](int js) {
    ix.load(list, js, j1);
    if constexpr (UNI) {
#pragma unroll
      for (int k = 0; k < Gather::N; ++k) ix.v[k] = ix.v[k] == -1 ? -1 : ix.v[k] & PAIR_KEY;
      if (tid < BN) fl = js + tid < j1 ? (unsigned)__ldg(list + js + tid) >> 30 : 0u;
    }
  };
  auto issue = [&](int st) {
    ix.issue(ks0 + st * KE * 2, vs0 + st * KE * 2, klo, khi, kidx + st * BN);
    if constexpr (UNI) {
      if (tid < BN) {
        amask[st * BN + tid] = (fl & 1u) ? 0 : -1;
        bmask[st * BN + tid] = (fl & 2u) ? 0 : -1;
      }
    }
  };
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) {
    if (st < ntiles) {
      load(j0 + st * BN);
      issue(st);
    }
    cp_async_commit();
  }
  load(j0 + (NS - 1) * BN);

  float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
  }
  const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;
  const uint64_t qdesc = wg_desc(smem_u32(Qs), 16, 1024);
  const uint64_t dodesc = wg_desc(smem_u32(dOs), 16, 1024);
  const uint64_t kdesc0 = wg_desc(ks0, 16, 1024);
  const uint64_t vdesc0 = wg_desc(vs0, 16, 1024);
  const uint64_t ktdesc0 = wg_desc(ks0, BN * 128, 1024);
  const uint64_t qtdesc = wg_desc(smem_u32(Qs), BM * 128, 1024);
  const uint64_t dotdesc = wg_desc(smem_u32(dOs), BM * 128, 1024);
  const uint64_t pdesc = wg_desc(smem_u32(PSs), BN * 128, 1024);
  float* dva = p.dvacc + bh * (size_t)p.S * D;
  float* dka = p.dkacc + bh * (size_t)p.S * D;
  const int* gm = UNI ? (warp < 2 ? amask : bmask) : kidx; /* the warp's membership masks */

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    fence_proxy_async_smem();
    __syncthreads();
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        issue(tn % NS);
        load(j0 + (tn + 1) * BN);
      }
      cp_async_commit();
    }
    const uint32_t toff = buf * KE * 2;
    const int* ki = kidx + buf * BN;
    const int* wm = gm + buf * BN;
    wg_fence();
    bwg_scores<T, D, BN>(s, qdesc, wg_desc_add(kdesc0, toff));
    bwg_scores<T, D, BN>(dp, dodesc, wg_desc_add(vdesc0, toff));
    wg_commit();
    wg_wait<0>();
    wg_fence_regs<BN / 2>(&s[0][0]);
    wg_fence_regs<BN / 2>(&dp[0][0]);
    const float ls0 = lse2[lr0], ls1 = lse2[lr1];
    const float dl0 = dlt[lr0], dl1 = dlt[lr1];
    uint32_t pa[BN / 16][4], da[BN / 16][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int col = nt * 8 + (lane & 3) * 2;
      /* selects, not products: a NaN of a key outside the row's group stays out */
      const bool v0 = ki[col] >= 0 && wm[col] >= 0, v1 = ki[col + 1] >= 0 && wm[col + 1] >= 0;
      const float p0 = v0 ? fast_exp2(s[nt][0] * p.scale_log2 - ls0) : 0.f;
      const float p1 = v1 ? fast_exp2(s[nt][1] * p.scale_log2 - ls0) : 0.f;
      const float p2 = v0 ? fast_exp2(s[nt][2] * p.scale_log2 - ls1) : 0.f;
      const float p3 = v1 ? fast_exp2(s[nt][3] * p.scale_log2 - ls1) : 0.f;
      const int kk = nt >> 1, hf = (nt & 1) * 2;
      pa[kk][hf] = Elem<T>::pack(p0, p1);
      pa[kk][hf + 1] = Elem<T>::pack(p2, p3);
      da[kk][hf] = Elem<T>::pack(v0 ? p0 * (dp[nt][0] - dl0) : 0.f, v1 ? p1 * (dp[nt][1] - dl0) : 0.f);
      da[kk][hf + 1] = Elem<T>::pack(v0 ? p2 * (dp[nt][2] - dl1) : 0.f, v1 ? p3 * (dp[nt][3] - dl1) : 0.f);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, D>::rs_bt(&dq[0][0], da[kk], wg_desc_add(ktdesc0, toff + kk * 2048), 1);
    wg_commit();
    if constexpr (RED) {
      float dvt[D / 8][4], dkt[D / 8][4];
      bwg_store_frag<T, BN>(PSs, pa, lr0, lane);
      fence_proxy_async_smem();
      __syncthreads();
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        WgmmaTT<T, D>::ss(&dvt[0][0], wg_desc_add(pdesc, kk * 2048),
                          wg_desc_add(dotdesc, kk * 2048), kk > 0);
      wg_commit();
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dq[0][0]);
      wg_fence_regs<D / 2>(&dvt[0][0]);
      __syncthreads();
      bwg_store_frag<T, BN>(PSs, da, lr0, lane);
      fence_proxy_async_smem();
      __syncthreads();
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        WgmmaTT<T, D>::ss(&dkt[0][0], wg_desc_add(pdesc, kk * 2048),
                          wg_desc_add(qtdesc, kk * 2048), kk > 0);
      wg_commit();
      bwg_reduce_rows<D>(dva, dvt, ki, warp, lane);
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dkt[0][0]);
      bwg_reduce_rows<D>(dka, dkt, ki, warp, lane);
    } else {
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dq[0][0]);
    }
  }
  cp_async_wait<0>();
  return ntiles;
}

/* dQ of the rows [rlo, rhi): dq (times scale) or, with key ranges, the fp32 partial sums. */
template <typename T, int D>
__device__ __forceinline__ void pair_store_dq(const BwdParams<T>& p, const float (&dq)[D / 8][4],
                                              int b, int h, size_t bh, int row0, int rlo,
                                              int rhi, bool ranges, int warp, int lane) {
  const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;
  if (ranges) {
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
      if (lrow >= rlo && lrow < rhi)
        atomicAdd(reinterpret_cast<float4*>(dqa + (size_t)(row0 + lrow) * D + i * 8 +
                                            (tq >> 1) * 4),
                  val);
    }
    return;
  }
  T* dqb = p.dq + b * p.dqb + h * p.dqh;
  if (lr0 >= rlo && lr0 < rhi) {
    T* r = dqb + (int64_t)(row0 + lr0) * p.dqs + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(r + i * 8) =
          Elem<T>::pack(dq[i][0] * p.scale, dq[i][1] * p.scale);
  }
  if (lr1 >= rlo && lr1 < rhi) {
    T* r = dqb + (int64_t)(row0 + lr1) * p.dqs + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(r + i * 8) =
          Elem<T>::pack(dq[i][2] * p.scale, dq[i][3] * p.scale);
  }
}

template <typename T>
struct PairBwdParams {
  BwdParams<T> p;
  const int* uni;
  const int* meta;
  int NP;
};

/* The query-major pass with reductions of the heads on path 0, one CTA per pair of groups and
 * key range: the pass over the union, both groups' rows at once, each key reduced once per pair.
 * A non-finite q or dout row in the pair (it would reach the other group's keys through a
 * 0 x NaN in dK_t = dS^T Q or dV_t = P^T dO) runs both groups apart from the start, the other
 * group's rows zero; a NaN in dQ after the union pass (0 x NaN in dQ += dS K, a non-finite K of
 * the other group's key) recomputes dQ per group (dK / dV of the union pass stand). */
template <typename T, int D, int NS, int MINB>
__global__ void __launch_bounds__(128, MINB) pair_bwd_kernel(const PairBwdParams<T> pp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const BwdParams<T>& p = pp.p;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const int RG = p.nranges;
  const int h = blockIdx.y / RG, rr = blockIdx.y - h * RG, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != 0) return;
  const int R = p.nrh[bh];
  if (rr >= R) return;
  const int pr = blockIdx.x, row0 = pr * 64, nrows = min(64, p.S - row0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int klo = 0, khi = p.S;
  bool search = false;
  if (R > 1) {
    const int rlen = (p.S + R - 1) / R;
    klo = rr * rlen;
    khi = min(p.S, klo + rlen);
    search = p.flags[bh] == 0;
  }
  const bool ranges = RG > 1;
  float dq[D / 8][4];
  int count = __ldg(p.kv_count + bh);
  count = count < 0 ? 0 : (count > p.kmax ? p.kmax : count);
  if (pair_rows_finite<T, D>(p, b, h, row0, nrows)) {
    const size_t pi = bh * pp.NP + pr;
    const int* uni = pp.uni + pi * (size_t)(2 * p.kmax);
    const int nuni = __ldg(pp.meta + 2 * pi);
    const int nt = pair_bwd_pass<T, D, NS, true, true>(p, b, h, bh, row0, 0, nrows, uni, nuni, klo,
                                                       khi, search, smem, dq);
    bool bad = false;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      bad |= dq[i][0] != dq[i][0] || dq[i][1] != dq[i][1] || dq[i][2] != dq[i][2] ||
             dq[i][3] != dq[i][3];
    if (!__syncthreads_or(bad)) {
      if (!ranges || nt > 0) pair_store_dq<T, D>(p, dq, b, h, bh, row0, 0, nrows, ranges, warp, lane);
      return;
    }
    for (int gi = 0; gi < 2; ++gi) {
      const int g = 2 * pr + gi;
      if (g >= p.NG) break;
      const int* list = p.kv_index + (bh * p.NG + g) * (size_t)p.kmax;
      const int n = trim_count<128>(list, count);
      const int rhi = min(gi * 32 + 32, nrows);
      const int ntg = pair_bwd_pass<T, D, NS, false, false>(p, b, h, bh, row0, gi * 32, rhi, list,
                                                            n, klo, khi, search, smem, dq);
      if (!ranges || ntg > 0) pair_store_dq<T, D>(p, dq, b, h, bh, row0, gi * 32, rhi, ranges, warp, lane);
    }
    return;
  }
  for (int gi = 0; gi < 2; ++gi) {
    const int g = 2 * pr + gi;
    if (g >= p.NG) break;
    const int* list = p.kv_index + (bh * p.NG + g) * (size_t)p.kmax;
    const int n = trim_count<128>(list, count);
    const int rhi = min(gi * 32 + 32, nrows);
    const int ntg = pair_bwd_pass<T, D, NS, false, true>(p, b, h, bh, row0, gi * 32, rhi, list, n,
                                                         klo, khi, search, smem, dq);
    if (!ranges || ntg > 0) pair_store_dq<T, D>(p, dq, b, h, bh, row0, gi * 32, rhi, ranges, warp, lane);
  }
#endif
}

static char* g_bwd_pair_ws = nullptr; /* the union region of the running backward, or null */
static int g_bwd_pairs_on = 1;

template <typename T, int D>
static int launch_bwd_pairs(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  constexpr int NS = 2, BM = 64, BN = 64;
  PairBwdParams<T> pp;
  pp.p = prm;
  pp.NP = (prm.NG + 1) / 2;
  const size_t rows = (size_t)sh->batch * (size_t)prm.H * (size_t)pp.NP;
  int* uni = (int*)(((uintptr_t)g_bwd_pair_ws + 15) & ~(uintptr_t)15);
  int* meta = uni + rows * (size_t)(2 * prm.kmax);
  pp.uni = uni;
  pp.meta = meta;
  dim3 mgrid((unsigned)((pp.NP + 127) / 128), (unsigned)prm.H, (unsigned)sh->batch);
  pair_merge_kernel<<<mgrid, 128, 0, stream>>>(prm.kv_index, prm.kv_count, prm.S, prm.H, prm.NG,
                                               prm.kmax, pp.NP, uni, meta);
  if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  const size_t smem = 1024 + (size_t)(2 * BM + 2 * NS * BN) * D * sizeof(T) +
                      (size_t)BM * BN * sizeof(T) + 2 * BM * sizeof(float) +
                      (size_t)(3 * NS * BN + BM) * sizeof(int);
  auto kern = pair_bwd_kernel<T, D, NS, 2>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  dim3 grid((unsigned)pp.NP, (unsigned)(sh->heads * prm.nranges), (unsigned)sh->batch);
  kern<<<grid, 128, smem, stream>>>(pp);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

/* The query-major passes: for pairs (G = 32, D 64 / 128, wgmma, the union region given) the
 * shipped dQ-only pass of the key-major heads, then the pair kernel for the others; else the
 * shipped passes. */
template <typename T, int D>
static int pairs_qmajor_d(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                          cudaStream_t stream) {
  const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T);
  if (g_bwd_pairs_on && g_bwd_pair_ws && wgmma && prm.G == 32 && prm.ks <= lim &&
      prm.vs <= lim && (int64_t)prm.S <= PAIR_KEY) {
    int st = DSV_OK;
    if (prm.km_enabled && (st = qmajor_cfg<T, D, 32, false>(sh, prm, stream)) != DSV_OK) return st;
    return launch_bwd_pairs<T, D>(sh, prm, stream);
  }
  return qmajor_passes<T, D>(sh, prm, wgmma, stream);
}

template <typename T>
static int pairs_qmajor(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                        cudaStream_t stream) {
  switch (sh->head_dim) {
    case 64: return pairs_qmajor_d<T, 64>(sh, prm, wgmma, stream);
    case 128: return pairs_qmajor_d<T, 128>(sh, prm, wgmma, stream);
    default: return bwd_qmajor_launch<T>(sh, prm, wgmma, stream);
  }
}

static size_t pair_bwd_base(const dsv_attn_shape* p) {
  return (dsv_shipped_sparse_attention_bwd_workspace_cuda(p) + 255) & ~(size_t)255;
}

}  // namespace dsv_attn

extern "C" int dsv_dev_sparse_attention_fwd_pairs_cuda(int pairs, const dsv_attn_shape* p,
                                                       dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                                       const int32_t* kv_index,
                                                       const int32_t* kv_count, dsv_bshd out,
                                                       void* lse, void* workspace,
                                                       size_t workspace_bytes, void* stream) {
  g_pair_ws = workspace;
  g_pair_ws_bytes = workspace_bytes;
  g_pairs_on = pairs != 0;
  /* no workspace for the shipped merged groups: this library measures its own pairs */
  const int st = fwd_entry(fwd_pairs<__half>, fwd_pairs<__nv_bfloat16>, nullptr, p, q, k, v,
                           kv_index, kv_count, out, lse, nullptr, 0, stream);
  g_pair_ws = nullptr;
  g_pair_ws_bytes = 0;
  g_pairs_on = 1;
  return st;
}

extern "C" size_t dsv_sparse_attention_fwd_workspace_cuda(const dsv_attn_shape* p) {
  return pair_ws_bytes(p);
}

extern "C" int dsv_sparse_attention_fwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                                             dsv_bshd v, const int32_t* kv_index,
                                             const int32_t* kv_count, dsv_bshd out, void* lse,
                                             void* workspace, size_t workspace_bytes,
                                             void* stream) {
  return dsv_dev_sparse_attention_fwd_pairs_cuda(1, p, q, k, v, kv_index, kv_count, out, lse,
                                                 workspace, workspace_bytes, stream);
}

extern "C" int dsv_dev_sparse_attention_bwd_pairs_cuda(
    int pairs, const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v, dsv_bshd out,
    dsv_bshd dout, const void* lse, const int32_t* kv_index, const int32_t* kv_count,
    dsv_bshd dq, dsv_bshd dk, dsv_bshd dv, void* workspace, size_t workspace_bytes,
    void* stream) {
  const size_t need = pair_ws_bytes(p);
  g_bwd_pair_ws = nullptr;
  if (pairs && need > 0 && workspace && check_attn_args(p) == DSV_OK) {
    const size_t base = pair_bwd_base(p);
    if (base > 0 && workspace_bytes >= base + need) g_bwd_pair_ws = (char*)workspace + base;
  }
  g_bwd_pairs_on = pairs != 0;
  const BwdQmajor qm = {pairs_qmajor<__half>, pairs_qmajor<__nv_bfloat16>};
  const int st = bwd_entry(qm, p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv,
                           workspace, workspace_bytes, stream);
  g_bwd_pair_ws = nullptr;
  g_bwd_pairs_on = 1;
  return st;
}

extern "C" size_t dsv_sparse_attention_bwd_workspace_cuda(const dsv_attn_shape* p) {
  const size_t base = dsv_shipped_sparse_attention_bwd_workspace_cuda(p);
  const size_t need = pair_ws_bytes(p);
  if (base == 0 || need == 0) return base;
  return pair_bwd_base(p) + need;
}

extern "C" int dsv_sparse_attention_bwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                                             dsv_bshd v, dsv_bshd out, dsv_bshd dout,
                                             const void* lse, const int32_t* kv_index,
                                             const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk,
                                             dsv_bshd dv, void* workspace,
                                             size_t workspace_bytes, void* stream) {
  return dsv_dev_sparse_attention_bwd_pairs_cuda(1, p, q, k, v, out, dout, lse, kv_index,
                                                 kv_count, dq, dk, dv, workspace,
                                                 workspace_bytes, stream);
}
