/*
 * topk_staged_stores.cu - a candidate: the shipped top-K estimation (csrc/cuda/topk_estimate.cu)
 * whose compaction from masks stages each tile's list entries in shared memory and stores them
 * 16 lanes to consecutive entries of one group (DSV_TK_STAGED_STORES), instead of one scattered
 * entry per lane: about 8x fewer L1 wavefronts for the same stores. The same lists: the tests
 * run it as DSV_OPS_LIB (tests/test_topk_estimate_cuda.py); built as an ops library with the
 * other ops' sources (benchmarks/build_devvar.sh), timed with bench_topk.py
 * (`STEPS=topkvar TOPK_VARIANT=csrc/dev/topk_staged_stores.cu bash benchmarks/device_session.sh`).
 */
#define DSV_TK_STAGED_STORES 1
#include "cuda/topk_estimate.cu"
