/*
 * topk_estimate.c - C11 reference kernel of the top-K key estimation from low-rank projections.
 *
 * Per (batch, head, group): the representative query is the mean of the group's q_lr rows
 * (computed in double); keys are scored one at a time (rep . k_lr_j in double) and fed, in
 * ascending position order, to a binary min-heap of size K = kv_count[b, h] whose root is the
 * worst kept key (lowest score; among equal scores, the highest position). A new key replaces
 * the root only when its score is strictly higher, so ties go to the lower position. Memory is
 * O(kmax) per group; no [groups, S] score matrix is ever built. The kept positions are then
 * sorted ascending and the list is padded with -1 up to kmax.
 *
 * This file includes itself twice (DSV_T = float, then double) to instantiate both dtypes.
 */
#ifndef DSV_T

#include "cpu_common.h"

/* Is heap entry a "worse" than entry b (lower score, or equal score and higher position)? */
static inline int dsv_topk_worse(double sa, int64_t pa, double sb, int64_t pb) {
  return sa < sb || (sa == sb && pa > pb);
}

static void dsv_topk_sift_down(double* hs, int64_t* hp, int64_t n, int64_t i) {
  for (;;) {
    const int64_t l = 2 * i + 1, r = l + 1;
    int64_t w = i;
    if (l < n && dsv_topk_worse(hs[l], hp[l], hs[w], hp[w])) w = l;
    if (r < n && dsv_topk_worse(hs[r], hp[r], hs[w], hp[w])) w = r;
    if (w == i) return;
    const double ts = hs[i];
    const int64_t tp = hp[i];
    hs[i] = hs[w];
    hp[i] = hp[w];
    hs[w] = ts;
    hp[w] = tp;
    i = w;
  }
}

static void dsv_topk_sift_up(double* hs, int64_t* hp, int64_t i) {
  while (i > 0) {
    const int64_t par = (i - 1) / 2;
    if (!dsv_topk_worse(hs[i], hp[i], hs[par], hp[par])) return;
    const double ts = hs[i];
    const int64_t tp = hp[i];
    hs[i] = hs[par];
    hp[i] = hp[par];
    hs[par] = ts;
    hp[par] = tp;
    i = par;
  }
}

static int dsv_cmp_i32(const void* a, const void* b) {
  const int32_t x = *(const int32_t*)a, y = *(const int32_t*)b;
  return (x > y) - (x < y);
}

#define DSV_T float
#define DSV_SUF f32
#include "topk_estimate.c"
#undef DSV_T
#undef DSV_SUF

#define DSV_T double
#define DSV_SUF f64
#include "topk_estimate.c"
#undef DSV_T
#undef DSV_SUF

int dsv_topk_estimate_cpu(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                          const int32_t* kv_count, int32_t* kv_index) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->rank <= 0 || p->group_size <= 0 ||
      p->kmax < 0)
    return DSV_ERR_INVALID;
  if (p->num_groups != (p->seqlen == 0 ? 0 : (p->seqlen - 1) / p->group_size + 1))
    return DSV_ERR_INVALID;
  if (!dsv_is_float_dtype(p->dtype)) return DSV_ERR_UNSUPPORTED;
  {
    int64_t n = 0;
    if (dsv_mul_ok(p->batch, p->heads, &n) != DSV_OK || dsv_mul_ok(n, p->seqlen, &n) != DSV_OK ||
        dsv_mul_ok(n, p->rank, &n) != DSV_OK || dsv_mul_ok(n, 8, &n) != DSV_OK)
      return DSV_ERR_INVALID;
    if (dsv_mul_ok(p->batch, p->heads, &n) != DSV_OK || dsv_mul_ok(n, p->num_groups, &n) != DSV_OK ||
        dsv_mul_ok(n, p->kmax, &n) != DSV_OK || dsv_mul_ok(n, 8, &n) != DSV_OK)
      return DSV_ERR_INVALID;
  }
  if (p->batch == 0 || p->heads == 0 || p->num_groups == 0 || p->kmax == 0) return DSV_OK;
  if (!q_lr.data || !k_lr.data || !kv_count || !kv_index) return DSV_ERR_INVALID;
  if (p->dtype == DSV_FLOAT32) return topk_f32(p, &q_lr, &k_lr, kv_count, kv_index);
  return topk_f64(p, &q_lr, &k_lr, kv_count, kv_index);
}

#else /* ---------------- dtype-generic part (DSV_T defined) ---------------- */

static int DSV_FN(topk)(const dsv_lowrank_shape* p, const dsv_bshd* q_lr, const dsv_bshd* k_lr,
                        const int32_t* kv_count, int32_t* kv_index) {
  const int64_t B = p->batch, S = p->seqlen, H = p->heads, R = p->rank, G = p->group_size,
                NG = p->num_groups, KM = p->kmax;
  const int64_t ntasks = B * H * NG;
  const int64_t KS = DSV_MAX(DSV_MIN(KM, S), 1); /* a list keeps at most min(kmax, S) keys */
  const DSV_T* qd = (const DSV_T*)q_lr->data;
  const DSV_T* kd = (const DSV_T*)k_lr->data;
  int err = 0;
  DSV_OMP(parallel) {
    double* rep = (double*)malloc((size_t)R * sizeof(double));
    double* hs = (double*)malloc((size_t)KS * sizeof(double));
    int64_t* hp = (int64_t*)malloc((size_t)KS * sizeof(int64_t));
    const int ok = rep && hs && hp;
    if (!ok) {
      DSV_OMP(atomic write)
      err = 1;
    }
    DSV_OMP(for schedule(dynamic, 1))
    for (int64_t t = 0; t < ntasks; ++t) {
      if (!ok) continue;
      const int64_t g = t % NG, bh = t / NG;
      const int64_t b = bh / H, h = bh % H;
      int32_t* list = kv_index + t * KM; /* (bh * NG + g) * KM */
      const int64_t K = DSV_MIN(dsv_clamp_count(kv_count[bh], KM), S);
      int64_t n = 0;
      if (K > 0) {
        const int64_t s0 = g * G, nq = DSV_MIN(G, S - s0);
        for (int64_t r = 0; r < R; ++r) rep[r] = 0;
        for (int64_t i = 0; i < nq; ++i) {
          const DSV_T* qi = qd + dsv_off(q_lr, b, s0 + i, h);
          for (int64_t r = 0; r < R; ++r) rep[r] += (double)qi[r];
        }
        for (int64_t r = 0; r < R; ++r) rep[r] /= (double)nq;
        for (int64_t j = 0; j < S; ++j) {
          const DSV_T* kj = kd + dsv_off(k_lr, b, j, h);
          double s = 0;
          for (int64_t r = 0; r < R; ++r) s += rep[r] * (double)kj[r];
          if (s != s) s = -INFINITY; /* NaN scores rank last */
          if (n < K) {
            hs[n] = s;
            hp[n] = j;
            dsv_topk_sift_up(hs, hp, n);
            ++n;
          } else if (s > hs[0]) {
            hs[0] = s;
            hp[0] = j;
            dsv_topk_sift_down(hs, hp, n, 0);
          }
        }
        for (int64_t i = 0; i < n; ++i) list[i] = (int32_t)hp[i];
        qsort(list, (size_t)n, sizeof(int32_t), dsv_cmp_i32);
      }
      for (int64_t i = n; i < KM; ++i) list[i] = -1;
    }
    free(rep);
    free(hs);
    free(hp);
  }
  return err ? DSV_ERR_NOMEM : DSV_OK;
}

#endif /* DSV_T */
