// nmtserve's decoding kernels for ONNX Runtime's CPU provider. Attention with one query per row and head,
// as a decoder step has: ONNX Runtime's GroupQueryAttention and MultiHeadAttention make two MLAS calls per
// row and head for a few thousand multiply-adds; here each row and head is one plain loop over its
// keys, vectorised by the compiler over the head dimension (docs/performance-journal.md, "A kernel of our own").
// And the step's search head: each row's best candidates and their log-softmax in one pass. And the int8
// graphs' activation quantisation with a scale per row, so that a row's result never depends on its batch. And
// the encoder's self-attention over the batch's packed tokens, each sentence's queries over its own keys, and
// its cross K/V from those packed rows into heads. And the step's input rows: a token's embedding and its position's.
// Built by export/runtime/kernels.py against ONNX Runtime's C API header; loaded with
// SessionOptions.register_custom_ops_library; the step graph's nodes are swapped at load time.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <optional>
#include <vector>

#include <unistd.h>

extern "C" {
#include "kernels.h"
}

namespace {

// The loops below that the compiler vectorises are compiled three times, and the loader picks the clone the CPU
// runs best: x86-64-v4 (AVX-512, 512-bit vectors with kernels.py's -mprefer-vector-width=512: ONNX Runtime's own
// GEMMs run 512-bit on such a CPU already), x86-64-v3 (AVX2 + FMA) or the SSE2 baseline.
#define CLONED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

// exp(x) for x <= 0 (scores less their maximum), as Cephes' expf: x = n·ln 2 + r, exp(r) by a polynomial,
// 2^n put into the exponent bits. Plain arithmetic that the compiler vectorises (std::exp is a scalar call
// without -ffast-math). Within 1 ulp of exp as written; built with -fassociative-math (kernels.py) the
// compiler may merge the two-part ln 2 step: measured within 16 ulp (1e-6 relative) on [-20, 0] and 61
// ulp (4e-6) down to -87, far below a decoder step's own rounding. Below -87 it gives exp(-87) ~ 1.6e-38.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// Each row and head's keys and values are a few kB in caches of many MB (a 128-row step of the default model reads
// ~10 MB of them), so `attend` would wait on memory a line at a time: an attention item first asks for the keys
// and values of the item PREFETCH_AHEAD after it (prefetch_keys), when the layer's keys and values read by the step
// outgrow a quarter of the core's L2 cache (outgrows_cache: they come back to this layer a step later, after the
// other layers' caches and weights have passed through it; below that they are still there, and the asking cost
// 1.7% of a whole translation at batch 1). docs/performance-journal.md, "Prefetching the caches".
constexpr int64_t PREFETCH_AHEAD = 2;

bool outgrows_cache(int64_t bytes) {
  static const int64_t l2 = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? int64_t{size} : int64_t{1} << 20;
  }();
  return bytes > l2 / 4;
}

// The bytes of the keys and values a step's attention reads: n[i] (clamped to 0..limit) keys and as many values
// of `per_key` floats each.
int64_t read_bytes(const int32_t* n, int64_t count, int64_t limit, int64_t per_key) {
  int64_t keys = 0;
  for (int64_t i = 0; i < count; i++) keys += std::min<int64_t>(std::max<int32_t>(n[i], 0), limit);
  return 2 * keys * per_key * static_cast<int64_t>(sizeof(float));
}

// Asks the memory for the first n keys and values (rows of d floats) that `attend` will read, addressed as it
// addresses them.
void prefetch_keys(const float* k, const float* v, int64_t n, int64_t d, const int32_t* from = nullptr,
                   int64_t self = 0, int64_t row_stride = 0) {
  for (int64_t t = 0; t < n; t++) {
    const int64_t at = t * d + (from ? (from[t] - self) * row_stride : 0);
    for (int64_t i = 0; i < d; i += 64 / sizeof(float)) {
      __builtin_prefetch(k + at + i);
      __builtin_prefetch(v + at + i);
    }
  }
}

