// dsv_ops.cpp - the one C++ file of dsv-ext: registers the `dsv` ops with PyTorch through the
// stable ABI (TORCH_TARGET_VERSION = 2.10) and forwards each call to the plain C API of
// csrc/dsv.h. It reads top to bottom:
//
//   1. helpers: dtypes, strided views, status codes;
//   2. the argument checks, one function per op, shared by the CPU and the CUDA implementation.
//      They check every shape, stride, dtype and device that the kernels rely on, so that a direct
//      call of torch.ops.dsv.* with bad tensors raises instead of touching memory it must not
//      (dsv_ext/ops.py checks the same things first and names the argument in a friendlier way),
//      and return the shape struct of the C call;
//   3. the CPU implementations (`*_cpu`): float32 and float64 run natively; float16 / bfloat16 are
//      converted to float32 here and the activation outputs converted back;
//   4. the CUDA implementations (`*_cuda`, built when DSV_WITH_CUDA is defined): float16 and
//      bfloat16 (and float32 where a kernel supports it) go straight to the kernels, with a
//      workspace from PyTorch's caching allocator, on the current stream of q's device;
//   5. the registration: the schemas once, then one implementation per dispatch key.
//
// The dispatcher picks the key from the devices of all tensor arguments (CUDA before CPU) and the
// checks require every tensor on q's device (src's for the row ops), so an implementation only
// runs on tensors of its own device; mixed devices raise "<argument>: device differs from q's".
// A build without CUDA registers no CUDA key: CUDA tensors get the dispatcher's "could not run
// 'dsv::...' with arguments from the 'CUDA' backend".

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#ifdef DSV_WITH_CUDA
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#endif

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "dsv.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// ------------------------------------------------------------------------------------------
// 1. helpers

bool is_half(ScalarType t) { return t == ScalarType::Half || t == ScalarType::BFloat16; }

bool is_floating(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || is_half(t);
}

dsv_dtype dsv_dtype_of(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return DSV_FLOAT32;
    case ScalarType::Double: return DSV_FLOAT64;
    case ScalarType::Half: return DSV_FLOAT16;
    case ScalarType::BFloat16: return DSV_BFLOAT16;
    default: STD_TORCH_CHECK(false, "dsv: unsupported dtype");
  }
  return DSV_FLOAT32;
}

// The dtype the CPU kernels compute in: float64 for float64, else float32 (see cpu_compute).
dsv_dtype cpu_dtype_of(ScalarType t) { return t == ScalarType::Double ? DSV_FLOAT64 : DSV_FLOAT32; }

// Accumulator dtype of outputs such as lse and losses.
ScalarType acc_type(ScalarType t) { return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float; }

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Float: return "float32";
    case ScalarType::Double: return "float64";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    default: return "another dtype";
  }
}

dsv_bshd bshd_of(const Tensor& t) {
  dsv_bshd v;
  v.data = t.data_ptr();
  v.stride_b = t.stride(0);
  v.stride_s = t.stride(1);
  v.stride_h = t.stride(2);
  return v;
}

const int32_t* int32_ptr(const Tensor& t) { return (const int32_t*)t.data_ptr(); }
const int64_t* int64_ptr(const Tensor& t) { return (const int64_t*)t.data_ptr(); }

void check_status(int status, const char* op) {
  STD_TORCH_CHECK(status == DSV_OK, "dsv.", op, " failed: ", dsv_status_string(status));
}

// ceil(a / b) for a >= 0, b > 0, without the overflow of a + b - 1 (group_size may be huge)
int64_t ceil_div(int64_t a, int64_t b) { return a <= 0 ? 0 : (a - 1) / b + 1; }

// A group larger than the sequence is one group of S queries: the same lists, the same result,
// and no huge sizes in C.
int64_t clamp_group(int64_t group_size, int64_t S) { return group_size < S ? group_size : (S > 0 ? S : 1); }

// ------------------------------------------------------------------------------------------
// 2. argument checks (shared by both devices)

// A [B, S, H, D] activation: 4-d, floating, last dim contiguous, on `like`'s device and dtype.
void check_bshd(const Tensor& t, const char* name, const Tensor& like, int64_t B, int64_t S,
                int64_t H, int64_t D) {
  STD_TORCH_CHECK(t.dim() == 4, name, ": expected a 4-d [B, S, H, D] tensor, got ", t.dim(), " dims");
  STD_TORCH_CHECK(is_floating(t.scalar_type()), name, ": expected a floating dtype");
  STD_TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, ": dtype differs from q's");
  STD_TORCH_CHECK(t.device() == like.device(), name, ": device differs from q's");
  STD_TORCH_CHECK(t.size(0) == B && t.size(1) == S && t.size(2) == H && t.size(3) == D, name,
                  ": expected shape [", B, ", ", S, ", ", H, ", ", D, "], got [", t.size(0), ", ",
                  t.size(1), ", ", t.size(2), ", ", t.size(3), "]");
  // an empty tensor is never read: any strides will do
  STD_TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1 || t.numel() == 0, name, ": the last dim must be contiguous");
  for (int i = 0; i < 3; ++i) STD_TORCH_CHECK(t.stride(i) >= 0, name, ": negative strides are not supported");
}

