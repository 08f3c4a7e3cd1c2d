/*
 * sparse_attention_bwd_kmajor.cu - the key-major pass of the sparse attention backward: one CTA
 * per 64-key block of a key-major head walks the block's (group, mask) entries (built by
 * sparse_attention_bwd_index.cu), recomputes S^T, P^T, dP^T, dS^T for the group's queries
 * against its 64 keys (masked) and accumulates dK, dV in registers, written once, without
 * atomics (see sparse_attention_bwd.cu).
 *
 * Two kernels, the same entries, the same arithmetic (P^T and dS^T in fp32, rounded to the input
 * type for the products, fp32 sums in registers in entry order; dK scaled once at the end):
 *   bwd_kmajor_kernel     mma.sync (any sm_80+), D 64 / 96 / 128, query chunks of 64 or 32;
 *   bwd_kmajor_wg_kernel  wgmma (sm_90a, the tuning's wgmma and km_wgmma), D 64 / 128, G >= 64;
 *                         token lists and 64-key block lists (16-key ones with km_wgmma = 2).
 * They differ in the order of the fp32 sums inside the tensor-core products, and where a query's
 * delta is NaN: the wgmma kernel sets dS^T of the keys an entry does not select to 0, while
 * mma.sync forms 0 x (dP^T - delta) = NaN there for the keys of a warp's 16 that it computes.
 */
#include "sparse_attention_bwd.cuh"
#include "sparse_attention_bwd_wg.cuh" /* bwg_scores, the swizzled-tile descriptors (sm_90a) */

namespace dsv_attn {

/* The (group, mask) entries of key block kblk of head bh (ascending group order) and the work
 * items they give: each entry's group in chunks of QC queries. */
template <int QC>
struct KmajorEntries {
  int nent, cpg, nitems;
  const int* eg;
  const unsigned long long* em;
  template <typename T>
  __device__ __forceinline__ KmajorEntries(const BwdParams<T>& p, size_t bh, int kblk) {
    nent = p.kbcount[bh * p.nkb + kblk];
    const int eoff = p.kboff[bh * p.nkb + kblk];
    eg = p.entg + bh * p.cap + eoff;
    em = p.entmask + bh * p.cap + eoff;
    cpg = (p.G + QC - 1) / QC;
    nitems = nent * cpg;
  }
};

/* Each thread's two key rows (key_a, key_b: the accumulator rows of its lane) of dK (scaled) and
 * dV, written in the input dtype; keys >= S are not written. Both key-major kernels end here. */
template <typename T, int D>
static __device__ __forceinline__ void kmajor_store(const BwdParams<T>& p, int b, int h, int key_a,
                                                    int key_b, int lane, const float (&dk)[D / 8][4],
                                                    const float (&dv)[D / 8][4]) {
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
  const KmajorEntries<QC> E(p, bh, kblk);
  const int nent = E.nent, cpg = E.cpg, nitems = E.nitems;
  const int* eg = E.eg;
  const unsigned long long* em = E.em;

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

  kmajor_store<T, D>(p, b, h, key0 + kr0, key0 + kr1, lane, dk, dv);
}

/* Key-major kernel on wgmma (sm_90a): one warpgroup (4 warps) per 64-key block, the same
 * (group, mask) entries and work items (entry, chunk of 64 of the group's queries) as
 * bwd_kmajor_kernel. K and V of the block are loaded once; Q and dO of the items go through 2
 * cp.async stages, the next item's issued while the item's score products run (one barrier per
 * item); every tile is a 64-row swizzled tile (wgmma.cuh). Per item:
 *   S^T = K Q^T, dP^T = V dO^T   m64n64k16 x D / 16 each, both operands K-major in shared memory
 *                                (two commit groups: P^T is formed while dP^T is in flight, and
 *                                dV's products are issued before dS^T is formed)
 *   P^T = exp2(S^T scale log2e - lse log2e) on the keys the entry's mask selects, else 0;
 *   dS^T = P^T (dP^T - delta)    in registers (warp w holds keys 16 w .. 16 w + 15, the layout
 *                                of the mma.sync kernel's fragments, so the same code)
 *   dV += P^T dO, dK += dS^T Q   m64nDk16 x 4 each, A = P^T / dS^T from registers (the m16n8k16
 *                                A fragments of the accumulators, as the forward's P V), B = dO /
 *                                Q MN-major ("transposed") from the same swizzled tiles
 * dK and dV (64 keys x D, fp32) stay in registers over all items (128 registers at D = 128) and
 * are written once. No per-warp skip (the 4 warps issue each wgmma together): an item whose mask
 * is 0 is skipped whole. Rows of a chunk past the group or S: Q / dO zero, lse +inf (P = 0).
 * Shared memory (D = 128): K, V 2 x 16 KB, Q, dO 2 stages x 2 x 16 KB, 96 KB + 1.5 KB: 2 CTAs
 * per SM. */
template <typename T, int D>
__global__ void __launch_bounds__(128, 2) bwd_kmajor_wg_kernel(const BwdParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NT = 128, QC = 64, TE = KB * D; /* elements of one 64-row tile */
  constexpr int CH = D / 8;
  static_assert(QC == KB, "64-row tiles throughout");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + TE;
  T* Qs = Vs + TE;      /* [2][TE] */
  T* dOs = Qs + 2 * TE; /* [2][TE] */
  float* lse2 = reinterpret_cast<float*>(dOs + 2 * TE); /* [2][QC] */
  float* dlt = lse2 + 2 * QC;                             /* [2][QC] */
  int* kidx = reinterpret_cast<int*>(dlt + 2 * QC);       /* [KB] */

  const int kblk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != 1) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int key0 = kblk * KB;
  const KmajorEntries<QC> E(p, bh, kblk);
  const int cpg = E.cpg, nitems = E.nitems;
  const int* eg = E.eg;
  const unsigned long long* em = E.em;

