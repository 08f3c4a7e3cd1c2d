/*
 * sparse_attention.c - C11 reference kernels of sparse grouped attention (forward + backward).
 *
 * Forward: for each (batch, head, group) task, the group's key list is walked in tiles of
 * DSV_SA_TILE entries; every query of the group keeps an online-softmax state (running max m,
 * running sum l, output accumulator of head_dim values), so memory per query is O(head_dim + tile)
 * and never O(S). OpenMP parallelises over (batch, head, group).
 *
 * Backward: P is recomputed from lse, D_i = dout_i . out_i, dS = P * (dP - D_i),
 *   dq_i = scale * sum_j dS_ij k_j,  dk_j += scale * dS_ij q_i,  dv_j += P_ij dout_i.
 * dk / dv receive contributions from many groups; to stay race-free the kernel either
 * parallelises over (batch, head) pairs (when there are at least as many pairs as threads), or,
 * for few pairs, over groups with one private [S, D] dk/dv buffer per thread that is reduced
 * afterwards (at most 512 MiB of such buffers: fewer threads for very long sequences).
 *
 * Key blocks (p->kv_block = b > 1): list entry e stands for the keys e*b .. min(e*b+b, S)-1; the
 * tiles are filled by expanding entries key by key (sa_fill_tile), so every per-key rule (skipped
 * entries, duplicates counting twice, NaN handling) is the one of token lists. b = 1 walks the
 * list exactly as before: a tile is DSV_SA_TILE entries, invalid ones dropped.
 *
 * This file includes itself twice (DSV_T = float, then double) to instantiate both dtypes.
 */
#ifndef DSV_T

#include "cpu_common.h"

#define DSV_SA_TILE 64

/* The next tile of keys of a list of `count` entries, from entry *j (and, for blocks, key *o of
 * that entry's block) on; both are advanced past what was taken. Writes the key positions to
 * tidx (at most DSV_SA_TILE) and returns how many; 0 with *j < count happens for b = 1 (a tile
 * of only invalid entries), and the caller just asks again. Entries outside [0, ceil(S/b)) are
 * skipped, like token entries outside [0, S); the last block stops at S. */
static int64_t sa_fill_tile(const int32_t* list, int64_t count, int64_t kb, int64_t S, int64_t* j,
                            int64_t* o, int64_t* tidx) {
  int64_t nt = 0;
  if (kb == 1) {
    const int64_t jn = DSV_MIN((int64_t)DSV_SA_TILE, count - *j);
    for (int64_t t = 0; t < jn; ++t) {
      const int32_t key = list[*j + t];
      if (key >= 0 && (int64_t)key < S) tidx[nt++] = key;
    }
    *j += jn;
    return nt;
  }
  const int64_t nblocks = (S - 1) / kb + 1; /* S >= 1 here */
  while (*j < count && nt < DSV_SA_TILE) {
    const int32_t e = list[*j];
    if (e < 0 || (int64_t)e >= nblocks) {
      ++*j;
      *o = 0;
      continue;
    }
    const int64_t k0 = (int64_t)e * kb; /* <= S - 1: no overflow below */
    const int64_t kn = S - k0 < kb ? S - k0 : kb;
    while (*o < kn && nt < DSV_SA_TILE) tidx[nt++] = k0 + (*o)++;
    if (*o >= kn) {
      ++*j;
      *o = 0;
    }
  }
  return nt;
}

#define DSV_T float
#define DSV_SUF f32
#define DSV_EXP expf
#define DSV_LOG logf
#include "sparse_attention.c"
#undef DSV_T
#undef DSV_SUF
#undef DSV_EXP
#undef DSV_LOG

#define DSV_T double
#define DSV_SUF f64
#define DSV_EXP exp
#define DSV_LOG log
#include "sparse_attention.c"
#undef DSV_T
#undef DSV_SUF
#undef DSV_EXP
#undef DSV_LOG