// A contiguous tensor of an exact dtype and shape (indices, counts, saved statistics).
void check_plain_tensor(const Tensor& t, const char* name, const Tensor& like, ScalarType want,
                        std::vector<int64_t> shape) {
  STD_TORCH_CHECK(t.scalar_type() == want, name, ": expected dtype ", dtype_name(want), ", got ",
                  dtype_name(t.scalar_type()));
  STD_TORCH_CHECK(t.device() == like.device(), name, ": device differs from q's");
  STD_TORCH_CHECK(t.dim() == (int64_t)shape.size(), name, ": expected ", shape.size(), " dims, got ", t.dim());
  for (size_t i = 0; i < shape.size(); ++i)
    STD_TORCH_CHECK(t.size(i) == shape[i], name, ": size of dim ", i, " is ", t.size(i), ", expected ", shape[i]);
  STD_TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous");
}

// The key lists of a [B, S, H, *] q: kv_index int32 [B, H, ceil(S/G), Kmax], kv_count int32 [B, H].
void check_lists(const Tensor& q, const Tensor& kv_index, const Tensor& kv_count, int64_t group_size) {
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2);
  STD_TORCH_CHECK(group_size > 0, "group_size: must be positive, got ", group_size);
  STD_TORCH_CHECK(kv_index.dim() == 4, "kv_index: expected [B, H, ceil(S/G), Kmax]");
  check_plain_tensor(kv_index, "kv_index", q, ScalarType::Int, {B, H, ceil_div(S, group_size), kv_index.size(3)});
  check_plain_tensor(kv_count, "kv_count", q, ScalarType::Int, {B, H});
}

// kv_block: keys per list entry (1: token lists; b > 1: entry e is the block of keys e*b ..
// min(e*b+b, S)-1, dsv.h). The kernels skip entries outside [0, ceil(S/b)). On the CPU a block
// larger than the sequence is one block of S keys (same lists, same result), so b is clamped to
// max(S, 1) there; the CUDA kernels take b = 1, 16 or 64 and cut the last block at S themselves
// (dsv_ext.sparse_attention runs 64-key lists on them and expands other block lists to token
// lists first, dsv_ext/ops.py, _native_kv_block).
dsv_attn_shape check_sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& kv_index, const Tensor& kv_count,
                                      int64_t group_size, double scale, bool deterministic,
                                      int64_t kv_block) {
  STD_TORCH_CHECK(q.dim() == 4, "q: expected a 4-d [B, S, H, D] tensor");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
  check_bshd(q, "q", q, B, S, H, D);
  check_bshd(k, "k", q, B, S, H, D);
  check_bshd(v, "v", q, B, S, H, D);
  STD_TORCH_CHECK(group_size > 0, "group_size: must be positive, got ", group_size);
  STD_TORCH_CHECK(std::isfinite(scale), "scale: must be finite");
  STD_TORCH_CHECK(kv_block >= 1, "kv_block: must be >= 1 (1: token lists), got ", kv_block);
  const bool cuda = q.device().is_cuda();
  STD_TORCH_CHECK(!cuda || kv_block == 1 || kv_block == 16 || kv_block == 64,
                  "kv_block: the CUDA kernels take 1, 16 or 64, got ", kv_block,
                  "; dsv_ext.expand_block_lists turns other block lists into token lists");
  check_lists(q, kv_index, kv_count, group_size);
  dsv_attn_shape p;
  p.batch = B; p.seqlen = S; p.heads = H; p.head_dim = D;
  p.group_size = clamp_group(group_size, S);
  p.num_groups = kv_index.size(2); p.kmax = kv_index.size(3);
  p.scale = scale;
  p.dtype = dsv_dtype_of(q.scalar_type());
  p.flags = deterministic ? DSV_FLAG_DETERMINISTIC : 0;
  p.kv_block = (cuda || kv_block < S) ? kv_block : (S > 0 ? S : 1);
  return p;
}

dsv_attn_shape check_sparse_attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& out, const Tensor& lse,
                                          const Tensor& kv_index, const Tensor& kv_count,
                                          int64_t group_size, double scale, bool deterministic,
                                          int64_t kv_block) {
  dsv_attn_shape p = check_sparse_attention(q, k, v, kv_index, kv_count, group_size, scale, deterministic,
                                            kv_block);
  const int64_t B = p.batch, S = p.seqlen, H = p.heads, D = p.head_dim;
  check_bshd(out, "out", q, B, S, H, D);
  check_bshd(dout, "dout", q, B, S, H, D);
  const ScalarType at = acc_type(q.scalar_type());
  STD_TORCH_CHECK(lse.scalar_type() == at, "lse: expected the accumulator dtype (float32, or float64 for float64 inputs)");
  check_plain_tensor(lse, "lse", q, at, {B, H, S});
  STD_TORCH_CHECK(!q.device().is_cuda() || p.kv_block == 1 || (D <= 128 && p.kmax <= 16384),
                  "kv_block: the CUDA backward of block lists needs head_dim <= 128 and Kmax <= 16384, got head_dim ",
                  D, ", Kmax ", p.kmax);
  return p;
}