  const T* qbase = p.q + b * p.qb + h * p.qh;
  const T* gbase = p.dout + b * p.gb + h * p.gh;
  const float* lrow = p.lse + bh * p.S;
  const float* drow = p.delta + bh * p.S;

  for (int r = tid; r < KB; r += NT) kidx[r] = key0 + r < p.S ? key0 + r : -1;
  __syncthreads();
  gather_rows_async<T, D, NT, KB, true>(Ks, p.k + b * p.kb + h * p.kh, p.ks, kidx, KB);
  gather_rows_async<T, D, NT, KB, true>(Vs, p.v + b * p.vb + h * p.vh, p.vs, kidx, KB);

  /* issue the loads of work item `it` (entry it / cpg, query chunk it % cpg) into stage bf */
  auto issue = [&](int it, int bf) {
    const int e = it / cpg, c = it - e * cpg;
    const int g = __ldg(eg + e);
    const int q0 = g * p.G + c * QC;
    const int qend = min(g * p.G + p.G, p.S);
    T* qt = Qs + bf * TE;
    T* gt = dOs + bf * TE;
    for (int i = tid; i < QC * CH; i += NT) {
      const int r = i / CH, cc = i - r * CH;
      const int row = q0 + r;
      const bool valid = row < qend;
      const T* qs = valid ? qbase + (int64_t)row * p.qs + cc * 8 : qbase;
      const T* gs = valid ? gbase + (int64_t)row * p.gs + cc * 8 : gbase;
      const int off = tile_off<D, QC, true>(r, cc);
      cp_async16(qt + off, qs, valid);
      cp_async16(gt + off, gs, valid);
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
  float st[QC / 8][4], dpt[QC / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
#pragma unroll
  for (int i = 0; i < QC / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
  const int kr0 = warp * 16 + (lane >> 2), kr1 = kr0 + 8;
  /* K, V, Q, dO K-major (the scores); Q, dO MN-major (B of dK, dV); stage offsets in bytes */
  const uint64_t kdesc = wg_desc(smem_u32(Ks), 16, 1024);
  const uint64_t vdesc = wg_desc(smem_u32(Vs), 16, 1024);
  const uint64_t qdesc0 = wg_desc(smem_u32(Qs), 16, 1024);
  const uint64_t gdesc0 = wg_desc(smem_u32(dOs), 16, 1024);
  const uint64_t qtdesc0 = wg_desc(smem_u32(Qs), QC * 128, 1024);
  const uint64_t gtdesc0 = wg_desc(smem_u32(dOs), QC * 128, 1024);

  /* One barrier per item: it follows this thread's wait for the item's loads and its wait for the
   * previous item's products, so after it the item's tiles are visible to the tensor cores and
   * the other stage (the previous item's) is free for the next item's loads. */
  for (int it = 0; it < nitems; ++it) {
    const int bf = it & 1;
    cp_async_wait<0>();       /* item it's loads, issued during the previous item */
    fence_proxy_async_smem(); /* this thread's cp.async writes -> visible to the tensor cores */
    __syncthreads();
    const unsigned long long mask = __ldg(em + it / cpg);
    if (mask == 0ull) { /* uniform over the CTA: nothing to compute, the next item's loads */
      if (it + 1 < nitems) issue(it + 1, bf ^ 1);
      cp_async_commit();
    } else {
      /* (the products are waited for in the branch that issues them: ptxas serializes wgmma
       * otherwise, C7514) */
      const uint32_t toff = bf * TE * 2;
      wg_fence();
      bwg_scores<T, D, QC>(st, kdesc, wg_desc_add(qdesc0, toff));
      wg_commit();
      bwg_scores<T, D, QC>(dpt, vdesc, wg_desc_add(gdesc0, toff));
      wg_commit();
      /* the next item's loads (their address work) while S^T and dP^T run */
      if (it + 1 < nitems) issue(it + 1, bf ^ 1);
      cp_async_commit();
      const float* ls = lse2 + bf * QC;
      const float* dl = dlt + bf * QC;
      const bool kv0 = (mask >> kr0) & 1ull, kv1 = (mask >> kr1) & 1ull;
      wg_wait<1>();
      wg_fence_regs<QC / 2>(&st[0][0]);
      /* P^T (keys x queries), and as A fragments (m16n8k16: columns 16 kq .. 16 kq + 15) */
      uint32_t pa[QC / 16][4], sa[QC / 16][4];
#pragma unroll
      for (int nt = 0; nt < QC / 8; ++nt) {
        const int col = nt * 8 + (lane & 3) * 2;
        const float l0 = ls[col], l1 = ls[col + 1];
        st[nt][0] = kv0 ? fast_exp2(st[nt][0] * p.scale_log2 - l0) : 0.f;
        st[nt][1] = kv0 ? fast_exp2(st[nt][1] * p.scale_log2 - l1) : 0.f;
        st[nt][2] = kv1 ? fast_exp2(st[nt][2] * p.scale_log2 - l0) : 0.f;
        st[nt][3] = kv1 ? fast_exp2(st[nt][3] * p.scale_log2 - l1) : 0.f;
        const int kq = nt >> 1, hf = (nt & 1) * 2;
        pa[kq][hf] = Elem<T>::pack(st[nt][0], st[nt][1]);
        pa[kq][hf + 1] = Elem<T>::pack(st[nt][2], st[nt][3]);
      }
      /* dV += P^T dO, issued before dS^T is formed: it runs while dP^T completes and dS^T is
       * computed */
      wg_fence();
#pragma unroll
      for (int kq = 0; kq < QC / 16; ++kq)
        Wgmma<T, D>::rs_bt(&dv[0][0], pa[kq], wg_desc_add(gtdesc0, toff + kq * 2048), 1);
      wg_commit();
      wg_wait<1>(); /* dP^T (the older group) */
      wg_fence_regs<QC / 2>(&dpt[0][0]);
      /* dS^T as A fragments */
#pragma unroll
      for (int nt = 0; nt < QC / 8; ++nt) {
        const int col = nt * 8 + (lane & 3) * 2;
        const float d0 = dl[col], d1 = dl[col + 1];
        /* keys the entry does not select: dS^T exactly 0, not 0 x (dP^T - delta), which is NaN
         * when a query's delta is (a NaN key elsewhere in its list) and would reach dK of keys
         * that the group never selected */
        const float s0 = kv0 ? st[nt][0] * (dpt[nt][0] - d0) : 0.f;
        const float s1 = kv0 ? st[nt][1] * (dpt[nt][1] - d1) : 0.f;
        const float s2 = kv1 ? st[nt][2] * (dpt[nt][2] - d0) : 0.f;
        const float s3 = kv1 ? st[nt][3] * (dpt[nt][3] - d1) : 0.f;
        const int kq = nt >> 1, hf = (nt & 1) * 2;
        sa[kq][hf] = Elem<T>::pack(s0, s1);
        sa[kq][hf + 1] = Elem<T>::pack(s2, s3);
      }
      /* dK += dS^T Q */
      wg_fence();
#pragma unroll
      for (int kq = 0; kq < QC / 16; ++kq)
        Wgmma<T, D>::rs_bt(&dk[0][0], sa[kq], wg_desc_add(qtdesc0, toff + kq * 2048), 1);
      wg_commit();
      wg_wait<0>(); /* before the barrier after which this stage is refilled */
      wg_fence_regs<D / 2>(&dv[0][0]);
      wg_fence_regs<D / 2>(&dk[0][0]);
    }
  }
  cp_async_wait<0>();

  kmajor_store<T, D>(p, b, h, key0 + kr0, key0 + kr1, lane, dk, dv);
#endif
}

/* Whether bwd_kmajor_wg_kernel applies (the device side, an sm_90a build on a 9.0 device with
 * km_wgmma on, is the caller's): D 64 or 128, G >= 64. */
template <int D>
static bool kmajor_wg_applies(int G) {
  return (D == 64 || D == 128) && G >= 64;
}

template <typename T, int D>
static int launch_kmajor_wg(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  const size_t smem = 1024 + (size_t)6 * KB * D * sizeof(T) + (size_t)4 * KB * sizeof(float) +
                      (size_t)KB * sizeof(int);
  auto kern = bwd_kmajor_wg_kernel<T, D>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  dim3 grid((unsigned)prm.nkb, (unsigned)sh->heads, (unsigned)sh->batch);
  kern<<<grid, 128, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
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

template <typename T>
int bwd_kmajor_launch(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                      cudaStream_t stream) {
  if (!prm.km_enabled) return DSV_OK;
  const bool g64 = prm.G % 64 == 0;
  /* 16-key block lists stay on mma.sync unless wgmma is 2: their entries select 1.16 of the 4
   * 16-key quarters on average (random blocks at 0.9), which the mma.sync kernel skips warp by
   * warp, while the warpgroup computes all 64 keys of every entry (benchmarks/PERF_LOG.md v13) */
  if (wgmma == 2 || (wgmma == 1 && prm.blk != 16)) {
    if (sh->head_dim == 64 && kmajor_wg_applies<64>(prm.G))
      return launch_kmajor_wg<T, 64>(sh, prm, stream);
    if (sh->head_dim == 128 && kmajor_wg_applies<128>(prm.G))
      return launch_kmajor_wg<T, 128>(sh, prm, stream);
  }
  switch (sh->head_dim) {
    case 64: return g64 ? launch_kmajor<T, 64, 64>(sh, prm, stream) : launch_kmajor<T, 64, 32>(sh, prm, stream);
    case 96: return g64 ? launch_kmajor<T, 96, 64>(sh, prm, stream) : launch_kmajor<T, 96, 32>(sh, prm, stream);
    case 128:
      return g64 ? launch_kmajor<T, 128, 64>(sh, prm, stream) : launch_kmajor<T, 128, 32>(sh, prm, stream);
    default: return DSV_OK; /* key-major needs head_dim <= 128 (km_enabled is 0 above) */
  }
}

template int bwd_kmajor_launch<__half>(const dsv_attn_shape*, BwdParams<__half>&, int,
                                       cudaStream_t);
template int bwd_kmajor_launch<__nv_bfloat16>(const dsv_attn_shape*, BwdParams<__nv_bfloat16>&,
                                              int, cudaStream_t);

}  // namespace dsv_attn