static int dsv_sa_check(const dsv_attn_shape* p) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->head_dim <= 0 || p->group_size <= 0 ||
      p->kmax < 0 || p->num_groups < 0 || p->kv_block < 1)
    return DSV_ERR_INVALID;
  /* ceil(S / G) without the overflow of S + G - 1 */
  if (p->num_groups != (p->seqlen == 0 ? 0 : (p->seqlen - 1) / p->group_size + 1))
    return DSV_ERR_INVALID;
  if (!dsv_is_float_dtype(p->dtype)) return DSV_ERR_UNSUPPORTED;
  /* every element count and offset the kernels form must fit in int64 (and size_t) */
  int64_t n = 0;
  if (dsv_mul_ok(p->batch, p->heads, &n) != DSV_OK || dsv_mul_ok(n, p->seqlen, &n) != DSV_OK ||
      dsv_mul_ok(n, p->head_dim, &n) != DSV_OK || dsv_mul_ok(n, 16, &n) != DSV_OK)
    return DSV_ERR_INVALID;
  if (dsv_mul_ok(p->batch, p->heads, &n) != DSV_OK || dsv_mul_ok(n, p->num_groups, &n) != DSV_OK ||
      dsv_mul_ok(n, p->kmax, &n) != DSV_OK || dsv_mul_ok(n, 8, &n) != DSV_OK)
    return DSV_ERR_INVALID;
  return DSV_OK;
}

int dsv_sparse_attention_fwd_cpu(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                 const int32_t* kv_index, const int32_t* kv_count,
                                 dsv_bshd out, void* lse) {
  int st = dsv_sa_check(p);
  if (st != DSV_OK) return st;
  if (p->batch == 0 || p->seqlen == 0 || p->heads == 0) return DSV_OK;
  if (!q.data || !k.data || !v.data || !kv_count || !out.data || !lse) return DSV_ERR_INVALID;
  if (p->kmax > 0 && !kv_index) return DSV_ERR_INVALID;
  if (p->dtype == DSV_FLOAT32)
    return sa_fwd_f32(p, &q, &k, &v, kv_index, kv_count, &out, (float*)lse);
  return sa_fwd_f64(p, &q, &k, &v, kv_index, kv_count, &out, (double*)lse);
}

int dsv_sparse_attention_bwd_cpu(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                 dsv_bshd out, dsv_bshd dout, const void* lse,
                                 const int32_t* kv_index, const int32_t* kv_count,
                                 dsv_bshd dq, dsv_bshd dk, dsv_bshd dv) {
  int st = dsv_sa_check(p);
  if (st != DSV_OK) return st;
  if (p->batch == 0 || p->seqlen == 0 || p->heads == 0) return DSV_OK;
  if (!q.data || !k.data || !v.data || !out.data || !dout.data || !lse || !kv_count ||
      !dq.data || !dk.data || !dv.data)
    return DSV_ERR_INVALID;
  if (p->kmax > 0 && !kv_index) return DSV_ERR_INVALID;
  if (p->dtype == DSV_FLOAT32)
    return sa_bwd_f32(p, &q, &k, &v, &out, &dout, (const float*)lse, kv_index, kv_count, &dq,
                      &dk, &dv);
  return sa_bwd_f64(p, &q, &k, &v, &out, &dout, (const double*)lse, kv_index, kv_count, &dq,
                    &dk, &dv);
}

#else /* ---------------- dtype-generic part (DSV_T defined) ---------------- */