// Softmax-weighted sum over the first n keys and values (rows of d floats) for one query of d floats,
// scaled by 1/sqrt(d). p: room for n scores. With `from` (DecodeBeamSelfAttention), key and value t are
// those of row from[t], `row_stride` floats per row away from this one's (row `self`). D: d known when compiled
// (0: read from d), which lets the compiler keep a row's products and the output in registers.
template <int64_t D>
__attribute__((always_inline)) inline void attend_rows(const float* q, const float* k, const float* v, int64_t n,
                                                       int64_t d_given, float* p, float* out, const int32_t* from,
                                                       int64_t self, int64_t row_stride) {
  const int64_t d = D ? D : d_given;
  if (n <= 0) {  // nothing to attend to (a source of no token): zeros, not 0 / 0
    for (int64_t i = 0; i < d; i++) out[i] = 0.f;
    return;
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  float best = -INFINITY;
  for (int64_t t = 0; t < n; t++) {
    const float* kt = k + t * d + (from ? (from[t] - self) * row_stride : 0);
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += q[i] * kt[i];
    p[t] = s * scale;
    best = p[t] > best ? p[t] : best;
  }
  float total = 0.f;
  for (int64_t t = 0; t < n; t++) p[t] = exp_nonpositive(p[t] - best);
  for (int64_t t = 0; t < n; t++) total += p[t];
  for (int64_t i = 0; i < d; i++) out[i] = 0.f;
  for (int64_t t = 0; t < n; t++) {
    const float w = p[t] / total;
    const float* vt = v + t * d + (from ? (from[t] - self) * row_stride : 0);
    for (int64_t i = 0; i < d; i++) out[i] += w * vt[i];
  }
}

CLONED
void attend(const float* q, const float* k, const float* v, int64_t n, int64_t d, float* p, float* out,
            const int32_t* from = nullptr, int64_t self = 0, int64_t row_stride = 0) {
  if (d == 64)  // the head size of both the default and the OPUS-MT models
    attend_rows<64>(q, k, v, n, d, p, out, from, self, row_stride);
  else
    attend_rows<0>(q, k, v, n, d, p, out, from, self, row_stride);
}

// Room for n floats: on the stack up to N, else on the heap.
template <int64_t N>
class Room {
 public:
  explicit Room(int64_t n) : heap_(n > N ? n : 0) {}
  float* data() { return heap_.empty() ? stack_ : heap_.data(); }

 private:
  float stack_[N];
  std::vector<float> heap_;
};
using Scores = Room<1024>;  // one query's scores, a float a key
using Query = Room<256>;    // one head's query, when the kernel adds its bias

struct SelfWork {
  const float* qkv;
  float *k, *v, *out;
  const int32_t* filled;
  int64_t heads, slots, dim;
  const int32_t* origin;  // (B, slots) or null: DecodeBeamSelfAttention's
  const uint8_t* borrows;  // (B,) with origin: whether a row reads a slot of another row (else it reads its own)
  const float* negated_bias;  // (3·H·Dh) or null: subtracted from each row of qkv as it is read
  int64_t prefetched;  // items (rows × heads) whose keys are asked for ahead: all or none (outgrows_cache)
};

// x less the negated bias (null: x itself), n floats: the bias add of the graph's Sub that the kernel reads
// through (kernel_graphs.with_row_quantize), in the same arithmetic. Into `own` when there is a bias.
inline const float* biased(const float* x, const float* negated_bias, int64_t n, float* own) {
  if (!negated_bias) return x;
  for (int64_t i = 0; i < n; i++) own[i] = x[i] - negated_bias[i];
  return own;
}


// One row and head of DecodeSelfAttention: its new key and value into the slot after its filled ones,
// then attention over all of them. A row whose slot is outside the cache (a hole of the server's
// batch, never read) gets zeros.
void self_row_head(void* data, size_t item) {
  const auto& w = *static_cast<SelfWork*>(data);
  const int64_t b = item / w.heads, h = item % w.heads, slot = w.filled[b];
  float* out = w.out + item * w.dim;
  const int64_t ahead = item + PREFETCH_AHEAD, ahead_b = ahead / w.heads;
  if (ahead < w.prefetched) {
    const int64_t n = std::min<int64_t>(w.filled[ahead_b], w.slots);  // the slots it has filled (it writes the next)
    prefetch_keys(w.k + ahead * w.slots * w.dim, w.v + ahead * w.slots * w.dim, n, w.dim,
                  w.origin && w.borrows[ahead_b] ? w.origin + ahead_b * w.slots : nullptr, ahead_b,
                  w.heads * w.slots * w.dim);
  }
  if (slot < 0 || slot >= w.slots) {
    std::memset(out, 0, sizeof(float) * w.dim);
    return;
  }
  const int64_t width = 3 * w.heads * w.dim;  // q of every head, then k, then v
  const float* row = w.qkv + b * width;
  const float* bias = w.negated_bias;
  float* k = w.k + item * w.slots * w.dim;
  float* v = w.v + item * w.slots * w.dim;
  const int64_t at_q = h * w.dim, at_k = (w.heads + h) * w.dim, at_v = (2 * w.heads + h) * w.dim;
  Query q(w.dim);
  if (bias) {
    biased(row + at_k, bias + at_k, w.dim, k + slot * w.dim);
    biased(row + at_v, bias + at_v, w.dim, v + slot * w.dim);
  } else {
    std::memcpy(k + slot * w.dim, row + at_k, sizeof(float) * w.dim);
    std::memcpy(v + slot * w.dim, row + at_v, sizeof(float) * w.dim);
  }
  Scores p(slot + 1);
  attend(biased(row + at_q, bias ? bias + at_q : nullptr, w.dim, q.data()), k, v, slot + 1, w.dim, p.data(), out,
         w.origin && w.borrows[b] ? w.origin + b * w.slots : nullptr, b, w.heads * w.slots * w.dim);
}

// GroupQueryAttention's decoding case as nmtserve's graphs use it: qkv (B, 1, 3·H·Dh) packed, the
// caches (B, H, C, Dh), filled (B,) int32 (GroupQueryAttention's seqlens_k). present_k/v are the caches
// written in place when bound to the same buffers (the runtime binds them so), else a copy. qkv may also be
// (B, 3·H·Dh), and then out is (B, H·Dh) (kernel_graphs.with_custom_kernels drops the Unsqueeze before the node and
// the Gather after it); with negated_bias (3·H·Dh) qkv is the projection before its bias, which the kernel
// subtracts as it reads (the Sub that kernel_graphs.with_row_quantize makes of an int8 graph's bias Add).
using OptionalFloats = std::optional<const Ort::Custom::Tensor<float>*>;

Ort::Status self_attention(OrtKernelContext* context, const char* op, const Ort::Custom::Tensor<float>& qkv,
                           const Ort::Custom::Tensor<float>& past_k, const Ort::Custom::Tensor<float>& past_v,
                           const Ort::Custom::Tensor<int32_t>& filled, const int32_t* origin,
                           const uint8_t* borrows, const OptionalFloats& negated_bias, Ort::Custom::Tensor<float>& out,
                           Ort::Custom::Tensor<float>& present_k, Ort::Custom::Tensor<float>& present_v) {
  const std::vector<int64_t> shape = past_k.Shape(), qkv_shape = qkv.Shape();
  const std::string error = std::string(op) + ": qkv must be (B, 1, 3·H·Dh) or (B, 3·H·Dh), the caches (B, H, C, "
                            "Dh), filled (B,) and a bias (3·H·Dh)";
  if (shape.size() != 4) return Ort::Status(error.c_str(), ORT_INVALID_ARGUMENT);
  const int64_t rows = shape[0], heads = shape[1], slots = shape[2], dim = shape[3];
  const bool flat = qkv_shape.size() == 2;
  if (past_v.Shape() != shape || filled.NumberOfElement() != rows ||
      qkv_shape != (flat ? std::vector<int64_t>{rows, 3 * heads * dim} : std::vector<int64_t>{rows, 1, 3 * heads * dim}) ||
      (negated_bias && (*negated_bias)->NumberOfElement() != 3 * heads * dim))
    return Ort::Status(error.c_str(), ORT_INVALID_ARGUMENT);
  SelfWork w{qkv.Data(), present_k.Allocate(shape), present_v.Allocate(shape),
             out.Allocate(flat ? std::vector<int64_t>{rows, heads * dim} : std::vector<int64_t>{rows, 1, heads * dim}),
             filled.Data(), heads, slots, dim, origin, borrows, negated_bias ? (*negated_bias)->Data() : nullptr,
             outgrows_cache(read_bytes(filled.Data(), rows, slots, heads * dim)) ? rows * heads : 0};
  const size_t bytes = sizeof(float) * rows * heads * slots * dim;
  if (w.k != past_k.Data()) std::memcpy(w.k, past_k.Data(), bytes);
  if (w.v != past_v.Data()) std::memcpy(w.v, past_v.Data(), bytes);
  Ort::KernelContext(context).ParallelFor(self_row_head, rows * heads, 0, &w);
  return Ort::Status{nullptr};
}

Ort::Status DecodeSelfAttention(OrtKernelContext* context, const Ort::Custom::Tensor<float>& qkv,
                                const Ort::Custom::Tensor<float>& past_k, const Ort::Custom::Tensor<float>& past_v,
                                const Ort::Custom::Tensor<int32_t>& filled, OptionalFloats negated_bias,
                                Ort::Custom::Tensor<float>& out, Ort::Custom::Tensor<float>& present_k,
                                Ort::Custom::Tensor<float>& present_v) {
  return self_attention(context, "DecodeSelfAttention", qkv, past_k, past_v, filled, nullptr, nullptr, negated_bias,
                        out, present_k, present_v);
}

// DecodeSelfAttention whose slots may lie in other rows: origin (B, slots) int32, the row whose cache holds
// slot t of row b's history (a beam's rows share the slots of their common past, so choosing a parent
// row copies a row of origin, not of the cache: OnnxTranslator's offline step). Slot filled[b], written
// by the step, is row b's own (origin[b, filled[b]] = b). An origin of another shape, or one that names a
// row outside the batch in a slot the step reads, is an error of the run (never a read outside the cache). A row
// whose slots are all its own (a greedy or sampled row, a beam row that never took another's past) reads them as
// DecodeSelfAttention does, without looking its slots up.
Ort::Status DecodeBeamSelfAttention(OrtKernelContext* context, const Ort::Custom::Tensor<float>& qkv,
                                    const Ort::Custom::Tensor<float>& past_k, const Ort::Custom::Tensor<float>& past_v,
                                    const Ort::Custom::Tensor<int32_t>& filled,
                                    const Ort::Custom::Tensor<int32_t>& origin, OptionalFloats negated_bias,
                                    Ort::Custom::Tensor<float>& out, Ort::Custom::Tensor<float>& present_k,
                                    Ort::Custom::Tensor<float>& present_v) {
  const std::vector<int64_t> shape = past_k.Shape(), origin_shape = origin.Shape();
  if (shape.size() != 4 || origin_shape != std::vector<int64_t>{shape[0], shape[2]} ||
      filled.NumberOfElement() != shape[0])
    return Ort::Status("DecodeBeamSelfAttention: origin must be (rows, slots) of the cache, filled (rows,)",
                       ORT_INVALID_ARGUMENT);
  const int32_t* rows = origin.Data();
  std::vector<uint8_t> borrows(shape[0]);
  for (int64_t b = 0; b < shape[0]; b++) {
    const int32_t* read = rows + b * shape[2];  // the slots row b attends to: 0..filled[b]
    const int64_t n = std::min<int64_t>(std::max<int32_t>(filled.Data()[b] + 1, 0), shape[2]);
    bool own = true;
    for (int64_t t = 0; t < n; t++) {
      if (read[t] < 0 || read[t] >= shape[0])
        return Ort::Status("DecodeBeamSelfAttention: origin names a row outside the batch", ORT_INVALID_ARGUMENT);
      own &= read[t] == b;
    }
    borrows[b] = !own;
  }
  return self_attention(context, "DecodeBeamSelfAttention", qkv, past_k, past_v, filled, rows, borrows.data(),
                        negated_bias, out, present_k, present_v);
}

struct CrossWork {
  const float *q, *k, *v;
  float* out;
  const int32_t* lengths;
  int64_t width, heads, keys, dim;
  const float* negated_bias;  // (H·Dh) or null
  int64_t prefetched;  // items (sources × width × heads) as SelfWork's
};

void cross_row_head(void* data, size_t item) {  // item: (source, query of it, head)
  const auto& w = *static_cast<CrossWork*>(data);
  const int64_t s = item / (w.width * w.heads), h = item % w.heads;
  const int64_t n = std::min<int64_t>(std::max<int32_t>(w.lengths[s], 0), w.keys);
  const int64_t kv = (s * w.heads + h) * w.keys * w.dim;
  const int64_t ahead = item + PREFETCH_AHEAD, ahead_s = ahead / (w.width * w.heads);
  if (ahead < w.prefetched && (ahead_s != s || ahead % w.heads != h)) {  // a beam's queries share their source's keys
    const int64_t at = (ahead_s * w.heads + ahead % w.heads) * w.keys * w.dim;
    prefetch_keys(w.k + at, w.v + at, std::min<int64_t>(std::max<int32_t>(w.lengths[ahead_s], 0), w.keys), w.dim);
  }
  Scores p(n);
  Query q(w.dim);
  attend(biased(w.q + item * w.dim, w.negated_bias ? w.negated_bias + h * w.dim : nullptr, w.dim, q.data()),
         w.k + kv, w.v + kv, n, w.dim, p.data(), w.out + item * w.dim);
}

// MultiHeadAttention's case in nmtserve's offline step: each source's W queries q (Bs, W, H·Dh) over its
// one copy of the cross K/V (Bs, H, S, Dh), the first lengths[s] keys of it; with negated_bias (H·Dh), q is the
// projection before its bias (as DecodeSelfAttention's). q may also be the step's rows (Bs·W, H·Dh), a source's W
// rows one after another, and then out is (Bs·W, H·Dh) (kernel_graphs.with_custom_kernels drops the Reshapes around the
// node).
Ort::Status DecodeCrossAttention(OrtKernelContext* context, const Ort::Custom::Tensor<float>& q,
                                 const Ort::Custom::Tensor<float>& k, const Ort::Custom::Tensor<float>& v,
                                 const Ort::Custom::Tensor<int32_t>& lengths, OptionalFloats negated_bias,
                                 Ort::Custom::Tensor<float>& out) {
  const std::vector<int64_t> qs = q.Shape(), ks = k.Shape();
  const bool flat = qs.size() == 2;
  if ((qs.size() != 3 && !flat) || ks.size() != 4 || v.Shape() != ks ||
      (flat ? (ks[0] > 0 ? qs[0] % ks[0] != 0 : qs[0] != 0) : ks[0] != qs[0]) || qs.back() != ks[1] * ks[3] ||
      lengths.NumberOfElement() != ks[0] || (negated_bias && (*negated_bias)->NumberOfElement() != qs.back()))
    return Ort::Status("DecodeCrossAttention: q must be (Bs, W, H·Dh) or (Bs·W, H·Dh), k and v (Bs, H, S, Dh), "
                       "lengths (Bs,) and a bias (H·Dh)", ORT_INVALID_ARGUMENT);
  const int64_t sources = ks[0], heads = ks[1], keys = ks[2], dim = ks[3];
  const int64_t width = !flat ? qs[1] : sources > 0 ? qs[0] / sources : 0;
  CrossWork w{q.Data(), k.Data(), v.Data(), out.Allocate(qs), lengths.Data(),
              width, heads, keys, dim, negated_bias ? (*negated_bias)->Data() : nullptr,
              outgrows_cache(read_bytes(lengths.Data(), sources, keys, heads * dim)) ? sources * width * heads : 0};
  Ort::KernelContext(context).ParallelFor(cross_row_head, sources * width * heads, 0, &w);
  return Ort::Status{nullptr};
}

struct EncodeWork {
  const float *q, *k, *v;
  float* out;
  const int64_t* first;  // (B + 1): sentence b's tokens are the packed rows first[b] .. first[b + 1] - 1
  int64_t heads, dim;    // dim: of a head
};

// One sentence and head of EncodeSelfAttention: its keys and values copied into rows of their own (a packed
// row holds every head of its token), then each of its queries attends to all of them.
void sentence_head(void* data, size_t item) {
  const auto& w = *static_cast<EncodeWork*>(data);
  const int64_t b = item / w.heads, h = item % w.heads, first = w.first[b], n = w.first[b + 1] - first;
  const int64_t width = w.heads * w.dim, at = first * width + h * w.dim;
  std::vector<float> kv(2 * n * w.dim);
  float *k = kv.data(), *v = kv.data() + n * w.dim;
  for (int64_t t = 0; t < n; t++) {
    std::memcpy(k + t * w.dim, w.k + at + t * width, sizeof(float) * w.dim);
    std::memcpy(v + t * w.dim, w.v + at + t * width, sizeof(float) * w.dim);
  }
  Scores p(n);
  for (int64_t i = 0; i < n; i++) attend(w.q + at + i * width, k, v, n, w.dim, p.data(), w.out + at + i * width);
}

// The encoder's self-attention over packed tokens: q, k and v (1, T, H·Dh) hold the batch's T real tokens one
// after another, sentence by sentence (the order of NonZero over src_mask), and each sentence's queries attend
// to its own keys; src_mask (B, L) says how many tokens each sentence has, heads (1,) is H. It stands for the
// exported graph's Gathers into a padded (B, L, H·Dh), ONNX Runtime's MultiHeadAttention with src_mask as the
// key padding mask, and the Gather that packs its output again (kernel_graphs.with_packed_attention).
Ort::Status EncodeSelfAttention(OrtKernelContext* context, const Ort::Custom::Tensor<float>& q,
                                const Ort::Custom::Tensor<float>& k, const Ort::Custom::Tensor<float>& v,
                                const Ort::Custom::Tensor<bool>& mask, const Ort::Custom::Tensor<int64_t>& heads,
                                Ort::Custom::Tensor<float>& out) {
  const std::vector<int64_t> qs = q.Shape(), ms = mask.Shape();
  if (qs.size() != 3 || ms.size() != 2 || heads.NumberOfElement() != 1 || heads.Data()[0] <= 0 ||
      qs[2] % heads.Data()[0] != 0 || k.Shape() != qs || v.Shape() != qs)
    return Ort::Status("EncodeSelfAttention: q, k and v must be (1, T, H·Dh) alike, src_mask (B, L), heads (1,)",
                       ORT_INVALID_ARGUMENT);
  const int64_t sentences = ms[0], length = ms[1], tokens = qs[0] * qs[1], h = heads.Data()[0];
  std::vector<int64_t> first(sentences + 1, 0);
  const bool* m = mask.Data();
  for (int64_t b = 0; b < sentences; b++)
    first[b + 1] = first[b] + std::count(m + b * length, m + (b + 1) * length, true);
  if (first[sentences] != tokens)
    return Ort::Status("EncodeSelfAttention: src_mask's tokens are not the packed rows of q", ORT_INVALID_ARGUMENT);
  EncodeWork w{q.Data(), k.Data(), v.Data(), out.Allocate(qs), first.data(), h, qs[2] / h};
  Ort::KernelContext(context).ParallelFor(sentence_head, sentences * h, 0, &w);
  return Ort::Status{nullptr};
}

struct HeadsWork {
  const float* x;
  const int64_t* index;
  float* out;
  int64_t tokens, length, heads, dim;  // dim: of a head
};

void sentence_to_heads(void* data, size_t b) {  // sentence b's L slots of every head
  const auto& w = *static_cast<HeadsWork*>(data);
  for (int64_t h = 0; h < w.heads; h++)
    for (int64_t l = 0; l < w.length; l++)
      std::memcpy(w.out + ((b * w.heads + h) * w.length + l) * w.dim,
                  w.x + w.index[b * w.length + l] * w.heads * w.dim + h * w.dim, sizeof(float) * w.dim);
}

// The encoder's cross K or V for the decoder, (B, H, L, Dh), from the packed rows x (1, T, H·Dh): slot l of
// sentence b is row index[b·L + l] (the exported graph's Gather indices, which give padded slots a real row
// too). It stands for that Gather, two Reshapes and the Transpose into heads (kernel_graphs.with_packed_attention);
// src_mask (B, L) gives the shape, heads (1,) is H. An index outside the rows is an error, never a read.
Ort::Status PackedToHeads(OrtKernelContext* context, const Ort::Custom::Tensor<float>& x,
                          const Ort::Custom::Tensor<int64_t>& index, const Ort::Custom::Tensor<bool>& mask,
                          const Ort::Custom::Tensor<int64_t>& heads, Ort::Custom::Tensor<float>& out) {
  const std::vector<int64_t> xs = x.Shape(), ms = mask.Shape();
  if (xs.size() != 3 || xs[0] != 1 || ms.size() != 2 || heads.NumberOfElement() != 1 || heads.Data()[0] <= 0 ||
      xs[2] % heads.Data()[0] != 0 || index.NumberOfElement() != ms[0] * ms[1])
    return Ort::Status("PackedToHeads: x must be (1, T, H·Dh), index (B·L,) for src_mask (B, L), heads (1,)",
                       ORT_INVALID_ARGUMENT);
  const int64_t h = heads.Data()[0];
  const int64_t* index_data = index.Data();
  for (int64_t i = 0; i < index.NumberOfElement(); i++)
    if (index_data[i] < 0 || index_data[i] >= xs[1])
      return Ort::Status("PackedToHeads: an index is outside the packed rows", ORT_INVALID_ARGUMENT);
  HeadsWork w{x.Data(), index_data, out.Allocate({ms[0], h, ms[1], xs[2] / h}), xs[1], ms[1], h, xs[2] / h};
  Ort::KernelContext(context).ParallelFor(sentence_to_heads, ms[0], 0, &w);
  return Ort::Status{nullptr};
}

// One row of SearchHead: its k best values (k <= n), best first, ties by lower index, by insertion into a
// sorted list. A block of 64 values whose maximum does not beat the k-th best is passed over after eight
// vector maxima (GCC's vector extension); many (k > 64: OnnxTranslator.step's whole vocabulary, ranked) by
// a partial sort of the indices.
typedef float Floats8 __attribute__((vector_size(32)));

inline float block_max(const float* x) {  // of x[0..63]
  Floats8 top, v;
  std::memcpy(&top, x, sizeof top);
  for (int i = 8; i < 64; i += 8) {
    std::memcpy(&v, x + i, sizeof v);
    top = v > top ? v : top;
  }
  float best = top[0];
  for (int i = 1; i < 8; i++) best = top[i] > best ? top[i] : best;
  return best;
}

CLONED
void best_of_row(const float* x, int64_t n, int64_t k, float* values, int64_t* ids) {
  if (k > 64) {
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; i++) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    for (int64_t j = 0; j < k; j++) values[j] = x[ids[j] = order[j]];
    return;
  }
  int64_t m = 0;
  float least = -INFINITY;  // the k-th best so far, once there are k
  for (int64_t start = 0; start < n; start += 64) {
    const int64_t stop = std::min(n, start + 64);
    if (m == k && stop - start == 64 && !(block_max(x + start) > least)) continue;
    for (int64_t i = start; i < stop; i++) {
      const float xi = x[i];
      if (m == k) {
        if (!(xi > least)) continue;
        m--;
      }
      int64_t j = m++;
      for (; j > 0 && xi > values[j - 1]; j--) {
        values[j] = values[j - 1];
        ids[j] = ids[j - 1];
      }
      values[j] = xi;
      ids[j] = i;
      least = values[m - 1];
    }
  }
}

