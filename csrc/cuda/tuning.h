/*
 * tuning.h - the kernel tuning of one CUDA device (internal to csrc/cuda): what the launch code
 * chooses from, filled once per device by tuning.cu and read by every launch.
 *
 * Defaults come from the device (SM count, L2 size, compute capability) and from measurements
 * (benchmarks/PERF_LOG.md). The one override, for experiments and tests, is the environment
 * variable DSV_KERNEL_TUNING="key=value,key=value" (keys as in the struct), read when a device's
 * tuning is first filled; a malformed value makes every launch return DSV_ERR_TUNING.
 */
#ifndef DSV_CUDA_TUNING_H
#define DSV_CUDA_TUNING_H

#include "dsv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dsv_tuning {
  int sm_count;     /* streaming multiprocessors (grid sizes of grid-stride kernels) */
  int l2_bytes;     /* L2 cache size (the backward's key ranges) */
  int cc;           /* compute capability, 10 major + minor */
  int wgmma;        /* 1: the Hopper wgmma kernels run (an sm_90a build on a 9.0 device), else
                       mma.sync; an override can turn them off, never on where they cannot run */
  int km_wgmma;     /* backward key-major dK / dV pass where wgmma is on: 1 its wgmma kernel
                       where it applies (D 64 / 128, G >= 64; token lists and 64-key block
                       lists; the default), 2 also for 16-key block lists, 0 the mma.sync kernel */
  int g128;         /* where wgmma is on, token lists, D 64 / 128 and the group a multiple of 128
                       queries: 1 runs 128 rows per CTA on two warpgroups that share the key
                       tiles (the forward, and the backward's query-major pass with dK / dV
                       reductions: one reduction per key and 128 rows, as whole 128-byte
                       lines; the default), 0 two CTAs of 64 rows */
  int qm_wgmma;     /* where wgmma is on, D 64 / 128 and G >= 64: 1 runs the backward's
                       query-major pass with dK / dV reductions of the groups not on the 128-row
                       kernel (G not a multiple of 128, or g128 0) on the 64-row wgmma kernel,
                       its reductions as whole 128-byte lines (the default), 0 on mma.sync */
  int wg256;        /* where wgmma is on, token lists, D 256 and G >= 64: 1 runs the forward on
                       the wgmma kernel (one warpgroup per 64 queries; the default), 0 on
                       mma.sync */
  float km_ratio;   /* backward: a head takes the key-major dK / dV pass when its lists' 64-key
                       block entries x 64 <= km_ratio x groups x K (0: never) */
  float merge;      /* groups of 16, 32 or 64 queries where the 128-row kernels run (wgmma and
                       g128 on, D 64 / 128): the M = 128 / G groups of a 128-query block run as
                       one 128-row CTA over the union of their lists (each row masked to its
                       own group's keys; the backward reduces each key once per 128 rows) when
                       the union has at most merge x M x K entries: the backward at G 16 / 32 /
                       64, the forward at G 16 / 32; heads with scattered lists are not merged
                       in the backward unless merge >= 1 (0: never) */
  int merge_window; /* merged groups: the keys per window of the union builder's bitmaps (a
                       multiple of 32; 0: as many as 40 KB of shared memory hold, the default);
                       for tests, which need several windows at small sequence lengths */
  int bwd_ranges;   /* backward, query-major dK / dV: 0 = key ranges per head by the automatic
                       rule, R >= 1 forces R ranges on every head (at most 16) */
  int bwd_rmax;     /* the automatic rule's most ranges: 0 = from the L2 size (at most 8) */
  int tk_gpw;       /* top-K estimation: query groups per warp, 16 (rows 0-15 of the score tile)
                       or 8 (rows 0-7: twice the warps for the same groups and half the
                       selection work per warp, for grids that leave the device short of warps,
                       e.g. G = 128); 0: automatic (the default), 8 where 16 would give fewer
                       than two CTAs per SM */
  int tk_sample;    /* top-K estimation: 1 (the default) = a 1/16 sample of the keys locates each
                       group's threshold to a band first, 0 = radix passes from the full key
                       range (same lists) */
  int tk_band;      /* top-K estimation: 1 (the default) = the band pass stores the keys of the
                       band without a histogram (one shared atomic less per score), which then
                       comes from the stored keys, where they are expected to fill at most 3/4
                       of the band buffer; 2 = wherever the band buffer is used; 0 = the band
                       pass always histograms (same lists) */
  int tk_compact;   /* top-K estimation: 1 (the default) = the compaction places the selected
                       keys from the band pass's key masks (16 bytes per group and 64-key tile,
                       a workspace of up to 1 GiB) and the band's stored keys instead of
                       rescoring every key, where every group's threshold lies in its band (one
                       CTA per set of groups); 0 = it rescores them (same lists) */
  int tk_split;     /* top-K estimation: CTAs per set of groups, 1, 2, 4 or 8 (a thread-block
                       cluster, each CTA scoring its part of the keys: n times the CTAs and
                       1 / n of the chain of passes per warp; same lists); 0: automatic (the
                       default), 2 where 16 groups per warp would give fewer than two CTAs per
                       SM, 4 or 8 where two still leave fewer CTAs than SMs (v45) */
} dsv_tuning;

/* The tuning of `device` (filled on first use, then cached): DSV_OK, DSV_ERR_CUDA when the
 * device cannot be queried, DSV_ERR_TUNING when DSV_KERNEL_TUNING is malformed. */
int dsv_tuning_get(int device, const dsv_tuning** out);
/* The tuning of the current device. */
int dsv_tuning_current(const dsv_tuning** out);

#ifdef __cplusplus
}
#endif

#endif /* DSV_CUDA_TUNING_H */