static inline DSV_T DSV_FN(sa_dot)(const DSV_T* a, const DSV_T* b, int64_t n) {
  DSV_T s = 0;
  DSV_OMP(simd reduction(+ : s))
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

/* Forward over one (b, h, g) task. State arrays are per thread: m[G], l[G], acc[G*D], sc[TILE],
 * tile_idx[TILE]. */
static void DSV_FN(sa_fwd_group)(const dsv_attn_shape* p, const dsv_bshd* q, const dsv_bshd* k,
                                 const dsv_bshd* v, const int32_t* list, int64_t count, int64_t b,
                                 int64_t h, int64_t g, const dsv_bshd* out, DSV_T* lse,
                                 DSV_T* m, DSV_T* l, int64_t* nv, DSV_T* acc, DSV_T* sc,
                                 int64_t* tidx) {
  const int64_t S = p->seqlen, D = p->head_dim, G = p->group_size;
  const DSV_T scale = (DSV_T)p->scale;
  const int64_t s0 = g * G;
  const int64_t nq = DSV_MIN(G, S - s0);
  const DSV_T* qd = (const DSV_T*)q->data;
  const DSV_T* kd = (const DSV_T*)k->data;
  const DSV_T* vd = (const DSV_T*)v->data;
  DSV_T* od = (DSV_T*)out->data;

  for (int64_t i = 0; i < nq; ++i) {
    m[i] = -INFINITY;
    l[i] = 0;
    nv[i] = 0;
    memset(acc + i * D, 0, (size_t)D * sizeof(DSV_T));
  }
  int64_t jc = 0, oc = 0; /* list cursor: entry, key within the entry's block */
  while (jc < count) {
    const int64_t nt = sa_fill_tile(list, count, p->kv_block, S, &jc, &oc, tidx); /* valid keys */
    if (nt == 0) continue;
    for (int64_t i = 0; i < nq; ++i) {
      const DSV_T* qi = qd + dsv_off(q, b, s0 + i, h);
      DSV_T tmax = -INFINITY;
      for (int64_t j = 0; j < nt; ++j) {
        const DSV_T s = scale * DSV_FN(sa_dot)(qi, kd + dsv_off(k, b, tidx[j], h), D);
        sc[j] = s;
        if (s > tmax) tmax = s;
      }
      /* NaN scores do not move the maximum (the comparisons are false) but make exp() NaN
       * below, so l and acc turn NaN and the row's output is NaN, as with SDPA; +inf scores
       * give exp(inf - inf) = NaN the same way. Scores of -inf add exp(-inf) = 0. */
      const DSV_T mnew = tmax > m[i] ? tmax : m[i];
      const DSV_T mu = mnew == -INFINITY ? (DSV_T)0 : mnew; /* all -inf so far: p = 0 */
      nv[i] += nt;
      DSV_T* ai = acc + i * D;
      if (m[i] != mnew) { /* rescale the previous state (m[i] == -inf -> everything is 0) */
        const DSV_T alpha = (m[i] == -INFINITY) ? (DSV_T)0 : DSV_EXP(m[i] - mnew);
        l[i] *= alpha;
        for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
        m[i] = mnew;
      }
      for (int64_t j = 0; j < nt; ++j) {
        const DSV_T pj = DSV_EXP(sc[j] - mu);
        l[i] += pj;
        const DSV_T* vj = vd + dsv_off(v, b, tidx[j], h);
        DSV_OMP(simd)
        for (int64_t d = 0; d < D; ++d) ai[d] += pj * vj[d];
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    DSV_T* oi = od + dsv_off(out, b, s0 + i, h);
    DSV_T* lse_i = lse + (b * p->heads + h) * S + s0 + i;
    if (nv[i] == 0) { /* an empty list: zeros, lse = -inf (dsv.h) */
      for (int64_t d = 0; d < D; ++d) oi[d] = 0;
      *lse_i = -INFINITY;
    } else if (l[i] == 0) { /* every score -inf: softmax is 0 / 0, NaN as with SDPA */
      for (int64_t d = 0; d < D; ++d) oi[d] = (DSV_T)NAN;
      *lse_i = (DSV_T)NAN;
    } else { /* l NaN (a NaN or +inf score) gives NaN output and lse */
      const DSV_T inv = (DSV_T)1 / l[i];
      for (int64_t d = 0; d < D; ++d) oi[d] = acc[i * D + d] * inv;
      *lse_i = m[i] + DSV_LOG(l[i]);
    }
  }
}

static int DSV_FN(sa_fwd)(const dsv_attn_shape* p, const dsv_bshd* q, const dsv_bshd* k,
                          const dsv_bshd* v, const int32_t* kv_index, const int32_t* kv_count,
                          const dsv_bshd* out, DSV_T* lse) {
  const int64_t B = p->batch, H = p->heads, NG = p->num_groups, G = p->group_size,
                D = p->head_dim, KM = p->kmax;
  const int64_t ntasks = B * H * NG;
  const int64_t GQ = DSV_MIN(G, p->seqlen); /* queries of the largest group */
  int err = 0;
  DSV_OMP(parallel) {
    DSV_T* m = (DSV_T*)malloc((size_t)GQ * sizeof(DSV_T));
    DSV_T* l = (DSV_T*)malloc((size_t)GQ * sizeof(DSV_T));
    int64_t* nv = (int64_t*)malloc((size_t)GQ * sizeof(int64_t));
    DSV_T* acc = (DSV_T*)malloc((size_t)(GQ * D) * sizeof(DSV_T));
    DSV_T* sc = (DSV_T*)malloc(DSV_SA_TILE * sizeof(DSV_T));
    int64_t* tidx = (int64_t*)malloc(DSV_SA_TILE * sizeof(int64_t));
    const int ok = m && l && nv && acc && sc && tidx;
    if (!ok) {
      DSV_OMP(atomic write)
      err = 1;
    }
    DSV_OMP(for schedule(dynamic, 1))
    for (int64_t t = 0; t < ntasks; ++t) {
      if (!ok) continue;
      const int64_t g = t % NG;
      const int64_t bh = t / NG;
      const int64_t b = bh / H, h = bh % H;
      const int64_t count = dsv_clamp_count(kv_count[bh], KM);
      const int32_t* list = count > 0 ? kv_index + (bh * NG + g) * KM : NULL;
      DSV_FN(sa_fwd_group)(p, q, k, v, list, count, b, h, g, out, lse, m, l, nv, acc, sc, tidx);
    }
    free(m);
    free(l);
    free(nv);
    free(acc);
    free(sc);
    free(tidx);
  }
  return err ? DSV_ERR_NOMEM : DSV_OK;
}

/* Backward over one (b, h, g) task. dq rows of the group are written; dk / dv contributions are
 * added to dkb / dvb, where key s, dim d lives at dkb[s * kstride + d] / dvb[s * vstride + d]. Scratch per thread:
 * dqa[G*D], Di[G], tidx[TILE]. */
static void DSV_FN(sa_bwd_group)(const dsv_attn_shape* p, const dsv_bshd* q, const dsv_bshd* k,
                                 const dsv_bshd* v, const dsv_bshd* out, const dsv_bshd* dout,
                                 const DSV_T* lse, const int32_t* list, int64_t count, int64_t b,
                                 int64_t h, int64_t g, const dsv_bshd* dq, DSV_T* dkb,
                                 DSV_T* dvb, int64_t kstride, int64_t vstride, DSV_T* dqa,
                                 DSV_T* Di, int64_t* tidx) {
  const int64_t S = p->seqlen, D = p->head_dim, G = p->group_size;
  const DSV_T scale = (DSV_T)p->scale;
  const int64_t s0 = g * G;
  const int64_t nq = DSV_MIN(G, S - s0);
  const DSV_T* qd = (const DSV_T*)q->data;
  const DSV_T* kd = (const DSV_T*)k->data;
  const DSV_T* vd = (const DSV_T*)v->data;
  const DSV_T* od = (const DSV_T*)out->data;
  const DSV_T* dod = (const DSV_T*)dout->data;
  DSV_T* dqd = (DSV_T*)dq->data;
  const DSV_T* lse_bh = lse + (b * p->heads + h) * S;

  for (int64_t i = 0; i < nq; ++i) {
    memset(dqa + i * D, 0, (size_t)D * sizeof(DSV_T));
    Di[i] = DSV_FN(sa_dot)(dod + dsv_off(dout, b, s0 + i, h), od + dsv_off(out, b, s0 + i, h), D);
  }
  int64_t jc = 0, oc = 0; /* list cursor: entry, key within the entry's block */
  while (jc < count) {
    const int64_t nt = sa_fill_tile(list, count, p->kv_block, S, &jc, &oc, tidx); /* valid keys */
    if (nt == 0) continue;
    for (int64_t i = 0; i < nq; ++i) {
      const DSV_T li = lse_bh[s0 + i];
      if (li == -INFINITY) continue; /* no valid key: P = 0 (a NaN lse makes P, dq NaN) */
      const DSV_T* qi = qd + dsv_off(q, b, s0 + i, h);
      const DSV_T* doi = dod + dsv_off(dout, b, s0 + i, h);
      DSV_T* dqi = dqa + i * D;
      for (int64_t j = 0; j < nt; ++j) {
        const DSV_T* kj = kd + dsv_off(k, b, tidx[j], h);
        const DSV_T* vj = vd + dsv_off(v, b, tidx[j], h);
        const DSV_T pij = DSV_EXP(scale * DSV_FN(sa_dot)(qi, kj, D) - li);
        const DSV_T dpij = DSV_FN(sa_dot)(doi, vj, D);
        const DSV_T ds = pij * (dpij - Di[i]) * scale;
        DSV_T* dkj = dkb + tidx[j] * kstride;
        DSV_T* dvj = dvb + tidx[j] * vstride;
        DSV_OMP(simd)
        for (int64_t d = 0; d < D; ++d) {
          dqi[d] += ds * kj[d];
          dkj[d] += ds * qi[d];
          dvj[d] += pij * doi[d];
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    DSV_T* dst = dqd + dsv_off(dq, b, s0 + i, h);
    memcpy(dst, dqa + i * D, (size_t)D * sizeof(DSV_T));
  }
}

static int DSV_FN(sa_bwd)(const dsv_attn_shape* p, const dsv_bshd* q, const dsv_bshd* k,
                          const dsv_bshd* v, const dsv_bshd* out, const dsv_bshd* dout,
                          const DSV_T* lse, const int32_t* kv_index, const int32_t* kv_count,
                          const dsv_bshd* dq, const dsv_bshd* dk, const dsv_bshd* dv) {
  const int64_t B = p->batch, H = p->heads, NG = p->num_groups, G = p->group_size,
                D = p->head_dim, KM = p->kmax, S = p->seqlen;
  const int64_t nbh = B * H;
  const int64_t GQ = DSV_MIN(G, S); /* queries of the largest group */
  const int nthreads = dsv_max_threads();
  DSV_T* dkd = (DSV_T*)dk->data;
  DSV_T* dvd = (DSV_T*)dv->data;
  int err = 0;

  /* Mode B keeps one private [2, S, D] buffer per thread: cap their total at 512 MiB. */
  const size_t per_thread = (size_t)(2 * S * D) * sizeof(DSV_T);
  int team_b = nthreads;
  if ((size_t)team_b * per_thread > ((size_t)512 << 20))
    team_b = (int)DSV_MAX((size_t)1, ((size_t)512 << 20) / per_thread);

  if (nbh >= team_b) {
    /* Mode A: one (b, h) pair per task; dk / dv slices are private to the task. */
    DSV_OMP(parallel) {
      DSV_T* dqa = (DSV_T*)malloc((size_t)(GQ * D) * sizeof(DSV_T));
      DSV_T* Di = (DSV_T*)malloc((size_t)GQ * sizeof(DSV_T));
      int64_t* tidx = (int64_t*)malloc(DSV_SA_TILE * sizeof(int64_t));
      const int ok = dqa && Di && tidx;
      if (!ok) {
        DSV_OMP(atomic write)
        err = 1;
      }
      DSV_OMP(for schedule(dynamic, 1))
      for (int64_t bh = 0; bh < nbh; ++bh) {
        if (!ok) continue;
        const int64_t b = bh / H, h = bh % H;
        DSV_T* dkb = dkd + b * dk->stride_b + h * dk->stride_h;
        DSV_T* dvb = dvd + b * dv->stride_b + h * dv->stride_h;
        for (int64_t s = 0; s < S; ++s) {
          memset(dkb + s * dk->stride_s, 0, (size_t)D * sizeof(DSV_T));
          memset(dvb + s * dv->stride_s, 0, (size_t)D * sizeof(DSV_T));
        }
        const int64_t count = dsv_clamp_count(kv_count[bh], KM);
        for (int64_t g = 0; g < NG; ++g) {
          const int32_t* list = count > 0 ? kv_index + (bh * NG + g) * KM : NULL;
          DSV_FN(sa_bwd_group)(p, q, k, v, out, dout, lse, list, count, b, h, g, dq, dkb, dvb,
                               dk->stride_s, dv->stride_s, dqa, Di, tidx);
        }
      }
      free(dqa);
      free(Di);
      free(tidx);
    }
    return err ? DSV_ERR_NOMEM : DSV_OK;
  }

  /* Mode B: few (b, h) pairs. For each pair, groups are spread over threads, each thread adds
   * into its own contiguous [S, D] dk / dv buffer; the buffers are summed at the end. */
  DSV_T* priv = (DSV_T*)malloc((size_t)team_b * per_thread);
  if (!priv) return DSV_ERR_NOMEM;
  for (int64_t bh = 0; bh < nbh; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const int64_t count = dsv_clamp_count(kv_count[bh], KM);
    DSV_OMP(parallel num_threads(team_b)) {
      const int tid = dsv_thread_num();
      DSV_T* mk = priv + (size_t)tid * (size_t)(2 * S * D);
      DSV_T* mv = mk + S * D;
      memset(mk, 0, (size_t)(2 * S * D) * sizeof(DSV_T));
      DSV_T* dqa = (DSV_T*)malloc((size_t)(GQ * D) * sizeof(DSV_T));
      DSV_T* Di = (DSV_T*)malloc((size_t)GQ * sizeof(DSV_T));
      int64_t* tidx = (int64_t*)malloc(DSV_SA_TILE * sizeof(int64_t));
      const int ok = dqa && Di && tidx;
      if (!ok) {
        DSV_OMP(atomic write)
        err = 1;
      }
      /* static schedule: a fixed thread count gives bitwise-reproducible dk / dv */
      DSV_OMP(for schedule(static))
      for (int64_t g = 0; g < NG; ++g) {
        if (!ok) continue;
        const int32_t* list = count > 0 ? kv_index + (bh * NG + g) * KM : NULL;
        DSV_FN(sa_bwd_group)(p, q, k, v, out, dout, lse, list, count, b, h, g, dq, mk, mv, D,
                             D, dqa, Di, tidx);
      }
      free(dqa);
      free(Di);
      free(tidx);
      /* implicit barrier after the loop above; now reduce the private buffers by rows. */
#ifdef _OPENMP
      const int nteam = omp_get_num_threads();
#else
      const int nteam = 1;
#endif
      DSV_OMP(for schedule(static))
      for (int64_t s = 0; s < S; ++s) {
        DSV_T* dks = dkd + dsv_off(dk, b, s, h);
        DSV_T* dvs = dvd + dsv_off(dv, b, s, h);
        for (int64_t d = 0; d < D; ++d) {
          DSV_T ak = 0, av = 0;
          for (int t = 0; t < nteam; ++t) {
            const DSV_T* bk = priv + (size_t)t * (size_t)(2 * S * D);
            ak += bk[s * D + d];
            av += bk[S * D + s * D + d];
          }
          dks[d] = ak;
          dvs[d] = av;
        }
      }
    }
  }
  free(priv);
  return err ? DSV_ERR_NOMEM : DSV_OK;
}

#endif /* DSV_T */
