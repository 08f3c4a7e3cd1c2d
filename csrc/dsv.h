/*
 * dsv.h - the plain C API of every dsv-ext kernel.
 *
 * Every op has a CPU reference implementation (csrc/cpu/<op>.c, C11 + OpenMP) and, when the
 * extension is built with CUDA, a GPU implementation (csrc/cuda/<op>.cu) behind the same
 * arguments plus a workspace and a stream. The one C++ file csrc/dsv_ops.cpp registers them with
 * PyTorch through the stable ABI; nothing here depends on PyTorch or on the CUDA headers.
 *
 * Conventions
 *  - Activations use the [B, S, H, D] layout: a dsv_bshd gives the data pointer and the element
 *    strides of the batch, sequence and head dims; the last dim is always contiguous (stride 1).
 *  - CPU entry points see only DSV_FLOAT32 or DSV_FLOAT64 data (the registration layer converts
 *    half types to float32 first). CUDA entry points take DSV_FLOAT16 and DSV_BFLOAT16 (and may
 *    take DSV_FLOAT32).
 *  - "acc" buffers (lse, losses, statistics) are float64 when dtype is DSV_FLOAT64, else float32.
 *  - kv_index is int32 [B, H, num_groups, kmax], contiguous. kv_count is int32 [B, H],
 *    contiguous: list (b, h, g) uses its first kv_count[b, h] entries. Kernels clamp a count to
 *    [0, kmax] and skip entries outside [0, S): no input can make them read or write out of
 *    bounds (the Python layer still reports such input as an error). A count of 0 gives an output
 *    of zeros and an lse of -inf for that (batch, head).
 *  - Query s belongs to group s / group_size; num_groups = ceil(S / group_size), so the last
 *    group may be partial.
 *  - Sizes: every entry point checks that the element counts and byte sizes it forms fit in
 *    int64 and returns DSV_ERR_INVALID otherwise; per-thread scratch is sized by what is used
 *    (a group holds min(group_size, S) queries), so a huge group_size cannot wrap a size.
 *  - NaN / inf: a query row whose scores (scale q . k over its list) contain a NaN or +inf, or
 *    are all -inf, gets a NaN output row, a NaN lse and NaN gradients (dq of the row, dk / dv of
 *    every key of its list), as softmax and torch's scaled_dot_product_attention do; a -inf
 *    score among finite ones has weight 0. A list without a valid entry (count 0, or only
 *    entries outside [0, S)) still gives 0 and lse -inf. top-K ranks a NaN score last (tied
 *    with -inf); the predictor loss and the profile are NaN for a (batch, head) whose sampled
 *    rows see a NaN (profile: or +inf) score, and the loss of a row outside [0, S) is NaN.
 *  - Every function returns DSV_OK (0) or a negative dsv_status; dsv_status_string() names it.
 *    CUDA functions only enqueue work on `stream` (a cudaStream_t passed as void*); they return
 *    DSV_ERR_CUDA when a launch fails.
 */
#ifndef DSV_H
#define DSV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dsv_status {
  DSV_OK = 0,
  DSV_ERR_INVALID = -1,     /* an argument is out of its documented range */
  DSV_ERR_UNSUPPORTED = -2, /* dtype / head dim / group size not compiled for this device */
  DSV_ERR_CUDA = -3,        /* a CUDA launch or call failed */
  DSV_ERR_NOMEM = -4,       /* host allocation failed, or the workspace is too small */
  DSV_ERR_TUNING = -5,      /* DSV_KERNEL_TUNING is malformed (unknown key or bad value) */
} dsv_status;

typedef enum dsv_dtype {
  DSV_FLOAT32 = 0,
  DSV_FLOAT64 = 1,
  DSV_FLOAT16 = 2,
  DSV_BFLOAT16 = 3,
} dsv_dtype;

const char* dsv_status_string(int status);

/* A strided [B, S, H, D] view (D contiguous). */
typedef struct dsv_bshd {
  void* data;
  int64_t stride_b, stride_s, stride_h;
} dsv_bshd;