dsv_lowrank_shape check_topk_estimate(const Tensor& q_lr, const Tensor& k_lr, const Tensor& kv_count,
                                      int64_t group_size, int64_t kmax) {
  STD_TORCH_CHECK(q_lr.dim() == 4, "q_lr: expected a 4-d [B, S, H, r] tensor");
  const int64_t B = q_lr.size(0), S = q_lr.size(1), H = q_lr.size(2), R = q_lr.size(3);
  check_bshd(q_lr, "q_lr", q_lr, B, S, H, R);
  check_bshd(k_lr, "k_lr", q_lr, B, S, H, R);
  STD_TORCH_CHECK(group_size > 0, "group_size: must be positive, got ", group_size);
  STD_TORCH_CHECK(kmax >= 0 && kmax <= S, "kmax: must be in [0, S=", S, "], got ", kmax);
  check_plain_tensor(kv_count, "kv_count", q_lr, ScalarType::Int, {B, H});
  dsv_lowrank_shape p;
  p.batch = B; p.seqlen = S; p.heads = H; p.rank = R;
  p.group_size = clamp_group(group_size, S); p.num_groups = ceil_div(S, group_size); p.kmax = kmax;
  p.dtype = dsv_dtype_of(q_lr.scalar_type());
  return p;
}

dsv_predictor_shape check_predictor_loss(const Tensor& q, const Tensor& k, const Tensor& q_lr,
                                         const Tensor& k_lr, const Tensor& rows, double scale,
                                         double cos_weight, double norm_weight) {
  STD_TORCH_CHECK(q.dim() == 4, "q: expected a 4-d [B, S, H, D] tensor");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
  check_bshd(q, "q", q, B, S, H, D);
  check_bshd(k, "k", q, B, S, H, D);
  STD_TORCH_CHECK(q_lr.dim() == 4, "q_lr: expected a 4-d [B, S, H, r] tensor");
  check_bshd(q_lr, "q_lr", q, B, S, H, q_lr.size(3));
  check_bshd(k_lr, "k_lr", q, B, S, H, q_lr.size(3));
  STD_TORCH_CHECK(rows.dim() == 1, "rows: expected a 1-d tensor");
  check_plain_tensor(rows, "rows", q, ScalarType::Int, {rows.size(0)});
  STD_TORCH_CHECK(std::isfinite(scale), "scale: must be finite");
  dsv_predictor_shape p;
  p.batch = B; p.seqlen = S; p.heads = H; p.head_dim = D;
  p.rank = q_lr.size(3); p.num_rows = rows.size(0);
  p.scale = scale; p.cos_weight = cos_weight; p.norm_weight = norm_weight;
  p.dtype = dsv_dtype_of(q.scalar_type());
  return p;
}

dsv_predictor_shape check_predictor_loss_bwd(const Tensor& dloss, const Tensor& q, const Tensor& k,
                                             const Tensor& q_lr, const Tensor& k_lr, const Tensor& rows,
                                             const Tensor& row_stats, double scale, double cos_weight,
                                             double norm_weight) {
  dsv_predictor_shape p = check_predictor_loss(q, k, q_lr, k_lr, rows, scale, cos_weight, norm_weight);
  const ScalarType at = acc_type(q.scalar_type());
  STD_TORCH_CHECK(dloss.scalar_type() == at, "dloss: expected the accumulator dtype");
  check_plain_tensor(dloss, "dloss", q, at, {p.batch, p.heads});
  STD_TORCH_CHECK(row_stats.scalar_type() == at, "row_stats: expected the accumulator dtype");
  check_plain_tensor(row_stats, "row_stats", q, at, {p.batch, p.heads, p.num_rows, 3});
  return p;
}

// Without an index (kv_index and kv_count both absent) only the sparsity is measured.
dsv_profile_shape check_profile_attention(const Tensor& q, const Tensor& k, const Tensor& rows, double theta,
                                          double scale, const std::optional<Tensor>& kv_index,
                                          const std::optional<Tensor>& kv_count, int64_t group_size) {
  STD_TORCH_CHECK(q.dim() == 4, "q: expected a 4-d [B, S, H, D] tensor");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
  check_bshd(q, "q", q, B, S, H, D);
  check_bshd(k, "k", q, B, S, H, D);
  STD_TORCH_CHECK(rows.dim() == 1, "rows: expected a 1-d tensor");
  check_plain_tensor(rows, "rows", q, ScalarType::Int, {rows.size(0)});
  STD_TORCH_CHECK(theta > 0.0 && theta <= 1.0, "theta: must be in (0, 1], got ", theta);
  STD_TORCH_CHECK(std::isfinite(scale), "scale: must be finite");
  STD_TORCH_CHECK(kv_index.has_value() == kv_count.has_value(), "kv_index and kv_count: give both or neither");
  dsv_profile_shape p;
  p.batch = B; p.seqlen = S; p.heads = H; p.head_dim = D; p.num_rows = rows.size(0);
  p.group_size = 1; p.num_groups = 0; p.kmax = 0;
  p.scale = scale; p.theta = theta;
  p.dtype = dsv_dtype_of(q.scalar_type());
  if (kv_index.has_value()) {
    check_lists(q, *kv_index, *kv_count, group_size);
    p.group_size = clamp_group(group_size, S);
    p.num_groups = kv_index->size(2); p.kmax = kv_index->size(3);
  }
  return p;
}