// log(sum(exp(x - top))) over a row, top its maximum.
CLONED
float log_sum_exp_below(const float* x, int64_t n, float top) {
  float total = 0.f;
  for (int64_t i = 0; i < n; i++) total += exp_nonpositive(x[i] - top);
  return std::log(total);
}

struct HeadWork {
  const float* logits;
  float* values;
  int64_t* ids;
  int64_t vocab, k;
  bool scores;
  const float* row_scale;  // (rows,) or null: logits[r, j] * row_scale[r] (+ bias[j]) are the logits
  const float* bias;  // (vocab,) or null
  const int64_t* whole_of_row;  // (rows,): the row's place among whole_rows, or -1
  float* whole;  // (whole rows, vocab): their logits
};

// x * scale + bias (bias may be null) into out.
CLONED
void scale_row(const float* x, float scale, const float* bias, int64_t n, float* out) {
  if (bias) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale + bias[i];
  } else {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale;
  }
}

void head_row(void* data, size_t row) {
  const auto& w = *static_cast<HeadWork*>(data);
  const float* x = w.logits + row * w.vocab;
  if (w.row_scale || w.bias) {  // the row's logits, finished here: one pass over a row that stays in cache
    thread_local std::vector<float> scaled;
    scaled.resize(w.vocab);
    scale_row(x, w.row_scale ? w.row_scale[row] : 1.f, w.bias, w.vocab, scaled.data());
    x = scaled.data();
  }
  float* values = w.values + row * w.k;
  if (w.k > 0) best_of_row(x, w.vocab, w.k, values, w.ids + row * w.k);
  float* whole = w.whole_of_row[row] < 0 ? nullptr : w.whole + w.whole_of_row[row] * w.vocab;
  if (w.scores && w.k > 0) {
    const float shift = values[0] + log_sum_exp_below(x, w.vocab, values[0]);
    for (int64_t j = 0; j < w.k; j++) values[j] -= shift;
  }
  if (whole) std::memcpy(whole, x, w.vocab * sizeof(float));
}