/* ------------------------------------------------------------------------------------------ */
/* Sparse grouped attention.
 *   out[b, s, h, :] = sum_j softmax_j(scale * q[b,s,h,:] . k[b,idx_j,h,:]) v[b,idx_j,h,:]
 * over idx_j = kv_index[b, h, s / group_size, j], j < kv_count[b, h].
 * lse[b, h, s] = log sum_j exp(scale * q . k_j) (natural log), acc type, contiguous [B, H, S].
 *
 * Key blocks (kv_block = b > 1): an entry e is the id of a block of b consecutive keys and stands
 * for the keys e*b .. min(e*b + b, S) - 1 (the last block may be partial); kv_count counts
 * entries (blocks). Entries outside [0, ceil(S / b)) are skipped like token entries outside
 * [0, S); everything else holds per expanded key as for token lists (an entry given twice counts
 * its keys twice; the NaN rules above). b = 1: token lists. The CPU functions take any b >= 1. */
typedef struct dsv_attn_shape {
  int64_t batch, seqlen, heads, head_dim;
  int64_t group_size, num_groups, kmax;
  double scale;
  dsv_dtype dtype;
  int flags; /* DSV_FLAG_* bits (0: the default, fastest paths) */
  int64_t kv_block; /* keys per list entry (>= 1): 1 = token lists (the entries are key positions) */
} dsv_attn_shape;

/* Deterministic backward: dq, dk, dv are bit-identical from run to run for the same inputs.
 * The CPU backward always is (a fixed thread count sums in a fixed order). On CUDA the flag
 * sends every head through the key-major path with its (group, mask) entries in ascending
 * group order (filled by a scan, no atomic positions) and dK / dV summed in registers; dQ is
 * always summed in registers by one CTA per query chunk (no key ranges, no fp32 reductions).
 * It needs head_dim <= 128 and lists that are strictly ascending (as topk_estimate writes them;
 * dsv_ext sorts other lists first): the kernel returns DSV_ERR_UNSUPPORTED for head_dim 256. */
#define DSV_FLAG_DETERMINISTIC 1

int dsv_sparse_attention_fwd_cpu(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                 const int32_t* kv_index, const int32_t* kv_count,
                                 dsv_bshd out, void* lse);

/* dq, dk, dv are written completely (the kernel zero-fills dk and dv itself). */
int dsv_sparse_attention_bwd_cpu(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                 dsv_bshd out, dsv_bshd dout, const void* lse,
                                 const int32_t* kv_index, const int32_t* kv_count,
                                 dsv_bshd dq, dsv_bshd dk, dsv_bshd dv);

/* ------------------------------------------------------------------------------------------ */
/* Top-K estimation from low-rank projections q_lr, k_lr: [B, S, H, rank].
 * For group g the representative query is the mean of q_lr over the group's members (the last
 * group may be partial); its scores against every key are rep . k_lr[b, j, h, :]. The output
 * list (b, h, g) holds the positions of the kv_count[b, h] highest-scoring keys, sorted
 * ascending; entries from kv_count[b, h] to kmax are set to -1. Ties are broken towards the
 * lower position. Memory is O(S * kmax) (streaming selection: no score matrix). */
typedef struct dsv_lowrank_shape {
  int64_t batch, seqlen, heads, rank;
  int64_t group_size, num_groups, kmax;
  dsv_dtype dtype;
} dsv_lowrank_shape;

int dsv_topk_estimate_cpu(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                          const int32_t* kv_count, int32_t* kv_index);

