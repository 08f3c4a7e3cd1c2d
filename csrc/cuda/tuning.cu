/*
 * tuning.cu - the kernel tuning of each CUDA device (tuning.h), filled once per device and
 * cached, and its report (dsv_cuda_kernel_tuning in dsv.h).
 *
 * Keys of DSV_KERNEL_TUNING (each optional; values are numbers):
 *   sm_count, l2_bytes      what the device reports (for experiments with smaller devices)
 *   wgmma                   0 runs the mma.sync kernels where the wgmma ones would run
 *   km_wgmma                1 the key-major dK / dV pass on wgmma where it applies
 *                           (with wgmma on: D 64 / 128, G >= 64; token lists and 64-key block
 *                           lists; the default), 2 also 16-key block lists, 0 its mma.sync kernel
 *   g128                    1 groups of a multiple of 128 queries on the 128-row kernels (two
 *                           warpgroups share the key tiles; with wgmma on, token lists, D 64 /
 *                           128; the default), 0 two CTAs of 64 rows
 *   qm_wgmma                1 the backward's query-major pass with dK / dV reductions on the
 *                           64-row wgmma kernel for groups not on the 128-row kernel (with wgmma
 *                           on: D 64 / 128, G >= 64; the default), 0 on mma.sync
 *   wg256                   1 the forward at D 256 on the wgmma kernel (with wgmma on: token
 *                           lists, G >= 64; the default), 0 on mma.sync
 *   km_ratio                backward key-major ratio (0: never key-major, 1e9: wherever allowed)
 *   merge                   groups of 16 / 32 / 64 queries (where the 128-row kernels run): the
 *                           groups of a 128-query block merged into one 128-row CTA when their
 *                           lists' union has at most merge x (128 / G) x K entries; the backward
 *                           at G 16 / 32 / 64, the forward at G 16 / 32 (0: never; >= 1: every
 *                           block whose lists allow it, scattered or not)
 *   merge_window            merged groups: keys per window of the union builder (a multiple of
 *                           32; 0: from 40 KB of shared memory, the default; tests)
 *   bwd_ranges              backward key ranges forced on every query-major head (0: automatic)
 *   bwd_rmax                the automatic rule's most key ranges (0: from the L2 size)
 *   tk_gpw                  top-K estimation: query groups per warp, 16 or 8; 0: automatic
 *                           (8 where 16 gives fewer than two CTAs per SM; the default)
 *   tk_sample               top-K estimation: 1 locates each group's threshold from a 1/16
 *                           sample first (the default), 0 radix passes from the full key range
 *   tk_band                 top-K estimation: 1 the band pass stores the band's keys without a
 *                           histogram, which then comes from the stored keys, where they fill at
 *                           most 3/4 of the buffer (the default); 2 wherever the band buffer is
 *                           used (tests); 0 the band pass always histograms
 *   tk_compact              top-K estimation: 1 the compaction places the selected keys from the
 *                           band pass's key masks and the band's stored keys (no scores; a
 *                           workspace of S / 4 bytes per query group, up to 1 GiB), where every
 *                           group's threshold lies in its band (the default); 0 it rescores
 *                           the keys
 *   tk_split                top-K estimation: 1 CTA per set of groups, or a cluster of 2, 4 or
 *                           8 CTAs, each scoring its part of the keys; 0: automatic (2 where 16
 *                           groups per warp gives fewer than two CTAs per SM, from compute
 *                           capability 9.0; the default; 4 or 8 where clusters of two
 *                           still leave fewer CTAs than SMs and each CTA keeps >= 16 key
 *                           tiles)
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "tuning.h"

namespace {

constexpr int kMaxDevices = 64;

struct Slot {
  int state; /* 0 empty, 1 filled (status in st) */
  int st;
  dsv_tuning t;
};

Slot g_slots[kMaxDevices];
pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