// The step's search head (step_graphs.with_search_head: LogSoftmax then TopK, or without scores the
// best by the values before it) in one pass over each row's logits (B, V): candidate_scores and
// candidate_ids (B, K), K = min(candidates, V), best first, ties by lower id; with_scores:
// log-softmax values (logit - max - log(sum(exp(logit - max)))), else the logits themselves; and
// whole_logits (R, V), the logits over the whole vocabulary of the rows whole_rows (R,) names (rows whose
// search ranks the vocabulary itself, among rows that need K). With row_scale (B, 1) and bias (V,) (int8 scales per
// row: kernel_graphs.with_row_quantize), the logits are logits * row_scale + bias: the output projection's last
// scaling and its bias, applied here instead of in two passes over the whole (B, V) output.
Ort::Status SearchHead(OrtKernelContext* context, const Ort::Custom::Tensor<float>& logits,
                       const Ort::Custom::Tensor<int64_t>& candidates, const Ort::Custom::Tensor<bool>& with_scores,
                       const Ort::Custom::Tensor<int64_t>& whole_rows,
                       std::optional<const Ort::Custom::Tensor<float>*> row_scale,
                       std::optional<const Ort::Custom::Tensor<float>*> bias,
                       Ort::Custom::Tensor<float>& candidate_scores, Ort::Custom::Tensor<int64_t>& candidate_ids,
                       Ort::Custom::Tensor<float>& whole_logits) {
  const std::vector<int64_t> shape = logits.Shape();
  const int64_t rows = shape[0], vocab = shape[1], wholes = whole_rows.NumberOfElement();
  const bool scaled = row_scale.has_value() && *row_scale != nullptr, biased = bias.has_value() && *bias != nullptr;
  if (scaled && (*row_scale)->NumberOfElement() != rows)
    return Ort::Status("SearchHead: row_scale must have one value a row", ORT_INVALID_ARGUMENT);
  if (biased && (*bias)->NumberOfElement() != vocab)
    return Ort::Status("SearchHead: bias must have one value a logit", ORT_INVALID_ARGUMENT);
  std::vector<int64_t> whole_of_row(rows, -1);
  for (int64_t i = 0; i < wholes; i++) {
    const int64_t row = whole_rows.Data()[i];
    if (row < 0 || row >= rows || whole_of_row[row] >= 0)
      return Ort::Status("SearchHead: whole_rows must name distinct rows of the batch", ORT_INVALID_ARGUMENT);
    whole_of_row[row] = i;
  }
  const int64_t k = std::max<int64_t>(0, std::min(candidates.Data()[0], vocab));
  HeadWork w{logits.Data(), candidate_scores.Allocate({rows, k}), candidate_ids.Allocate({rows, k}), vocab, k,
             with_scores.Data()[0], scaled ? (*row_scale)->Data() : nullptr, biased ? (*bias)->Data() : nullptr,
             whole_of_row.data(), whole_logits.Allocate({wholes, vocab})};
  if (k > 0 || wholes > 0) Ort::KernelContext(context).ParallelFor(head_row, rows, 0, &w);
  return Ort::Status{nullptr};
}

