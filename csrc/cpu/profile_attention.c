/*
 * profile_attention.c - C11 reference kernel of the attention profile on sampled rows.
 *
 * Per (batch, head, sampled row): the exact softmax over all S keys goes into an O(S) scratch
 * (in double); recall is the probability mass of the distinct valid entries of the row's list
 * (an O(S) byte mark array counts each key once); the probabilities are then sorted descending
 * and c_i is the length of the shortest prefix whose sum reaches theta (S when rounding keeps
 * the total below theta, 0 when theta <= 0). sparsity = 1 - mean_i c_i / S. Rows outside [0, S)
 * are left out of the means (the Python layer rejects them); with no usable row the outputs are
 * NaN. OpenMP parallelises over (batch, head, row); the means are reduced in a fixed order.
 *
 * This file includes itself twice (DSV_T = float, then double) to instantiate both dtypes.
 */
#ifndef DSV_T

#include "cpu_common.h"

static int dsv_cmp_desc(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x < y) - (x > y);
}

#define DSV_T float
#define DSV_SUF f32
#include "profile_attention.c"
#undef DSV_T
#undef DSV_SUF

#define DSV_T double
#define DSV_SUF f64
#include "profile_attention.c"
#undef DSV_T
#undef DSV_SUF

int dsv_profile_attention_cpu(const dsv_profile_shape* p, dsv_bshd q, dsv_bshd k,
                              const int32_t* rows, const int32_t* kv_index,
                              const int32_t* kv_count, void* sparsity, void* recall) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->head_dim <= 0 || p->num_rows < 0)
    return DSV_ERR_INVALID;
  {
    int64_t bh = 0, n = 0;
    if (dsv_mul_ok(p->batch, p->heads, &bh) != DSV_OK || dsv_mul_ok(bh, p->seqlen, &n) != DSV_OK ||
        dsv_mul_ok(n, p->head_dim, &n) != DSV_OK || dsv_mul_ok(n, 8, &n) != DSV_OK ||
        dsv_mul_ok(bh, p->num_rows, &n) != DSV_OK || dsv_mul_ok(n, 16, &n) != DSV_OK)
      return DSV_ERR_INVALID;
  }
  if (!dsv_is_float_dtype(p->dtype)) return DSV_ERR_UNSUPPORTED;
  if (kv_index) {
    if (!kv_count || p->group_size <= 0 || p->kmax < 0 ||
        p->num_groups != (p->seqlen == 0 ? 0 : (p->seqlen - 1) / p->group_size + 1))
      return DSV_ERR_INVALID;
  }
  if (p->batch == 0 || p->heads == 0) return DSV_OK;
  if (!sparsity || (p->num_rows > 0 && !rows)) return DSV_ERR_INVALID;
  if (p->seqlen > 0 && p->num_rows > 0 && (!q.data || !k.data)) return DSV_ERR_INVALID;
  if (p->dtype == DSV_FLOAT32)
    return prof_f32(p, &q, &k, rows, kv_index, kv_count, (float*)sparsity, (float*)recall);
  return prof_f64(p, &q, &k, rows, kv_index, kv_count, (double*)sparsity, (double*)recall);
}

#else /* ---------------- dtype-generic part (DSV_T defined) ---------------- */