/* one "key=value" of the override applied to t; 0 or DSV_ERR_TUNING */
int apply_one(dsv_tuning* t, const char* key, size_t klen, const char* val, size_t vlen) {
  char buf[64];
  if (vlen == 0 || vlen >= sizeof buf) return DSV_ERR_TUNING;
  memcpy(buf, val, vlen);
  buf[vlen] = 0;
  char* end = nullptr;
  errno = 0;
  const double x = strtod(buf, &end);
  if (errno != 0 || end == buf || *end != 0 || !(x == x)) return DSV_ERR_TUNING;
#define DSV_KEY(name) (klen == sizeof(name) - 1 && !strncmp(key, name, klen))
  if (DSV_KEY("km_ratio")) {
    if (x < 0) return DSV_ERR_TUNING;
    t->km_ratio = x > 3.0e38 ? 3.0e38f : (float)x;
    return DSV_OK;
  }
  if (DSV_KEY("merge")) {
    if (x < 0 || x > 1) return DSV_ERR_TUNING;
    t->merge = (float)x;
    return DSV_OK;
  }
  if (x != (double)(long long)x) return DSV_ERR_TUNING; /* the other keys are integers */
  const long long n = (long long)x;
  if (DSV_KEY("sm_count")) {
    if (n < 1 || n > 1 << 20) return DSV_ERR_TUNING;
    t->sm_count = (int)n;
  } else if (DSV_KEY("l2_bytes")) {
    if (n < 0 || n > 0x7fffffffLL) return DSV_ERR_TUNING;
    t->l2_bytes = (int)n;
  } else if (DSV_KEY("wgmma")) {
    if (n != 0 && n != 1) return DSV_ERR_TUNING;
    t->wgmma = t->wgmma && n == 1; /* never on where it cannot run */
  } else if (DSV_KEY("km_wgmma")) {
    if (n < 0 || n > 2) return DSV_ERR_TUNING;
    t->km_wgmma = (int)n; /* takes effect only where wgmma is on */
  } else if (DSV_KEY("g128")) {
    if (n != 0 && n != 1) return DSV_ERR_TUNING;
    t->g128 = (int)n; /* takes effect only where wgmma is on */
  } else if (DSV_KEY("qm_wgmma")) {
    if (n != 0 && n != 1) return DSV_ERR_TUNING;
    t->qm_wgmma = (int)n; /* takes effect only where wgmma is on */
  } else if (DSV_KEY("wg256")) {
    if (n != 0 && n != 1) return DSV_ERR_TUNING;
    t->wg256 = (int)n; /* takes effect only where wgmma is on */
  } else if (DSV_KEY("merge_window")) {
    if (n < 0 || n > 1 << 22 || n % 32 != 0) return DSV_ERR_TUNING;
    t->merge_window = (int)n;
  } else if (DSV_KEY("bwd_ranges")) {
    if (n < 0 || n > 16) return DSV_ERR_TUNING;
    t->bwd_ranges = (int)n;
  } else if (DSV_KEY("bwd_rmax")) {
    if (n < 0 || n > 16) return DSV_ERR_TUNING;
    t->bwd_rmax = (int)n;
  } else if (DSV_KEY("tk_gpw")) {
    if (n != 0 && n != 8 && n != 16) return DSV_ERR_TUNING;
    t->tk_gpw = (int)n;
  } else if (DSV_KEY("tk_sample")) {
    if (n != 0 && n != 1) return DSV_ERR_TUNING;
    t->tk_sample = (int)n;
  } else if (DSV_KEY("tk_band")) {
    if (n != 0 && n != 1 && n != 2) return DSV_ERR_TUNING;
    t->tk_band = (int)n;
  } else if (DSV_KEY("tk_compact")) {
    if (n != 0 && n != 1) return DSV_ERR_TUNING;
    t->tk_compact = (int)n;
  } else if (DSV_KEY("tk_split")) {
    if (n != 0 && n != 1 && n != 2 && n != 4 && n != 8) return DSV_ERR_TUNING;
    t->tk_split = (int)n; /* > 1 takes effect from compute capability 9.0 (clusters) */
  } else {
    return DSV_ERR_TUNING; /* unknown key */
  }
#undef DSV_KEY
  return DSV_OK;
}

/* DSV_KERNEL_TUNING="key=value,key=value" applied to t */
int apply_override(dsv_tuning* t, const char* spec) {
  const char* p = spec;
  while (*p) {
    const char* e = strchr(p, ',');
    const size_t len = e ? (size_t)(e - p) : strlen(p);
    const char* eq = (const char*)memchr(p, '=', len);
    if (len > 0) {
      if (!eq) return DSV_ERR_TUNING;
      const int st = apply_one(t, p, (size_t)(eq - p), eq + 1, len - (size_t)(eq - p) - 1);
      if (st != DSV_OK) return st;
    }
    if (!e) break;
    p = e + 1;
  }
  return DSV_OK;
}