// One row of RowQuantize: q = round(x / scale) + zero point (ties to even), scale = max |x| / 127 with zero
// point 128 (symmetric: 1..255), or max x / 255 with zero point 0 for a row that cannot be negative (a
// Relu's output; a negative value would clamp to 0). A row of zeros gets scale 1 (all zero points).
CLONED
void quantize_row(const float* x, uint8_t* q, float* scale, int64_t k, bool nonnegative) {
  Floats8 top8 = {}, v;
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    std::memcpy(&v, x + i, sizeof v);
    v = v < 0.f ? -v : v;
    top8 = v > top8 ? v : top8;
  }
  float top = 0.f;
  for (int j = 0; j < 8; j++) top = top8[j] > top ? top8[j] : top;
  for (; i < k; i++) top = std::fabs(x[i]) > top ? std::fabs(x[i]) : top;
  const float levels = nonnegative ? 255.f : 127.f;
  *scale = top > 0.f ? top / levels : 1.f;
  const float inverse = top > 0.f ? levels / top : 1.f;
  if (nonnegative) {
    for (int64_t j = 0; j < k; j++) q[j] = static_cast<uint8_t>(std::rint(std::max(x[j], 0.f) * inverse));
  } else {
    for (int64_t j = 0; j < k; j++) q[j] = static_cast<uint8_t>(static_cast<int32_t>(std::rint(x[j] * inverse)) + 128);
  }
}

// DynamicQuantizeLinear with a scale per row instead of one for the whole tensor: x (..., K) float ->
// q (..., K) uint8 and scale (..., 1), each row over its last axis. zero_point (a uint8 scalar, 128 or 0)
// is the one the MatMulInteger after it reads (kernel_graphs.with_row_quantize). ONNX Runtime's
// MatMulIntegerToFloat, fused from MatMulInteger and the Mul of the two scales, multiplies each output
// row by its own scale, and its integer product of a row involves that row alone: int8 results are
// the same in any batch.
Ort::Status RowQuantize(const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& zero_point,
                        Ort::Custom::Tensor<uint8_t>& q, Ort::Custom::Tensor<float>& scale) {
  if (zero_point.NumberOfElement() != 1 || (zero_point.Data()[0] != 0 && zero_point.Data()[0] != 128))
    return Ort::Status("RowQuantize: zero_point must be one value, 128 or 0", ORT_INVALID_ARGUMENT);
  const uint8_t zp = zero_point.Data()[0];
  const std::vector<int64_t> shape = x.Shape();
  std::vector<int64_t> scale_shape = shape;
  scale_shape.back() = 1;
  const int64_t k = shape.back(), rows = k > 0 ? x.NumberOfElement() / k : 0;
  const float* in = x.Data();
  uint8_t* out = q.Allocate(shape);
  float* scales = scale.Allocate(scale_shape);
  for (int64_t r = 0; r < rows; r++) quantize_row(in + r * k, out + r * k, scales + r, k, zp == 0);
  return Ort::Status{nullptr};
}

// After a row-scaled int8 product (kernel_graphs.with_row_quantize's epilogues): y = product * row_scale -
// negated_bias, the product's last scaling and its bias (the graph's Sub of the negated bias).
// AddNormQuantize: x = y + residual, normed = LayerNormalization(x) over the last axis (gamma, beta,
// epsilon; mean and variance in two passes), then normed quantised as RowQuantize does around 128: the
// Sub, Add, LayerNormalization and RowQuantize of a post-norm sublayer's end in one node. normed is an
// output too: the next sublayer's residual.
CLONED
void add_norm_row(const float* product, float row_scale, const float* negated_bias, const float* residual,
                  const float* gamma, const float* beta, float epsilon, int64_t n, float* normed) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; i++) {
    normed[i] = product[i] * row_scale - negated_bias[i] + residual[i];
    sum += normed[i];
  }
  const float mean = sum / n;
  float squares = 0.f;
  for (int64_t i = 0; i < n; i++) squares += (normed[i] - mean) * (normed[i] - mean);
  const float inverse = 1.f / std::sqrt(squares / n + epsilon);
  for (int64_t i = 0; i < n; i++) normed[i] = (normed[i] - mean) * inverse * gamma[i] + beta[i];
}

Ort::Status AddNormQuantize(const Ort::Custom::Tensor<float>& product, const Ort::Custom::Tensor<float>& row_scale,
                            const Ort::Custom::Tensor<float>& negated_bias, const Ort::Custom::Tensor<float>& residual,
                            const Ort::Custom::Tensor<float>& gamma, const Ort::Custom::Tensor<float>& beta,
                            const Ort::Custom::Tensor<float>& epsilon, Ort::Custom::Tensor<float>& normed,
                            Ort::Custom::Tensor<uint8_t>& q, Ort::Custom::Tensor<float>& scale) {
  const std::vector<int64_t> shape = product.Shape();
  const int64_t n = shape.back(), rows = n > 0 ? product.NumberOfElement() / n : 0;
  if (residual.NumberOfElement() != product.NumberOfElement() || row_scale.NumberOfElement() != rows
      || negated_bias.NumberOfElement() != n || gamma.NumberOfElement() != n || beta.NumberOfElement() != n
      || epsilon.NumberOfElement() != 1)
    return Ort::Status("AddNormQuantize: residual must match product, row_scale have one value a row, "
                       "negated_bias, gamma and beta one a column, epsilon one", ORT_INVALID_ARGUMENT);
  std::vector<int64_t> scale_shape = shape;
  scale_shape.back() = 1;
  float* out = normed.Allocate(shape);
  uint8_t* quantized = q.Allocate(shape);
  float* scales = scale.Allocate(scale_shape);
  for (int64_t r = 0; r < rows; r++) {
    add_norm_row(product.Data() + r * n, row_scale.Data()[r], negated_bias.Data(), residual.Data() + r * n,
                 gamma.Data(), beta.Data(), epsilon.Data()[0], n, out + r * n);
    quantize_row(out + r * n, quantized + r * n, scales + r, n, false);
  }
  return Ort::Status{nullptr};
}

// BiasReluQuantize: Relu(y) quantised as RowQuantize does from 0: the Sub, Relu and RowQuantize between a
// feed-forward block's two products in one node. BiasSwishQuantize: y · sigmoid(y) (Marian's swish, which ONNX
// Runtime would fuse as QuickGelu) quantised around 128: the Sub, Sigmoid, Mul and RowQuantize.
CLONED
void bias_relu_row(const float* product, float row_scale, const float* negated_bias, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i++) out[i] = std::max(product[i] * row_scale - negated_bias[i], 0.f);
}

CLONED
void bias_swish_row(const float* product, float row_scale, const float* negated_bias, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i++) {
    const float y = product[i] * row_scale - negated_bias[i];
    const float e = exp_nonpositive(-std::fabs(y));  // sigmoid(y) from exp(-|y|): no overflow on either side
    out[i] = y * (y >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
  }
}