// A [rows, dim] table (rows strided, dim contiguous) and an int64 index on its device.
void check_rows(const Tensor& src, const Tensor& index) {
  STD_TORCH_CHECK(src.dim() == 2, "src: expected a 2-d [rows, dim] tensor, got ", src.dim(), " dims");
  STD_TORCH_CHECK(is_floating(src.scalar_type()), "src: expected a floating dtype");
  STD_TORCH_CHECK(src.size(1) <= 1 || src.stride(1) == 1 || src.numel() == 0, "src: the last dim must be contiguous");
  STD_TORCH_CHECK(src.stride(0) >= 0, "src: negative strides are not supported");
  STD_TORCH_CHECK(index.dim() == 1, "index: expected a 1-d tensor");
  check_plain_tensor(index, "index", src, ScalarType::Long, {index.size(0)});
}

void check_scatter_add_rows(const Tensor& src, const Tensor& index, int64_t num_rows) {
  check_rows(src, index);
  STD_TORCH_CHECK(index.size(0) == src.size(0), "index: length ", index.size(0), " differs from src rows ", src.size(0));
  STD_TORCH_CHECK(num_rows >= 0, "num_rows: must be >= 0");
}

// ------------------------------------------------------------------------------------------
// 3. CPU: the C reference kernels

// CPU kernels compute in float32 / float64: convert half inputs.
Tensor cpu_compute(const Tensor& t) {
  if (is_half(t.scalar_type())) return torch::stable::to(t, ScalarType::Float);
  return t;
}

Tensor cast_back(const Tensor& t, ScalarType want) {
  if (t.scalar_type() == want) return t;
  return torch::stable::to(t, want);
}

std::tuple<Tensor, Tensor> sparse_attention_fwd_cpu(Tensor q, Tensor k, Tensor v, Tensor kv_index,
                                                    Tensor kv_count, int64_t group_size, double scale,
                                                    bool deterministic, int64_t kv_block) {
  dsv_attn_shape p = check_sparse_attention(q, k, v, kv_index, kv_count, group_size, scale, deterministic,
                                            kv_block);
  const ScalarType dt = q.scalar_type();
  p.dtype = cpu_dtype_of(dt);
  Tensor qc = cpu_compute(q), kc = cpu_compute(k), vc = cpu_compute(v);
  Tensor out = torch::stable::new_empty(qc, {p.batch, p.seqlen, p.heads, p.head_dim});
  Tensor lse = torch::stable::new_empty(qc, {p.batch, p.heads, p.seqlen}, acc_type(dt));
  if (out.numel() > 0)
    check_status(dsv_sparse_attention_fwd_cpu(&p, bshd_of(qc), bshd_of(kc), bshd_of(vc), int32_ptr(kv_index),
                                              int32_ptr(kv_count), bshd_of(out), lse.data_ptr()),
                 "sparse_attention_fwd");
  return std::make_tuple(cast_back(out, dt), lse);
}

std::tuple<Tensor, Tensor, Tensor> sparse_attention_bwd_cpu(Tensor dout, Tensor q, Tensor k, Tensor v,
                                                            Tensor out, Tensor lse, Tensor kv_index,
                                                            Tensor kv_count, int64_t group_size,
                                                            double scale, bool deterministic,
                                                            int64_t kv_block) {
  dsv_attn_shape p = check_sparse_attention_bwd(dout, q, k, v, out, lse, kv_index, kv_count, group_size,
                                                scale, deterministic, kv_block);
  const ScalarType dt = q.scalar_type();
  p.dtype = cpu_dtype_of(dt);
  Tensor qc = cpu_compute(q), kc = cpu_compute(k), vc = cpu_compute(v);
  Tensor oc = cpu_compute(out), doc = cpu_compute(dout);
  Tensor dq = torch::stable::new_empty(qc, {p.batch, p.seqlen, p.heads, p.head_dim});
  Tensor dk = torch::stable::new_empty(qc, {p.batch, p.seqlen, p.heads, p.head_dim});
  Tensor dv = torch::stable::new_empty(qc, {p.batch, p.seqlen, p.heads, p.head_dim});
  if (dq.numel() > 0)
    check_status(dsv_sparse_attention_bwd_cpu(&p, bshd_of(qc), bshd_of(kc), bshd_of(vc), bshd_of(oc),
                                              bshd_of(doc), lse.data_ptr(), int32_ptr(kv_index),
                                              int32_ptr(kv_count), bshd_of(dq), bshd_of(dk), bshd_of(dv)),
                 "sparse_attention_bwd");
  return std::make_tuple(cast_back(dq, dt), cast_back(dk, dt), cast_back(dv, dt));
}