int fill(int device, dsv_tuning* t) {
  memset(t, 0, sizeof *t);
  int major = 0, minor = 0, sms = 0, l2 = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return DSV_ERR_CUDA;
  }
  t->sm_count = sms > 0 ? sms : 1;
  t->l2_bytes = l2 > 0 ? l2 : 0;
  t->cc = major * 10 + minor;
#if defined(DSV_WGMMA)
  t->wgmma = major == 9 && minor == 0; /* sm_90a code runs on 9.0 only */
#else
  t->wgmma = 0;
#endif
  t->km_wgmma = 1; /* measured on the H200 at S = 64k: benchmarks/PERF_LOG.md, kernels v13 */
  t->g128 = 1;     /* measured on the H200 at S = 64k: benchmarks/PERF_LOG.md, kernels v15, v30 */
  t->qm_wgmma = 1; /* benchmarks/PERF_LOG.md, kernels v34 */
  t->wg256 = 1;    /* measured on the H100 at S = 64k: benchmarks/PERF_LOG.md, kernels v44 */
  /* measured crossover on the H200 at S = 64k, D = 128 (benchmarks/PERF_LOG.md, kernels v3) */
  t->km_ratio = 1.15f;
  t->merge = 0.75f;    /* below the measured crossover: benchmarks/PERF_LOG.md, kernels v26 */
  t->bwd_ranges = 0;
  t->bwd_rmax = 0;
  t->tk_gpw = 0; /* automatic: measured on the H200, benchmarks/PERF_LOG.md, kernels v16 */
  t->tk_sample = 1; /* benchmarks/PERF_LOG.md, kernels v12 / v17 */
  t->tk_band = 1;   /* benchmarks/PERF_LOG.md, kernels v40 */
  t->tk_compact = 1; /* benchmarks/PERF_LOG.md, kernels v41 */
  t->tk_split = 0;  /* automatic: measured on the H200, benchmarks/PERF_LOG.md, kernels v18 */
  const char* spec = getenv("DSV_KERNEL_TUNING");
  return spec ? apply_override(t, spec) : DSV_OK;
}

}  // namespace

extern "C" int dsv_tuning_get(int device, const dsv_tuning** out) {
  if (device < 0 || device >= kMaxDevices) return DSV_ERR_INVALID;
  Slot* s = &g_slots[device];
  if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != 1) {
    pthread_mutex_lock(&g_lock);
    if (s->state != 1) {
      s->st = fill(device, &s->t);
      if (s->st == DSV_ERR_CUDA) { /* not cached: the device may be usable later */
        pthread_mutex_unlock(&g_lock);
        return DSV_ERR_CUDA;
      }
      __atomic_store_n(&s->state, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_lock);
  }
  *out = &s->t;
  return s->st;
}

extern "C" int dsv_tuning_current(const dsv_tuning** out) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return DSV_ERR_CUDA;
  }
  return dsv_tuning_get(dev, out);
}

extern "C" int dsv_cuda_kernel_tuning(int device, char* buf, int64_t len) {
  if (!buf || len <= 0) return DSV_ERR_INVALID;
  const dsv_tuning* t = nullptr;
  const int st = dsv_tuning_get(device, &t);
  if (st != DSV_OK) return st;
  const int n = snprintf(buf, (size_t)len,
                         "sm_count=%d,l2_bytes=%d,cc=%d,wgmma=%d,km_wgmma=%d,g128=%d,"
                         "qm_wgmma=%d,wg256=%d,km_ratio=%g,merge=%g,merge_window=%d,"
                         "bwd_ranges=%d,bwd_rmax=%d,tk_gpw=%d,tk_sample=%d,tk_band=%d,"
                         "tk_compact=%d,tk_split=%d",
                         t->sm_count, t->l2_bytes, t->cc, t->wgmma, t->km_wgmma, t->g128,
                         t->qm_wgmma, t->wg256, (double)t->km_ratio, (double)t->merge,
                         t->merge_window,
                         t->bwd_ranges, t->bwd_rmax, t->tk_gpw, t->tk_sample, t->tk_band,
                         t->tk_compact, t->tk_split);
  return n >= 0 && n < len ? DSV_OK : DSV_ERR_NOMEM;
}