// y = product * row_scale - negated_bias, activated a row at a time by `activate`, quantised (from 0 when the
// activation cannot be negative).
Ort::Status bias_activation_quantize(const char* op, void (*activate)(const float*, float, const float*, int64_t, float*),
                                     bool nonnegative, const Ort::Custom::Tensor<float>& product,
                                     const Ort::Custom::Tensor<float>& row_scale,
                                     const Ort::Custom::Tensor<float>& negated_bias, Ort::Custom::Tensor<uint8_t>& q,
                                     Ort::Custom::Tensor<float>& scale) {
  const std::vector<int64_t> shape = product.Shape();
  const int64_t n = shape.back(), rows = n > 0 ? product.NumberOfElement() / n : 0;
  if (row_scale.NumberOfElement() != rows || negated_bias.NumberOfElement() != n)
    return Ort::Status((std::string(op) + ": row_scale must have one value a row, negated_bias one a column").c_str(),
                       ORT_INVALID_ARGUMENT);
  std::vector<int64_t> scale_shape = shape;
  scale_shape.back() = 1;
  uint8_t* quantized = q.Allocate(shape);
  float* scales = scale.Allocate(scale_shape);
  thread_local std::vector<float> row;
  row.resize(n);
  for (int64_t r = 0; r < rows; r++) {
    activate(product.Data() + r * n, row_scale.Data()[r], negated_bias.Data(), n, row.data());
    quantize_row(row.data(), quantized + r * n, scales + r, n, nonnegative);
  }
  return Ort::Status{nullptr};
}

Ort::Status BiasReluQuantize(const Ort::Custom::Tensor<float>& product, const Ort::Custom::Tensor<float>& row_scale,
                             const Ort::Custom::Tensor<float>& negated_bias, Ort::Custom::Tensor<uint8_t>& q,
                             Ort::Custom::Tensor<float>& scale) {
  return bias_activation_quantize("BiasReluQuantize", bias_relu_row, true, product, row_scale, negated_bias, q, scale);
}

Ort::Status BiasSwishQuantize(const Ort::Custom::Tensor<float>& product, const Ort::Custom::Tensor<float>& row_scale,
                              const Ort::Custom::Tensor<float>& negated_bias, Ort::Custom::Tensor<uint8_t>& q,
                              Ort::Custom::Tensor<float>& scale) {
  return bias_activation_quantize("BiasSwishQuantize", bias_swish_row, false, product, row_scale, negated_bias, q,
                                  scale);
}

// Embed: a decoder step's input rows, table[tokens] · scale + position_table[positions], tokens and positions (R,)
// int64: the exported step's two Gathers, Mul and Add in one node (kernel_graphs.with_custom_kernels), in the same
// arithmetic (a product, then a sum). Without scale (a model that does not scale its embedding) the sum alone. An id
// outside its table is an error of the run, as Gather's.
CLONED __attribute__((optimize("fp-contract=off")))  // a product, then a sum: no fused multiply-add
void embed_row(const float* embedding, const float* scale, const float* position, int64_t n, float* out) {
  if (scale) {
    const float by = *scale;
    for (int64_t i = 0; i < n; i++) out[i] = embedding[i] * by + position[i];
  } else {
    for (int64_t i = 0; i < n; i++) out[i] = embedding[i] + position[i];
  }
}

Ort::Status Embed(const Ort::Custom::Tensor<float>& table, const Ort::Custom::Tensor<int64_t>& tokens,
                  const Ort::Custom::Tensor<float>& position_table, const Ort::Custom::Tensor<int64_t>& positions,
                  OptionalFloats scale, Ort::Custom::Tensor<float>& out) {
  const std::vector<int64_t> ts = table.Shape(), ps = position_table.Shape(), ids = tokens.Shape();
  if (ts.size() != 2 || ps.size() != 2 || ps[1] != ts[1] || ids.size() != 1 || positions.Shape() != ids ||
      (scale && (*scale)->NumberOfElement() != 1))
    return Ort::Status("Embed: table (V, D), tokens (R,), position_table (P, D), positions (R,) and one scale",
                       ORT_INVALID_ARGUMENT);
  const int64_t rows = ids[0], n = ts[1];
  const int64_t *token = tokens.Data(), *position = positions.Data();
  for (int64_t r = 0; r < rows; r++)
    if (token[r] < 0 || token[r] >= ts[0] || position[r] < 0 || position[r] >= ps[0])
      return Ort::Status(("Embed: row " + std::to_string(r) + "'s token " + std::to_string(token[r]) + " or position " +
                          std::to_string(position[r]) + " is outside its table").c_str(), ORT_INVALID_ARGUMENT);
  float* x = out.Allocate({rows, n});
  for (int64_t r = 0; r < rows; r++)
    embed_row(table.Data() + token[r] * n, scale ? (*scale)->Data() : nullptr, position_table.Data() + position[r] * n,
              n, x + r * n);
  return Ort::Status{nullptr};
}