Tensor topk_estimate_cpu(Tensor q_lr, Tensor k_lr, Tensor kv_count, int64_t group_size, int64_t kmax) {
  dsv_lowrank_shape p = check_topk_estimate(q_lr, k_lr, kv_count, group_size, kmax);
  p.dtype = cpu_dtype_of(q_lr.scalar_type());
  Tensor index = torch::stable::new_empty(q_lr, {p.batch, p.heads, p.num_groups, kmax}, ScalarType::Int);
  if (index.numel() == 0) return index;
  Tensor qc = cpu_compute(q_lr), kc = cpu_compute(k_lr);
  check_status(dsv_topk_estimate_cpu(&p, bshd_of(qc), bshd_of(kc), int32_ptr(kv_count), (int32_t*)index.data_ptr()),
               "topk_estimate");
  return index;
}

std::tuple<Tensor, Tensor> predictor_loss_fwd_cpu(Tensor q, Tensor k, Tensor q_lr, Tensor k_lr, Tensor rows,
                                                  double scale, double cos_weight, double norm_weight) {
  dsv_predictor_shape p = check_predictor_loss(q, k, q_lr, k_lr, rows, scale, cos_weight, norm_weight);
  const ScalarType at = acc_type(q.scalar_type());
  p.dtype = cpu_dtype_of(q.scalar_type());
  Tensor qc = cpu_compute(q), kc = cpu_compute(k), qlc = cpu_compute(q_lr), klc = cpu_compute(k_lr);
  Tensor loss = torch::stable::new_empty(qc, {p.batch, p.heads}, at);
  Tensor stats = torch::stable::new_empty(qc, {p.batch, p.heads, p.num_rows, 3}, at);
  if (loss.numel() > 0)
    check_status(dsv_predictor_loss_fwd_cpu(&p, bshd_of(qc), bshd_of(kc), bshd_of(qlc), bshd_of(klc),
                                            int32_ptr(rows), loss.data_ptr(), stats.data_ptr()),
                 "predictor_loss_fwd");
  return std::make_tuple(loss, stats);
}

std::tuple<Tensor, Tensor> predictor_loss_bwd_cpu(Tensor dloss, Tensor q, Tensor k, Tensor q_lr, Tensor k_lr,
                                                  Tensor rows, Tensor row_stats, double scale,
                                                  double cos_weight, double norm_weight) {
  dsv_predictor_shape p = check_predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, row_stats, scale,
                                                   cos_weight, norm_weight);
  p.dtype = cpu_dtype_of(q.scalar_type());
  Tensor qc = cpu_compute(q), kc = cpu_compute(k), qlc = cpu_compute(q_lr), klc = cpu_compute(k_lr);
  Tensor dq_lr = torch::stable::new_empty(qlc, {p.batch, p.seqlen, p.heads, p.rank});
  Tensor dk_lr = torch::stable::new_empty(qlc, {p.batch, p.seqlen, p.heads, p.rank});
  if (dq_lr.numel() > 0)
    check_status(dsv_predictor_loss_bwd_cpu(&p, bshd_of(qc), bshd_of(kc), bshd_of(qlc), bshd_of(klc),
                                            int32_ptr(rows), dloss.data_ptr(), row_stats.data_ptr(),
                                            bshd_of(dq_lr), bshd_of(dk_lr)),
                 "predictor_loss_bwd");
  return std::make_tuple(cast_back(dq_lr, q_lr.scalar_type()), cast_back(dk_lr, q_lr.scalar_type()));
}

std::tuple<Tensor, Tensor> profile_attention_cpu(Tensor q, Tensor k, Tensor rows, double theta, double scale,
                                                 std::optional<Tensor> kv_index, std::optional<Tensor> kv_count,
                                                 int64_t group_size) {
  dsv_profile_shape p = check_profile_attention(q, k, rows, theta, scale, kv_index, kv_count, group_size);
  const ScalarType at = acc_type(q.scalar_type());
  p.dtype = cpu_dtype_of(q.scalar_type());
  const bool with_index = kv_index.has_value();
  Tensor qc = cpu_compute(q), kc = cpu_compute(k);
  Tensor sparsity = torch::stable::new_empty(qc, {p.batch, p.heads}, at);
  Tensor recall = torch::stable::new_empty(qc, {p.batch, p.heads}, at);
  torch::stable::fill_(recall, NAN);
  if (sparsity.numel() > 0)
    check_status(dsv_profile_attention_cpu(&p, bshd_of(qc), bshd_of(kc), int32_ptr(rows),
                                           with_index ? int32_ptr(*kv_index) : nullptr,
                                           with_index ? int32_ptr(*kv_count) : nullptr, sparsity.data_ptr(),
                                           with_index ? recall.data_ptr() : nullptr),
                 "profile_attention");
  return std::make_tuple(sparsity, recall);
}

// gather_rows copies rows: every dtype runs natively.
Tensor gather_rows_cpu(Tensor src, Tensor index) {
  check_rows(src, index);
  const int64_t M = index.size(0), D = src.size(1);
  Tensor dst = torch::stable::new_empty(src, {M, D});
  if (dst.numel() > 0)
    check_status(dsv_gather_rows_cpu(dsv_dtype_of(src.scalar_type()), D, src.data_ptr(), src.stride(0),
                                     src.size(0), int64_ptr(index), M, dst.data_ptr()),
                 "gather_rows");
  return dst;
}