/* ------------------------------------------------------------------------------------------ */
/* Predictor loss on sampled query rows (rows: int32 [num_rows], positions in [0, S)).
 * For sampled row i of (b, h): z_j = scale * q_i . k_j (exact logits), p_j = q_lr_i . k_lr_j
 * (predicted), over all keys j < S. With Szp = sum z_j p_j, nz = sqrt(sum z_j^2 + eps),
 * np = sqrt(sum p_j^2 + eps), eps = 1e-12:
 *   loss_i = cos_weight * (1 - Szp / (nz * np)) + norm_weight * (np / nz - 1)^2
 * loss[b, h] = mean_i loss_i (acc type, [B, H]). row_stats (acc type, [B, H, num_rows, 3]) keeps
 * (Szp, sum z^2, sum p^2) per row for the backward. The loss is differentiable in q_lr and k_lr
 * only (q and k are treated as constants). */
typedef struct dsv_predictor_shape {
  int64_t batch, seqlen, heads, head_dim, rank, num_rows;
  double scale, cos_weight, norm_weight;
  dsv_dtype dtype;
} dsv_predictor_shape;

int dsv_predictor_loss_fwd_cpu(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                               dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows,
                               void* loss, void* row_stats);

/* dloss: acc type [B, H]. dq_lr and dk_lr ([B, S, H, rank]) are written completely (rows that
 * were not sampled get zero in dq_lr; a row sampled twice gets both contributions). */
int dsv_predictor_loss_bwd_cpu(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                               dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows,
                               const void* dloss, const void* row_stats,
                               dsv_bshd dq_lr, dsv_bshd dk_lr);

/* ------------------------------------------------------------------------------------------ */
/* Attention profile on sampled rows. For row i of (b, h), P_j = softmax_j(scale * q_i . k_j)
 * over all S keys; c_i = the size of the smallest set of keys whose probabilities sum to at
 * least theta. sparsity[b, h] = 1 - mean_i(c_i) / S. When kv_index is not NULL,
 * recall[b, h] = mean_i of the sum of P_j over the (distinct) entries of row i's list
 * kv_index[b, h, rows[i] / group_size, :kv_count[b, h]]. Outputs are acc type [B, H]. */
typedef struct dsv_profile_shape {
  int64_t batch, seqlen, heads, head_dim, num_rows;
  int64_t group_size, num_groups, kmax; /* used only with an index */
  double scale, theta;
  dsv_dtype dtype;
} dsv_profile_shape;

int dsv_profile_attention_cpu(const dsv_profile_shape* p, dsv_bshd q, dsv_bshd k,
                              const int32_t* rows, const int32_t* kv_index,
                              const int32_t* kv_count, void* sparsity, void* recall);

/* ------------------------------------------------------------------------------------------ */
/* Row gather / scatter-add, the building blocks of the sparse all-to-all of context
 * parallelism. A "row table" is [num_rows, dim] with contiguous rows of the given stride.
 *   gather:      dst[i, :] = src[index[i], :]              for i < count (dst contiguous)
 *   scatter-add: dst[index[i], :] += src[i, :]             for i < count
 * gather handles every dtype (rows out of range are zero-filled); scatter-add accumulates into a
 * caller-zeroed acc-type dst (float32, or float64 for DSV_FLOAT64 src) and skips rows out of range. */
int dsv_gather_rows_cpu(dsv_dtype dtype, int64_t dim, const void* src, int64_t src_row_stride,
                        int64_t num_rows, const int64_t* index, int64_t count, void* dst);
int dsv_scatter_add_rows_cpu(dsv_dtype dtype, int64_t dim, const void* src,
                             int64_t src_row_stride, const int64_t* index, int64_t count,
                             int64_t num_rows, void* dst);