const OrtApiBase* registered_api = nullptr;  // ONNX Runtime's, from the first RegisterCustomOps (below)

}  // namespace

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // an ONNX Runtime older than these headers: the ops stay unknown
  Ort::InitApi(api);
  registered_api = api_base;
  static Ort::CustomOpDomain domain{"nmtserve"};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> self_op{
      Ort::Custom::CreateLiteCustomOp("DecodeSelfAttention", "CPUExecutionProvider", DecodeSelfAttention)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> cross_op{
      Ort::Custom::CreateLiteCustomOp("DecodeCrossAttention", "CPUExecutionProvider", DecodeCrossAttention)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> beam_op{
      Ort::Custom::CreateLiteCustomOp("DecodeBeamSelfAttention", "CPUExecutionProvider", DecodeBeamSelfAttention)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> head_op{
      Ort::Custom::CreateLiteCustomOp("SearchHead", "CPUExecutionProvider", SearchHead)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> quantize_op{
      Ort::Custom::CreateLiteCustomOp("RowQuantize", "CPUExecutionProvider", RowQuantize)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> norm_op{
      Ort::Custom::CreateLiteCustomOp("AddNormQuantize", "CPUExecutionProvider", AddNormQuantize)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> relu_op{
      Ort::Custom::CreateLiteCustomOp("BiasReluQuantize", "CPUExecutionProvider", BiasReluQuantize)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> swish_op{
      Ort::Custom::CreateLiteCustomOp("BiasSwishQuantize", "CPUExecutionProvider", BiasSwishQuantize)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> encode_op{
      Ort::Custom::CreateLiteCustomOp("EncodeSelfAttention", "CPUExecutionProvider", EncodeSelfAttention)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> heads_op{
      Ort::Custom::CreateLiteCustomOp("PackedToHeads", "CPUExecutionProvider", PackedToHeads)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> embed_op{
      Ort::Custom::CreateLiteCustomOp("Embed", "CPUExecutionProvider", Embed)};
  static const bool added = (domain.Add(self_op.get()), domain.Add(cross_op.get()), domain.Add(beam_op.get()),
                              domain.Add(head_op.get()), domain.Add(quantize_op.get()), domain.Add(norm_op.get()),
                              domain.Add(relu_op.get()), domain.Add(swish_op.get()), domain.Add(encode_op.get()),
                              domain.Add(heads_op.get()), domain.Add(embed_op.get()), true);
  (void)added;
  Ort::UnownedSessionOptions(options).Add(domain);
  return nullptr;
}

// The decoder step's session held here, and greedy steps run in a loop here: no Python between two steps
// (export/runtime/native.py). Made through the ONNX Runtime that registered this library (native.py registers
// it first): the process's one environment, sessions.session_options's settings (the caller gives the
// config entries, among them the folder of the graph's weights file), the custom ops above. Each function returns
// 0, or -1 with the error's message in `error`.
namespace {

struct Runner {
  Ort::Session session{nullptr};
};

// A session's IoBinding, and what each name is bound to (host memory, its element type and shape), so that the
// library can move a batch's rows and bind the fewer rows again by itself (nmt_greedy_run).
struct Binding {
  struct Bound {
    int type;
    std::vector<int64_t> shape;
    char* data;
  };
  explicit Binding(Ort::Session& session) : io(session) {}
  Ort::IoBinding io;
  std::unordered_map<std::string, Bound> inputs, outputs;
};

size_t element_size(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return 8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return 1;
    default: throw std::runtime_error("element type " + std::to_string(type) + " is not bound by nmtserve");
  }
}

Ort::Value host_tensor(int type, const int64_t* shape, int ndim, void* data) {
  static const Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtDeviceAllocator, OrtMemTypeDefault);
  size_t count = 1;
  for (int i = 0; i < ndim; i++) count *= static_cast<size_t>(shape[i]);
  const auto element = static_cast<ONNXTensorElementDataType>(type);
  return Ort::Value::CreateTensor(cpu, data, count * element_size(element), shape, ndim, element);
}

void bind(Binding& binding, const char* name, int type, const int64_t* shape, int ndim, void* data, bool output) {
  Ort::Value value = host_tensor(type, shape, ndim, data);
  if (output) binding.io.BindOutput(name, value);
  else binding.io.BindInput(name, value);
  (output ? binding.outputs : binding.inputs)[name] = {type, std::vector<int64_t>(shape, shape + ndim),
                                                       static_cast<char*>(data)};
}

double monotonic_seconds() {  // Python's time.monotonic() (CLOCK_MONOTONIC)
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return now.tv_sec + now.tv_nsec * 1e-9;
}

constexpr int kMaxDims = 8;  // the dimensions nmt_bind reads for each tensor (native.py's _MAX_DIMS)

int failed(const std::exception& e, char* error, size_t error_size) {
  std::snprintf(error, error_size, "%s", e.what());
  return -1;
}

// An array that moves with a batch's rows but is not bound to the session (a row's source or beam score):
// one element of `bytes` per row, or per group of rows (per_group).
struct Carried {
  void* data;
  size_t bytes;
  bool per_group;
};

// The compaction of offline searches in the library (nmt_greedy_run, nmt_beam_steps), as BatchState.compact does: a
// batch of `groups` groups of `width` rows (a source's: 1 row for greedy, its beam for beam search), of which the
// groups not finished among the first `kept` stay and the last live groups move into the places of the finished
// ones, in every buffer of row_names (kernels.h: a cache's first `length` slots; cache_origin's filled slots
// renumbered as the group moves, a group's rows pointing only at each other, and the rest the row's own) and in the
// `carried` arrays; those names are then bound again with the rows kept.
void compact_groups(Binding& binding, int64_t width, int64_t groups, const uint8_t* finished, int64_t kept,
                    int64_t length, const nmt_row_names& row_names, std::initializer_list<Carried> carried) {
  std::vector<int64_t> holes, movers;
  for (int64_t g = 0; g < kept; g++)
    if (finished[g]) holes.push_back(g);
  for (int64_t g = kept; g < groups; g++)
    if (!finished[g]) movers.push_back(g);
  std::vector<const char*> moved;  // each buffer once (a cache is bound as input and as output)
  for (int i = 0; i < row_names.count; i++) {
    for (auto* map : {&binding.inputs, &binding.outputs}) {
      auto found = map->find(row_names.names[i]);
      if (found == map->end() || std::find(moved.begin(), moved.end(), found->second.data) != moved.end()) continue;
      const Binding::Bound& b = found->second;
      moved.push_back(b.data);
      const size_t element = element_size(static_cast<ONNXTensorElementDataType>(b.type));
      size_t row_bytes = element;
      for (size_t d = 1; d < b.shape.size(); d++) row_bytes *= static_cast<size_t>(b.shape[d]);
      const int64_t rows = row_names.kinds[i] == 3 ? 1 : width;  // of a group
      for (size_t m = 0; m < holes.size(); m++) {
        for (int64_t r = 0; r < rows; r++) {
          const int64_t to_row = holes[m] * rows + r, from_row = movers[m] * rows + r;
          char* to = b.data + to_row * row_bytes;
          const char* from = b.data + from_row * row_bytes;
          if (row_names.kinds[i] == 1) {
            const size_t head_bytes = row_bytes / b.shape[1], filled = length * b.shape[3] * element;
            for (int64_t h = 0; h < b.shape[1]; h++) std::memcpy(to + h * head_bytes, from + h * head_bytes, filled);
          } else if (row_names.kinds[i] == 2) {
            auto* slot = reinterpret_cast<int32_t*>(to);
            const auto* was = reinterpret_cast<const int32_t*>(from);
            const int64_t slots = static_cast<int64_t>(row_bytes / sizeof(int32_t)), shift = to_row - from_row;
            for (int64_t t = 0; t < slots; t++) slot[t] = static_cast<int32_t>(t < length ? was[t] + shift : to_row);
          } else {
            std::memcpy(to, from, row_bytes);
          }
        }
      }
    }
  }
  for (const Carried& c : carried) {
    const size_t group_bytes = c.bytes * (c.per_group ? 1 : width);
    for (size_t m = 0; m < holes.size(); m++)
      std::memcpy(static_cast<char*>(c.data) + holes[m] * group_bytes,
                  static_cast<char*>(c.data) + movers[m] * group_bytes, group_bytes);
  }
  for (int i = 0; i < row_names.count; i++) {  // bound again with the rows kept
    for (const bool output : {false, true}) {
      auto& map = output ? binding.outputs : binding.inputs;
      auto found = map.find(row_names.names[i]);
      if (found == map.end()) continue;
      std::vector<int64_t> shape = found->second.shape;
      shape[0] = row_names.kinds[i] == 3 ? kept : kept * width;
      bind(binding, row_names.names[i], found->second.type, shape.data(), static_cast<int>(shape.size()),
           found->second.data, output);
    }
  }
}

}  // namespace

extern "C" {  // the functions kernels.h declares, and says what each does
int nmt_ort_api_version() { return ORT_API_VERSION; }

int nmt_runner_create(const void* model, size_t model_size, int threads, int entries, const char* const* keys,
                      const char* const* values, void** runner_out, char* error, size_t error_size) {
  try {
    if (registered_api == nullptr) throw std::runtime_error("no ONNX Runtime session has registered the library yet");
    static Ort::Env* env = new Ort::Env(ORT_LOGGING_LEVEL_ERROR, "nmtserve");  // the process's one, shared
    Ort::SessionOptions options;
    options.SetIntraOpNumThreads(threads);
    options.SetInterOpNumThreads(1);
    options.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
    options.DisableCpuMemArena();
    options.SetLogSeverityLevel(3);
    for (int i = 0; i < entries; i++) options.AddConfigEntry(keys[i], values[i]);
    Ort::ThrowOnError(RegisterCustomOps(options, registered_api));
    auto runner = std::make_unique<Runner>();
    runner->session = Ort::Session(*env, model, model_size, options);
    *runner_out = runner.release();
    return 0;
  } catch (const std::exception& e) {
    return failed(e, error, error_size);
  }
}

void nmt_runner_free(void* runner) { delete static_cast<Runner*>(runner); }

int nmt_binding_create(void* runner, void** binding_out, char* error, size_t error_size) {
  try {
    *binding_out = new Binding(static_cast<Runner*>(runner)->session);
    return 0;
  } catch (const std::exception& e) {
    return failed(e, error, error_size);
  }
}

void nmt_binding_free(void* binding) { delete static_cast<Binding*>(binding); }

int nmt_bind(void* binding, int count, const char* const* names, const int* types, const int64_t* shapes,
             const int* ndims, void* const* data, const int* outputs, char* error, size_t error_size) {
  try {
    auto& bound = *static_cast<Binding*>(binding);
    for (int i = 0; i < count; i++)
      bind(bound, names[i], types[i], shapes + kMaxDims * i, ndims[i], data[i], outputs[i]);
    return 0;
  } catch (const std::exception& e) {
    return failed(e, error, error_size);
  }
}

int nmt_run(void* runner, void* binding, char* error, size_t error_size) {
  try {
    static_cast<Runner*>(runner)->session.Run(Ort::RunOptions{nullptr}, static_cast<Binding*>(binding)->io);
    return 0;
  } catch (const std::exception& e) {
    return failed(e, error, error_size);
  }
}

// nmt_greedy_run with keep_rows: the rows finished by `steps` steps are handed back (kernels.h)
void hand_back(nmt_greedy_run_args& a, int64_t steps) {
  __atomic_store_n(a.progress, steps, __ATOMIC_RELEASE);
  if (a.hand_back_fd >= 0) {
    const char byte = 1;
    (void)!write(a.hand_back_fd, &byte, 1);  // a full pipe already wakes the reader
  }
}

// nmt_greedy_run with keep_rows: whether the run ends for the requests waiting, `live` rows running and `free` rows
// they may take, after `steps` steps (kernels.h)
bool newcomers_may_join(const nmt_greedy_run_args& a, int64_t live, int64_t free, int64_t steps) {
  const int64_t waiting = a.waiting == nullptr ? 0 : *a.waiting;
  if (waiting <= 0 || free <= 0) return false;
  return 2 * live < a.gather || std::min(free, waiting) >= a.gather || steps >= a.gather_steps;
}

int64_t nmt_greedy_run(void* runner, void* binding, nmt_greedy_run_args* run, char* error, size_t error_size) {
  auto& session = static_cast<Runner*>(runner)->session;
  auto& bound = *static_cast<Binding*>(binding);
  const Ort::RunOptions run_options{nullptr};
  nmt_greedy_run_args& a = *run;
  int64_t rows = a.rows, step = 0, done = 0;
  std::vector<uint8_t> finished(rows, 0);
  if (a.hole != nullptr)
    for (int64_t r = 0; r < rows; r++) done += finished[r] = a.hole[r];
  const int64_t holes = done;
  try {
    for (; step < a.max_steps; step++) {
      session.Run(run_options, bound.io);
      bool ended = false;
      for (int64_t r = 0; r < rows; r++) {
        if (finished[r]) continue;
        a.positions[r] += 1;
        const int64_t s = a.source[r];
        a.out_tokens[step * a.sources + s] = a.tokens[r];
        if (a.out_scores != nullptr) a.out_scores[step * a.sources + s] = a.scores[r];
        if (a.eos[r] || a.at_budget[r]) {
          finished[r] = 1;
          done += 1;
          ended = true;
          a.end[s] = a.step0 + step;
          a.by_eos[s] = a.eos[r];
        }
      }
      const bool last = step + 1 == a.max_steps || (a.stop_at > 0 && monotonic_seconds() >= a.stop_at);
      if (a.keep_rows) {
        if (ended) hand_back(a, step + 1);
        if (last || done == rows || newcomers_may_join(a, rows - done, a.free_rows + done - holes, step + 1))
          return step + 1;
        continue;
      }
      if (a.until_a_row_ends) {
        if (ended || last) return step + 1;
        continue;
      }
      if (done == rows) {
        a.rows = 0;
        return step + 1;
      }
      if (4 * done >= rows || (done > 0 && last)) {  // the rows left at return are all live
        const int64_t kept = rows - done;
        try {
          int64_t length = 0;  // the slots the rows left have filled
          for (int64_t r = 0; r < rows; r++)
            if (!finished[r]) length = std::max(length, a.positions[r]);
          compact_groups(bound, 1, rows, finished.data(), kept, length, a.row_names,
                         {{a.source, sizeof(int64_t), true}});
        } catch (const std::exception& e) {  // rows half moved: the batch cannot go on
          return failed(e, error, error_size);
        }
        rows = kept;
        a.rows = rows;
        done = 0;
        finished.assign(rows, 0);
      }
      if (last) return step + 1;
    }
    return a.max_steps;
  } catch (const std::exception& e) {
    if (step > 0) return step;
    return failed(e, error, error_size);
  }
}

int64_t nmt_beam_steps(void* runner, void* binding, nmt_beam_run_args* run, char* error, size_t error_size) {
  auto& session = static_cast<Runner*>(runner)->session;
  auto& bound = *static_cast<Binding*>(binding);
  const Ort::RunOptions run_options{nullptr};
  nmt_beam_run_args& a = *run;
  int64_t groups = a.groups;
  std::vector<double> chosen(a.k), totals(a.groups * a.width);
  std::vector<int64_t> rows(a.groups * a.width), ids(a.groups * a.width), since(a.searches, 0);
  std::vector<int32_t> saved;
  std::vector<uint8_t> over(groups), ended(a.groups);  // ended: the ranker's, an eos among a search's k best
  std::fill(a.advanced, a.advanced + a.searches, 0);
  try {
    auto& ranker = static_cast<Runner*>(a.ranker)->session;
    Binding ranked(ranker);
    int64_t ranked_groups = -1;  // the groups the ranker's binding holds
    for (int64_t step = 0; step < a.max_steps; step++) {
      session.Run(run_options, bound.io);
      for (int64_t r = 0; r < groups * a.k; r++) a.positions[r] += 1;
      if (ranked_groups != groups) {  // every group's ranking in one run of the ranker graph (export/build/ranker.py)
        const int64_t beam_shape[] = {groups, a.k}, candidates_shape[] = {groups, a.k, a.width},
                      ranked_shape[] = {groups, a.width};
        bind(ranked, "beam", ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, beam_shape, 2, a.beam, false);
        bind(ranked, "ids", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, candidates_shape, 3, const_cast<int64_t*>(a.ids),
             false);
        bind(ranked, "scores", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, candidates_shape, 3, const_cast<float*>(a.scores),
             false);
        bind(ranked, "rows", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, ranked_shape, 2, rows.data(), true);
        bind(ranked, "tokens", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, ranked_shape, 2, ids.data(), true);
        bind(ranked, "totals", ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, ranked_shape, 2, totals.data(), true);
        bind(ranked, "ended", ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, beam_shape, 1, ended.data(), true);
        bind(ranked, "eos", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, beam_shape, 0, &a.eos, false);  // a scalar
        ranked_groups = groups;
      }
      ranker.Run(run_options, ranked.io);
      int64_t over_now = 0;
      for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * a.k, s = a.search_of[g], best = g * a.width;
        if (a.ordinary[s] < 0) {  // over: its rows decode on, ignored
          for (int64_t r = first; r < first + a.k; r++) a.tokens[r] = a.ids[r * a.width];
          over[g] = 1;
          over_now += 1;
          continue;
        }
        const bool ruled = since[s] >= a.ordinary[s] || ended[g];  // the step is BeamSearch's
        int64_t* parent = a.chosen_parents + s * a.k;
        int64_t* token = a.chosen_tokens + s * a.k;
        if (ruled) {
          std::copy(rows.begin() + best, rows.begin() + best + a.width, a.cand_rows + s * a.width);
          std::copy(ids.begin() + best, ids.begin() + best + a.width, a.cand_ids + s * a.width);
          std::copy(totals.begin() + best, totals.begin() + best + a.width, a.cand_scores + s * a.width);
          if (a.rules(s, g) != 0) {
            std::snprintf(error, error_size, "beam search's rules raised");
            return -1;
          }
          since[s] = 0;
          over[g] = a.ordinary[s] < 0;
          over_now += over[g];
        } else {
          const int64_t at = (a.advanced[s]++ * a.searches + s) * a.k;
          for (int64_t i = 0; i < a.k; i++) {
            parent[i] = a.out_parents[at + i] = rows[best + i];
            token[i] = a.out_tokens[at + i] = ids[best + i];
            chosen[i] = totals[best + i];
          }
          std::copy(chosen.begin(), chosen.end(), a.beam + first);
          since[s] += 1;
          over[g] = 0;
        }
        saved.assign(a.origin + first * a.capacity, a.origin + (first + a.k) * a.capacity);
        for (int64_t i = 0; i < a.k; i++) {
          a.tokens[first + i] = token[i];
          if (parent[i] != i)
            std::memcpy(a.origin + (first + i) * a.capacity, saved.data() + parent[i] * a.capacity,
                        a.positions[first] * sizeof(int32_t));
        }
      }
      if (over_now == groups) {
        a.groups = 0;
        return step + 1;
      }
      if (4 * over_now >= groups || (over_now > 0 && step + 1 == a.max_steps)) {  // the groups left at return all live
        const int64_t kept = groups - over_now;
        try {
          compact_groups(bound, a.k, groups, over.data(), kept, a.positions[0], a.row_names,
                         {{a.beam, sizeof(double), false}, {a.search_of, sizeof(int64_t), true}});
        } catch (const std::exception& e) {  // rows half moved: the batch cannot go on
          return failed(e, error, error_size);
        }
        groups = kept;
        a.groups = groups;
        over.assign(groups, 0);
      }
    }
    return a.max_steps;
  } catch (const std::exception& e) {
    return failed(e, error, error_size);
  }
}

}  // extern "C"