Tensor scatter_add_rows_cpu(Tensor src, Tensor index, int64_t num_rows) {
  check_scatter_add_rows(src, index, num_rows);
  const int64_t M = index.size(0), D = src.size(1);
  const ScalarType dt = src.scalar_type();
  Tensor sc = cpu_compute(src);
  Tensor acc = torch::stable::new_zeros(sc, {num_rows, D}, acc_type(dt));
  if (M > 0 && D > 0 && num_rows > 0)
    check_status(dsv_scatter_add_rows_cpu(cpu_dtype_of(dt), D, sc.data_ptr(), sc.stride(0), int64_ptr(index), M,
                                          num_rows, acc.data_ptr()),
                 "scatter_add_rows");
  return cast_back(acc, dt);
}

// ------------------------------------------------------------------------------------------
// 4. CUDA: the CUDA C kernels

#ifdef DSV_WITH_CUDA
// The device of the call's tensors made current, and its current stream.
struct CudaContext {
  torch::stable::accelerator::DeviceGuard guard;
  void* stream;
  explicit CudaContext(const Tensor& t) : guard(t.get_device_index()), stream(nullptr) {
    STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream) == AOTI_TORCH_SUCCESS,
                    "dsv: could not get the current CUDA stream");
  }
};

Tensor workspace_like(const Tensor& t, size_t bytes) {
  int64_t n = (int64_t)(bytes > 0 ? bytes : 1);
  return torch::stable::new_empty(t, {n}, ScalarType::Byte);
}

std::tuple<Tensor, Tensor> sparse_attention_fwd_cuda(Tensor q, Tensor k, Tensor v, Tensor kv_index,
                                                     Tensor kv_count, int64_t group_size, double scale,
                                                     bool deterministic, int64_t kv_block) {
  dsv_attn_shape p = check_sparse_attention(q, k, v, kv_index, kv_count, group_size, scale, deterministic,
                                            kv_block);
  CudaContext ctx(q);
  Tensor out = torch::stable::new_empty(q, {p.batch, p.seqlen, p.heads, p.head_dim});
  Tensor lse = torch::stable::new_empty(q, {p.batch, p.heads, p.seqlen}, acc_type(q.scalar_type()));
  if (out.numel() > 0) {
    size_t ws = dsv_sparse_attention_fwd_workspace_cuda(&p);
    Tensor work = workspace_like(q, ws);
    check_status(dsv_sparse_attention_fwd_cuda(&p, bshd_of(q), bshd_of(k), bshd_of(v), int32_ptr(kv_index),
                                               int32_ptr(kv_count), bshd_of(out), lse.data_ptr(),
                                               work.data_ptr(), ws, ctx.stream),
                 "sparse_attention_fwd");
  }
  return std::make_tuple(out, lse);
}

std::tuple<Tensor, Tensor, Tensor> sparse_attention_bwd_cuda(Tensor dout, Tensor q, Tensor k, Tensor v,
                                                             Tensor out, Tensor lse, Tensor kv_index,
                                                             Tensor kv_count, int64_t group_size,
                                                             double scale, bool deterministic,
                                                             int64_t kv_block) {
  dsv_attn_shape p = check_sparse_attention_bwd(dout, q, k, v, out, lse, kv_index, kv_count, group_size,
                                                scale, deterministic, kv_block);
  CudaContext ctx(q);
  Tensor dq = torch::stable::new_empty(q, {p.batch, p.seqlen, p.heads, p.head_dim});
  Tensor dk = torch::stable::new_empty(q, {p.batch, p.seqlen, p.heads, p.head_dim});
  Tensor dv = torch::stable::new_empty(q, {p.batch, p.seqlen, p.heads, p.head_dim});
  if (dq.numel() > 0) {
    size_t ws = dsv_sparse_attention_bwd_workspace_cuda(&p);
    Tensor work = workspace_like(q, ws);
    check_status(dsv_sparse_attention_bwd_cuda(&p, bshd_of(q), bshd_of(k), bshd_of(v), bshd_of(out),
                                               bshd_of(dout), lse.data_ptr(), int32_ptr(kv_index),
                                               int32_ptr(kv_count), bshd_of(dq), bshd_of(dk), bshd_of(dv),
                                               work.data_ptr(), ws, ctx.stream),
                 "sparse_attention_bwd");
  }
  return std::make_tuple(dq, dk, dv);
}

Tensor topk_estimate_cuda(Tensor q_lr, Tensor k_lr, Tensor kv_count, int64_t group_size, int64_t kmax) {
  dsv_lowrank_shape p = check_topk_estimate(q_lr, k_lr, kv_count, group_size, kmax);
  Tensor index = torch::stable::new_empty(q_lr, {p.batch, p.heads, p.num_groups, kmax}, ScalarType::Int);
  if (index.numel() == 0) return index;
  CudaContext ctx(q_lr);
  size_t ws = dsv_topk_estimate_workspace_cuda(&p);
  Tensor work = workspace_like(q_lr, ws);
  check_status(dsv_topk_estimate_cuda(&p, bshd_of(q_lr), bshd_of(k_lr), int32_ptr(kv_count),
                                      (int32_t*)index.data_ptr(), work.data_ptr(), ws, ctx.stream),
               "topk_estimate");
  return index;
}