static int DSV_FN(prof)(const dsv_profile_shape* p, const dsv_bshd* q, const dsv_bshd* k,
                        const int32_t* rows, const int32_t* kv_index, const int32_t* kv_count,
                        DSV_T* sparsity, DSV_T* recall) {
  const int64_t B = p->batch, S = p->seqlen, H = p->heads, D = p->head_dim, NR = p->num_rows;
  const int64_t nbh = B * H, ntasks = nbh * NR;
  const double scale = p->scale, theta = p->theta;
  const DSV_T* qd = (const DSV_T*)q->data;
  const DSV_T* kd = (const DSV_T*)k->data;
  /* per task: c_i (or -1 for an unusable row) and recall_i */
  double* crow = (double*)malloc((size_t)DSV_MAX(ntasks, 1) * sizeof(double));
  double* rrow = (double*)malloc((size_t)DSV_MAX(ntasks, 1) * sizeof(double));
  if (!crow || !rrow) {
    free(crow);
    free(rrow);
    return DSV_ERR_NOMEM;
  }
  int err = 0;
  DSV_OMP(parallel) {
    double* prob = (double*)malloc((size_t)DSV_MAX(S, 1) * sizeof(double));
    unsigned char* mark = (unsigned char*)calloc((size_t)DSV_MAX(S, 1), 1);
    const int ok = prob && mark;
    if (!ok) {
      DSV_OMP(atomic write)
      err = 1;
    }
    DSV_OMP(for schedule(dynamic, 1))
    for (int64_t t = 0; t < ntasks; ++t) {
      crow[t] = -1;
      rrow[t] = 0;
      if (!ok) continue;
      const int64_t bh = t / NR, i = t % NR;
      const int64_t b = bh / H, h = bh % H;
      const int64_t row = rows[i];
      if (row < 0 || row >= S) continue;
      const DSV_T* qi = qd + dsv_off(q, b, row, h);
      double mx = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        const DSV_T* kj = kd + dsv_off(k, b, j, h);
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += (double)qi[d] * (double)kj[d];
        s *= scale;
        prob[j] = s;
        if (s > mx) mx = s;
      }
      double sum = 0;
      for (int64_t j = 0; j < S; ++j) {
        prob[j] = exp(prob[j] - mx);
        sum += prob[j];
      }
      if (!(sum > 0) || isinf(sum)) {
        /* a NaN or +inf score (or every score -inf): the softmax is NaN, and so are this
         * row's critical-set size and recall, which makes the head's means NaN */
        crow[t] = NAN;
        rrow[t] = NAN;
        continue;
      }
      const double inv = 1.0 / sum;
      for (int64_t j = 0; j < S; ++j) prob[j] *= inv;
      if (kv_index) {
        const int64_t KM = p->kmax;
        const int64_t cnt = dsv_clamp_count(kv_count[bh], KM);
        const int32_t* list = kv_index + (bh * p->num_groups + row / p->group_size) * KM;
        double r = 0;
        for (int64_t j = 0; j < cnt; ++j) {
          const int32_t key = list[j];
          if (key < 0 || (int64_t)key >= S || mark[key]) continue;
          mark[key] = 1;
          r += prob[key];
        }
        for (int64_t j = 0; j < cnt; ++j) {
          const int32_t key = list[j];
          if (key >= 0 && (int64_t)key < S) mark[key] = 0;
        }
        rrow[t] = r;
      }
      int64_t c = 0;
      if (theta > 0) {
        qsort(prob, (size_t)S, sizeof(double), dsv_cmp_desc);
        double cum = 0;
        c = S;
        for (int64_t j = 0; j < S; ++j) {
          cum += prob[j];
          if (cum >= theta) {
            c = j + 1;
            break;
          }
        }
      }
      crow[t] = (double)c;
    }
    free(prob);
    free(mark);
  }
  for (int64_t bh = 0; bh < nbh; ++bh) {
    double cs = 0, rs = 0;
    int64_t n = 0;
    for (int64_t i = 0; i < NR; ++i) {
      const int64_t t = bh * NR + i;
      if (crow[t] < 0) continue;
      cs += crow[t];
      rs += rrow[t];
      ++n;
    }
    sparsity[bh] = (DSV_T)(n > 0 ? 1.0 - cs / ((double)n * (double)S) : NAN);
    if (recall) recall[bh] = (DSV_T)((n > 0 && kv_index) ? rs / (double)n : NAN);
  }
  free(crow);
  free(rrow);
  return err ? DSV_ERR_NOMEM : DSV_OK;
}

#endif /* DSV_T */