/* ------------------------------------------------------------------------------------------ */
/* CUDA implementations (csrc/cuda/). Same arguments as the CPU ones, plus a device workspace of
 * at least the size the matching *_workspace_cuda() function returns, and a stream.
 *
 * Sparse attention with kv_block b > 1 (block lists) on CUDA: b = 16 or 64 (other b > 1:
 * DSV_ERR_UNSUPPORTED, b < 1: DSV_ERR_INVALID; kmax x b must stay below 2^30). Entry e of a list
 * covers keys e b .. min(e b + b, S) - 1; entries outside [0, ceil(S / b)) are skipped (-1
 * padding included, anywhere in the list), a block listed twice counts twice, lists need not be
 * sorted. The forward takes the token lists' head dims (64, 96, 128, 256) and group sizes. The
 * backward needs head_dim <= 128 and kmax <= 16384 (DSV_ERR_UNSUPPORTED otherwise) and is always
 * deterministic, DSV_FLAG_DETERMINISTIC or not: dK / dV key-major over an index sorted by group,
 * dQ query-major, both summed in registers without atomics; its workspace holds a sorted copy of
 * the lists and that index (about 16 x B x H x num_groups x kmax bytes).
 *
 * Token lists in groups of 16, 32 or 64 queries on an H100 / H200 (D 64 / 128): where the lists
 * of a 128-query block's groups overlap, the kernels run them as one over the union of their
 * lists (the kernel tuning's `merge`); the unions take workspace (forward and backward, up to
 * merge x 4 x B x H x num_groups x kmax bytes). A forward given less workspace than its
 * *_workspace_cuda() size (which assumes K / V row strides below 4 GB) runs every group
 * separately, with the same results. */
size_t dsv_sparse_attention_fwd_workspace_cuda(const dsv_attn_shape* p);
int dsv_sparse_attention_fwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                  const int32_t* kv_index, const int32_t* kv_count,
                                  dsv_bshd out, void* lse, void* workspace,
                                  size_t workspace_bytes, void* stream);
size_t dsv_sparse_attention_bwd_workspace_cuda(const dsv_attn_shape* p);
int dsv_sparse_attention_bwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                  dsv_bshd out, dsv_bshd dout, const void* lse,
                                  const int32_t* kv_index, const int32_t* kv_count,
                                  dsv_bshd dq, dsv_bshd dk, dsv_bshd dv, void* workspace,
                                  size_t workspace_bytes, void* stream);
size_t dsv_topk_estimate_workspace_cuda(const dsv_lowrank_shape* p);
int dsv_topk_estimate_cuda(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                           const int32_t* kv_count, int32_t* kv_index, void* workspace,
                           size_t workspace_bytes, void* stream);
size_t dsv_predictor_loss_workspace_cuda(const dsv_predictor_shape* p);
int dsv_predictor_loss_fwd_cuda(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                                dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows, void* loss,
                                void* row_stats, void* workspace, size_t workspace_bytes,
                                void* stream);
int dsv_predictor_loss_bwd_cuda(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                                dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows,
                                const void* dloss, const void* row_stats, dsv_bshd dq_lr,
                                dsv_bshd dk_lr, void* workspace, size_t workspace_bytes,
                                void* stream);
size_t dsv_profile_attention_workspace_cuda(const dsv_profile_shape* p);
int dsv_profile_attention_cuda(const dsv_profile_shape* p, dsv_bshd q, dsv_bshd k,
                               const int32_t* rows, const int32_t* kv_index,
                               const int32_t* kv_count, void* sparsity, void* recall,
                               void* workspace, size_t workspace_bytes, void* stream);
/* The kernel tuning chosen for CUDA device `device` (filled once per device: SM count, L2 size,
 * compute capability, and the choices the launches make from them; the environment variable
 * DSV_KERNEL_TUNING="key=value,..." overrides keys for experiments) written into buf as
 * "key=value,key=value" (NUL-terminated). DSV_ERR_NOMEM when len is too small, DSV_ERR_TUNING
 * when DSV_KERNEL_TUNING is malformed, DSV_ERR_CUDA when the device cannot be queried. */
int dsv_cuda_kernel_tuning(int device, char* buf, int64_t len);

int dsv_gather_rows_cuda(dsv_dtype dtype, int64_t dim, const void* src, int64_t src_row_stride,
                         int64_t num_rows, const int64_t* index, int64_t count, void* dst,
                         void* stream);
int dsv_scatter_add_rows_cuda(dsv_dtype dtype, int64_t dim, const void* src,
                              int64_t src_row_stride, const int64_t* index, int64_t count,
                              int64_t num_rows, void* dst, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* DSV_H */