std::tuple<Tensor, Tensor> predictor_loss_fwd_cuda(Tensor q, Tensor k, Tensor q_lr, Tensor k_lr, Tensor rows,
                                                   double scale, double cos_weight, double norm_weight) {
  dsv_predictor_shape p = check_predictor_loss(q, k, q_lr, k_lr, rows, scale, cos_weight, norm_weight);
  const ScalarType at = acc_type(q.scalar_type());
  CudaContext ctx(q);
  Tensor loss = torch::stable::new_empty(q, {p.batch, p.heads}, at);
  Tensor stats = torch::stable::new_empty(q, {p.batch, p.heads, p.num_rows, 3}, at);
  if (loss.numel() > 0) {
    size_t ws = dsv_predictor_loss_workspace_cuda(&p);
    Tensor work = workspace_like(q, ws);
    check_status(dsv_predictor_loss_fwd_cuda(&p, bshd_of(q), bshd_of(k), bshd_of(q_lr), bshd_of(k_lr),
                                             int32_ptr(rows), loss.data_ptr(), stats.data_ptr(),
                                             work.data_ptr(), ws, ctx.stream),
                 "predictor_loss_fwd");
  }
  return std::make_tuple(loss, stats);
}

std::tuple<Tensor, Tensor> predictor_loss_bwd_cuda(Tensor dloss, Tensor q, Tensor k, Tensor q_lr, Tensor k_lr,
                                                   Tensor rows, Tensor row_stats, double scale,
                                                   double cos_weight, double norm_weight) {
  dsv_predictor_shape p = check_predictor_loss_bwd(dloss, q, k, q_lr, k_lr, rows, row_stats, scale,
                                                   cos_weight, norm_weight);
  CudaContext ctx(q);
  Tensor dq_lr = torch::stable::new_empty(q_lr, {p.batch, p.seqlen, p.heads, p.rank});
  Tensor dk_lr = torch::stable::new_empty(q_lr, {p.batch, p.seqlen, p.heads, p.rank});
  if (dq_lr.numel() > 0) {
    size_t ws = dsv_predictor_loss_workspace_cuda(&p);
    Tensor work = workspace_like(q, ws);
    check_status(dsv_predictor_loss_bwd_cuda(&p, bshd_of(q), bshd_of(k), bshd_of(q_lr), bshd_of(k_lr),
                                             int32_ptr(rows), dloss.data_ptr(), row_stats.data_ptr(),
                                             bshd_of(dq_lr), bshd_of(dk_lr), work.data_ptr(), ws, ctx.stream),
                 "predictor_loss_bwd");
  }
  return std::make_tuple(dq_lr, dk_lr);
}

std::tuple<Tensor, Tensor> profile_attention_cuda(Tensor q, Tensor k, Tensor rows, double theta, double scale,
                                                  std::optional<Tensor> kv_index, std::optional<Tensor> kv_count,
                                                  int64_t group_size) {
  dsv_profile_shape p = check_profile_attention(q, k, rows, theta, scale, kv_index, kv_count, group_size);
  const ScalarType at = acc_type(q.scalar_type());
  const bool with_index = kv_index.has_value();
  CudaContext ctx(q);
  Tensor sparsity = torch::stable::new_empty(q, {p.batch, p.heads}, at);
  Tensor recall = torch::stable::new_empty(q, {p.batch, p.heads}, at);
  torch::stable::fill_(recall, NAN);
  if (sparsity.numel() > 0) {
    size_t ws = dsv_profile_attention_workspace_cuda(&p);
    Tensor work = workspace_like(q, ws);
    check_status(dsv_profile_attention_cuda(&p, bshd_of(q), bshd_of(k), int32_ptr(rows),
                                            with_index ? int32_ptr(*kv_index) : nullptr,
                                            with_index ? int32_ptr(*kv_count) : nullptr, sparsity.data_ptr(),
                                            with_index ? recall.data_ptr() : nullptr, work.data_ptr(), ws,
                                            ctx.stream),
                 "profile_attention");
  }
  return std::make_tuple(sparsity, recall);
}

Tensor gather_rows_cuda(Tensor src, Tensor index) {
  check_rows(src, index);
  const int64_t M = index.size(0), D = src.size(1);
  Tensor dst = torch::stable::new_empty(src, {M, D});
  if (dst.numel() == 0) return dst;
  CudaContext ctx(src);
  check_status(dsv_gather_rows_cuda(dsv_dtype_of(src.scalar_type()), D, src.data_ptr(), src.stride(0), src.size(0),
                                    int64_ptr(index), M, dst.data_ptr(), ctx.stream),
               "gather_rows");
  return dst;
}

