/*
 * topk_no_list_stores.cu - a measurement, not an op: the shipped top-K estimation
 * (csrc/cuda/topk_estimate.cu) whose compaction computes every list entry but stores only each
 * list's last one, so that its time against the shipped kernel's is what the list stores cost
 * (its lists are not the op's: the tests do not run it). Built as an ops library with the other
 * ops' sources (benchmarks/build_devvar.sh), timed with bench_topk.py through DSV_OPS_LIB
 * (`STEPS=topkvar bash benchmarks/device_session.sh`).
 */
#define DSV_TK_LIST_STORES 0
#include "cuda/topk_estimate.cu"
