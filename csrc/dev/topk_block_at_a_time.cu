/*
 * topk_block_at_a_time.cu - the top-K estimation with the block-at-a-time tile loops (one 8-key
 * block at a time, histogram atomics behind a branch) instead of the shipped two-phase ones
 * (csrc/cuda/topk_estimate.cu, where fp16 with rank > 32 keeps these loops anyway), built from
 * the shipped kernel template. Numbers: benchmarks/PERF_LOG.md (top-K, two-phase tile loops).
 *
 *   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
 *        -Icsrc -Xcompiler -fPIC -shared csrc/dev/topk_block_at_a_time.cu csrc/cuda/tuning.cu \
 *        -o topk_block.so
 *
 * Exports the shipped dsv_topk_estimate_cuda and dsv_dev_topk_estimate_block_cuda (same
 * arguments), which writes the same lists.
 */
#include "cuda/topk_estimate.cu"

extern "C" int dsv_dev_topk_estimate_block_cuda(const dsv_lowrank_shape* p, dsv_bshd q_lr,
                                                dsv_bshd k_lr, const int32_t* kv_count,
                                                int32_t* kv_index, void* workspace,
                                                size_t workspace_bytes, void* stream) {
  return dsv_topk_entry<false>(p, q_lr, k_lr, kv_count, kv_index, workspace, workspace_bytes,
                               stream);
}