Tensor scatter_add_rows_cuda(Tensor src, Tensor index, int64_t num_rows) {
  check_scatter_add_rows(src, index, num_rows);
  const int64_t M = index.size(0), D = src.size(1);
  const ScalarType dt = src.scalar_type();
  CudaContext ctx(src);
  Tensor acc = torch::stable::new_zeros(src, {num_rows, D}, acc_type(dt));
  if (M > 0 && D > 0 && num_rows > 0)
    check_status(dsv_scatter_add_rows_cuda(dsv_dtype_of(dt), D, src.data_ptr(), src.stride(0), int64_ptr(index), M,
                                           num_rows, acc.data_ptr(), ctx.stream),
                 "scatter_add_rows");
  return cast_back(acc, dt);
}
#endif  // DSV_WITH_CUDA

// ------------------------------------------------------------------------------------------
// kernel tuning

// The kernel tuning of CUDA device `device` as the bytes of "key=value,key=value"
// (dsv_cuda_kernel_tuning); a CPU-only build reports "cuda_kernels=0".
Tensor kernel_tuning(int64_t device) {
  STD_TORCH_CHECK(device >= 0 && device < 64, "device: expected a CUDA device index in [0, 64), got ", device);
#ifdef DSV_WITH_CUDA
  char buf[512];
  check_status(dsv_cuda_kernel_tuning((int)device, buf, (int64_t)sizeof buf), "kernel_tuning");
#else
  const char buf[] = "cuda_kernels=0";
#endif
  const int64_t n = (int64_t)strlen(buf);
  Tensor t = torch::stable::empty({n}, ScalarType::Byte);
  if (n > 0) memcpy(t.data_ptr(), buf, (size_t)n);
  return t;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// 5. registration: the schemas, then one implementation per dispatch key

STABLE_TORCH_LIBRARY(dsv, m) {
  m.def("sparse_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor kv_index, Tensor kv_count, int group_size, float scale, bool deterministic=False, int kv_block=1) -> (Tensor, Tensor)");
  m.def("sparse_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor kv_index, Tensor kv_count, int group_size, float scale, bool deterministic=False, int kv_block=1) -> (Tensor, Tensor, Tensor)");
  m.def("topk_estimate(Tensor q_lr, Tensor k_lr, Tensor kv_count, int group_size, int kmax) -> Tensor");
  m.def("predictor_loss_fwd(Tensor q, Tensor k, Tensor q_lr, Tensor k_lr, Tensor rows, float scale, float cos_weight, float norm_weight) -> (Tensor, Tensor)");
  m.def("predictor_loss_bwd(Tensor dloss, Tensor q, Tensor k, Tensor q_lr, Tensor k_lr, Tensor rows, Tensor row_stats, float scale, float cos_weight, float norm_weight) -> (Tensor, Tensor)");
  m.def("profile_attention(Tensor q, Tensor k, Tensor rows, float theta, float scale, Tensor? kv_index, Tensor? kv_count, int group_size) -> (Tensor, Tensor)");
  m.def("gather_rows(Tensor src, Tensor index) -> Tensor");
  m.def("scatter_add_rows(Tensor src, Tensor index, int num_rows) -> Tensor");
  m.def("kernel_tuning(int device) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(dsv, CPU, m) {
  m.impl("sparse_attention_fwd", TORCH_BOX(&sparse_attention_fwd_cpu));
  m.impl("sparse_attention_bwd", TORCH_BOX(&sparse_attention_bwd_cpu));
  m.impl("topk_estimate", TORCH_BOX(&topk_estimate_cpu));
  m.impl("predictor_loss_fwd", TORCH_BOX(&predictor_loss_fwd_cpu));
  m.impl("predictor_loss_bwd", TORCH_BOX(&predictor_loss_bwd_cpu));
  m.impl("profile_attention", TORCH_BOX(&profile_attention_cpu));
  m.impl("gather_rows", TORCH_BOX(&gather_rows_cpu));
  m.impl("scatter_add_rows", TORCH_BOX(&scatter_add_rows_cpu));
}

// no tensor arguments: one kernel for every backend
STABLE_TORCH_LIBRARY_IMPL(dsv, CompositeExplicitAutograd, m) {
  m.impl("kernel_tuning", TORCH_BOX(&kernel_tuning));
}

#ifdef DSV_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(dsv, CUDA, m) {
  m.impl("sparse_attention_fwd", TORCH_BOX(&sparse_attention_fwd_cuda));
  m.impl("sparse_attention_bwd", TORCH_BOX(&sparse_attention_bwd_cuda));
  m.impl("topk_estimate", TORCH_BOX(&topk_estimate_cuda));
  m.impl("predictor_loss_fwd", TORCH_BOX(&predictor_loss_fwd_cuda));
  m.impl("predictor_loss_bwd", TORCH_BOX(&predictor_loss_bwd_cuda));
  m.impl("profile_attention", TORCH_BOX(&profile_attention_cuda));
  m.impl("gather_rows", TORCH_BOX(&gather_rows_cuda));
  m.impl("scatter_add_rows", TORCH_BOX(&scatter_add_rows_cuda));
}
#endif
