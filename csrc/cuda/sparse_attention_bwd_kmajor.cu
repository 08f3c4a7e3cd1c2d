/*
 * sparse_attention_bwd_kmajor.cu - the key-major pass of the sparse attention backward: one CTA
 * per 64-key block of a key-major head walks the block's (group, mask) entries (built by
 * sparse_attention_bwd_index.cu), recomputes S^T, P^T, dP^T, dS^T for the group's queries
 * against its 64 keys (masked) and accumulates dK, dV in registers, written once, without
 * atomics (see sparse_attention_bwd.cu).
 */
#include "sparse_attention_bwd.cuh"

namespace dsv_attn {

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
int bwd_kmajor_launch(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  if (!prm.km_enabled) return DSV_OK;
  const bool g64 = prm.G % 64 == 0;
  switch (sh->head_dim) {
    case 64: return g64 ? launch_kmajor<T, 64, 64>(sh, prm, stream) : launch_kmajor<T, 64, 32>(sh, prm, stream);
    case 96: return g64 ? launch_kmajor<T, 96, 64>(sh, prm, stream) : launch_kmajor<T, 96, 32>(sh, prm, stream);
    case 128:
      return g64 ? launch_kmajor<T, 128, 64>(sh, prm, stream) : launch_kmajor<T, 128, 32>(sh, prm, stream);
    default: return DSV_OK; /* key-major needs head_dim <= 128 (km_enabled is 0 above) */
  }
}

template int bwd_kmajor_launch<__half>(const dsv_attn_shape*, BwdParams<__half>&, cudaStream_t);
template int bwd_kmajor_launch<__nv_bfloat16>(const dsv_attn_shape*, BwdParams<__nv_bfloat16>&,
                                              cudaStream_t);

}  // namespace dsv_attn
