// Compiled CPU ops: decode attention that reads K/V blocks in place, the cache write, and the fused per-token
// ops of a decoder layer (RMSNorm, rotary embedding, SiLU-and-multiply), each one pass over its rows.
//
// Layout (same as pagewise/kernels/reference.py): each layer's key and value caches are contiguous
// [num_blocks, num_kv_heads, block_size, head_dim]; the slot of a token is block_id * block_size + offset.
// Activations are float32. The KV cache is float32 or bfloat16: a bf16 cache is read as float32 (a bf16 value is
// the top half of a float32's bits) and written rounded to nearest even, as torch's conversion rounds; the
// attention itself computes in float32 either way. Callers fall back to the torch reference for other dtypes.
//
// The hot loops live in functions built for several instruction sets (GCC `target_clones`): the loader picks the
// best one the CPU supports at run time, so one build runs on AVX2 and AVX-512 machines alike.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#define PAGEWISE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// A float32 stored in a cache element: itself, or rounded to the nearest bf16 (ties to even; no NaNs arise
// under -ffast-math, and infinities stay infinite).
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) {
    uint32_t word;
    std::memcpy(&word, &x, sizeof word);
    word += 0x7FFFu + ((word >> 16) & 1u);
    *out = static_cast<uint16_t>(word >> 16);
}

// Rows of one kv head inside one block: `count` (<= block_size) consecutive tokens of a block are contiguous.
template <typename T>
inline const T* block_rows(const T* cache, const int32_t* table, int64_t t, int64_t block_stride,
                               int64_t head_offset, int64_t block_size, int64_t head_dim) {
    return cache + table[t / block_size] * block_stride + head_offset + (t % block_size) * head_dim;
}

// Asks for one kv head's rows of the block holding token `t` (those in the context; none past its end) to be
// brought into cache while the current block is computed: a sequence's blocks lie anywhere in the cache, so the
// hardware prefetcher, which follows the rows of one block, cannot find the next block by itself.
template <typename T>
inline void prefetch_block(const T* cache, const int32_t* table, int64_t t, int64_t context_len,
                           int64_t block_stride, int64_t head_offset, int64_t block_size, int64_t head_dim) {
    if (t >= context_len) return;
    const char* rows = reinterpret_cast<const char*>(
        block_rows(cache, table, t, block_stride, head_offset, block_size, head_dim));
    const int64_t bytes = std::min(block_size, context_len - t) * head_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(rows + line);
}

// Rows of a bf16 cache as float32, `n` elements from `src` into `dst`: a bf16 is the top half of a float32's
// bits. Written through a may_alias integer type, so the loop vectorizes (a widening move and a shift) and the
// floats read back from `dst` are well defined.
typedef uint32_t __attribute__((may_alias)) float_bits;
inline void widen_rows(const uint16_t* src, int64_t n, float* dst) {
    float_bits* out = reinterpret_cast<float_bits*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(src[i]) << 16;
}

// `n` cache elements from `rows` as float32: the rows themselves for a float32 cache, else widened into `tile`.
inline const float* as_float(const float* rows, int64_t, float*) { return rows; }
inline const float* as_float(const uint16_t* rows, int64_t n, float* tile) {
    widen_rows(rows, n, tile);
    return tile;
}

// One (sequence, kv head) unit of decode attention: the `group` query heads that share kv head `kv_head` attend
// over the sequence's first `context_len` cached tokens. `scores` holds group * context_len floats, `tile`
// 4 * head_dim. Tokens go four at a time inside a block: their rows are read as float32 once (`as_float`) for
// all the group's query heads, each query row keeps four independent accumulators (scores), and each output row
// is loaded and stored once per four value rows. `T` is the cache's element (float, or uint16_t for bf16); the
// body is inlined into one function per element type, each built for several instruction sets.
template <typename T>
inline __attribute__((always_inline)) void attend_body(const float* queries, const T* key_cache, const T* value_cache,
                                                       const int32_t* table, int64_t context_len, int64_t kv_head,
                                                       int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                                                       int64_t group, float scale, float* scores, float* tile,
                                                       float* out) {
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t head_offset = kv_head * block_size * head_dim;
    for (int64_t t = 0; t < context_len;) {
        const T* k = block_rows(key_cache, table, t, block_stride, head_offset, block_size, head_dim);
        const int64_t run = std::min(block_size - t % block_size, context_len - t);  // contiguous rows from t
        prefetch_block(key_cache, table, t + run, context_len, block_stride, head_offset, block_size, head_dim);
        int64_t i = 0;
        for (; i + 4 <= run; i += 4) {
            const float* k0 = as_float(k + i * head_dim, 4 * head_dim, tile);
            const float *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
            for (int64_t g = 0; g < group; ++g) {
                const float* q = queries + g * head_dim;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int64_t d = 0; d < head_dim; ++d) {
                    a0 += q[d] * k0[d];
                    a1 += q[d] * k1[d];
                    a2 += q[d] * k2[d];
                    a3 += q[d] * k3[d];
                }
                float* row = scores + g * context_len + t + i;
                row[0] = a0 * scale, row[1] = a1 * scale, row[2] = a2 * scale, row[3] = a3 * scale;
            }
        }
        for (; i < run; ++i) {
            const float* k0 = as_float(k + i * head_dim, head_dim, tile);
            for (int64_t g = 0; g < group; ++g) {
                const float* q = queries + g * head_dim;
                float a0 = 0.f;
#pragma omp simd reduction(+ : a0)
                for (int64_t d = 0; d < head_dim; ++d) a0 += q[d] * k0[d];
                scores[g * context_len + t + i] = a0 * scale;
            }
        }
        t += run;
    }
    prefetch_block(value_cache, table, 0, context_len, block_stride, head_offset, block_size, head_dim);
    for (int64_t g = 0; g < group; ++g) {
        float* row = scores + g * context_len;
        float peak = -std::numeric_limits<float>::max();  // finite: built with -ffast-math
        for (int64_t t = 0; t < context_len; ++t) peak = std::max(peak, row[t]);
        float total = 0.f;
        for (int64_t t = 0; t < context_len; ++t) {
            row[t] = std::exp(row[t] - peak);
            total += row[t];
        }
        const float inverse = 1.f / total;
        for (int64_t t = 0; t < context_len; ++t) row[t] *= inverse;
        float* o = out + g * head_dim;
        std::fill(o, o + head_dim, 0.f);
    }
    for (int64_t t = 0; t < context_len;) {
        const T* v = block_rows(value_cache, table, t, block_stride, head_offset, block_size, head_dim);
        const int64_t run = std::min(block_size - t % block_size, context_len - t);
        prefetch_block(value_cache, table, t + run, context_len, block_stride, head_offset, block_size, head_dim);
        int64_t i = 0;
        for (; i + 4 <= run; i += 4) {
            const float* v0 = as_float(v + i * head_dim, 4 * head_dim, tile);
            const float *v1 = v0 + head_dim, *v2 = v1 + head_dim, *v3 = v2 + head_dim;
            for (int64_t g = 0; g < group; ++g) {
                const float* p = scores + g * context_len + t + i;
                const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
                float* o = out + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
            }
        }
        for (; i < run; ++i) {
            const float* v0 = as_float(v + i * head_dim, head_dim, tile);
            for (int64_t g = 0; g < group; ++g) {
                const float p0 = scores[g * context_len + t + i];
                float* o = out + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) o[d] += p0 * v0[d];
            }
        }
        t += run;
    }
}

PAGEWISE_CLONES
void attend_unit(const float* queries, const float* key_cache, const float* value_cache, const int32_t* table,
                 int64_t context_len, int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                 int64_t group, float scale, float* scores, float* tile, float* out) {
    attend_body(queries, key_cache, value_cache, table, context_len, kv_head, num_kv_heads, block_size, head_dim,
                group, scale, scores, tile, out);
}

PAGEWISE_CLONES
void attend_unit(const float* queries, const uint16_t* key_cache, const uint16_t* value_cache, const int32_t* table,
                 int64_t context_len, int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                 int64_t group, float scale, float* scores, float* tile, float* out) {
    attend_body(queries, key_cache, value_cache, table, context_len, kv_head, num_kv_heads, block_size, head_dim,
                group, scale, scores, tile, out);
}

// A cache's elements as `T` (float for a float32 cache, uint16_t for a bf16 one).
template <typename T>
T* elements(const at::Tensor& cache) {
    return reinterpret_cast<T*>(cache.data_ptr());
}

void check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache) {
    for (const at::Tensor* cache : {&key_cache, &value_cache}) {
        TORCH_CHECK(cache->device().is_cpu() && cache->dim() == 4 && cache->is_contiguous() &&
                        (cache->scalar_type() == at::kFloat || cache->scalar_type() == at::kBFloat16),
                    "KV caches must be contiguous float32 or bfloat16 CPU tensors "
                    "[num_blocks, num_kv_heads, block_size, head_dim]");
    }
    TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() && key_cache.sizes() == value_cache.sizes(),
                "key and value caches differ in dtype or shape");
}

// query [num_seqs, num_heads, head_dim]: one token per sequence, at position seq_lens[s] - 1 (already cached).
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
    check_caches(key_cache, value_cache);
    TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 3, "query must be float32 [seqs, heads, dim]");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2, "block_tables must be int32 2-D");
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1, "seq_lens must be int32 1-D");
    const auto q = query.contiguous();
    const auto tables = block_tables.contiguous();
    const auto lens = seq_lens.contiguous();
    const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
    TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "query and cache shapes disagree");
    TORCH_CHECK(tables.size(0) == num_seqs && lens.size(0) == num_seqs, "one block table and length per sequence");
    const int64_t group = num_heads / num_kv_heads, max_blocks = tables.size(1);
    const int32_t* len_ptr = lens.data_ptr<int32_t>();
    for (int64_t s = 0; s < num_seqs; ++s) {
        TORCH_CHECK(len_ptr[s] >= 1 && len_ptr[s] <= max_blocks * block_size, "seq_lens out of the block table");
    }
    auto out = at::empty_like(q);
    const float* q_ptr = q.data_ptr<float>();
    const int32_t* table_ptr = tables.data_ptr<int32_t>();
    float* out_ptr = out.data_ptr<float>();
    const int64_t longest = *std::max_element(len_ptr, len_ptr + num_seqs);
    auto attend_all = [&](const auto* k_ptr, const auto* v_ptr) {
        at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scores(group * longest), tile(4 * head_dim);
            for (int64_t unit = begin; unit < end; ++unit) {
                const int64_t s = unit / num_kv_heads, h = unit % num_kv_heads;
                const int64_t row = (s * num_heads + h * group) * head_dim;
                attend_unit(q_ptr + row, k_ptr, v_ptr, table_ptr + s * max_blocks, len_ptr[s], h, num_kv_heads,
                            block_size, head_dim, group, static_cast<float>(scale), scores.data(), tile.data(),
                            out_ptr + row);
            }
        });
    };
    if (key_cache.scalar_type() == at::kBFloat16) {
        attend_all(elements<const uint16_t>(key_cache), elements<const uint16_t>(value_cache));
    } else {
        attend_all(elements<const float>(key_cache), elements<const float>(value_cache));
    }
    return out;
}

// Token i's key and value rows of every kv head into slot `slots[i]` of caches of element `T`; slot -1 skipped.
template <typename T>
void write_slots(const float* src_k, const float* src_v, const int64_t* slots, int64_t num_tokens, int64_t num_kv_heads,
                 int64_t block_size, int64_t head_dim, T* dst_k, T* dst_v) {
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
            const int64_t src = (i * num_kv_heads + h) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) {
                narrow(src_k[src + d], dst_k + dst + d);
                narrow(src_v[src + d], dst_v + dst + d);
            }
        }
    }
}

// key/value [num_tokens, num_kv_heads, head_dim] into their slots; slot -1 is skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
    check_caches(key_cache, value_cache);
    TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat, "key/value must be float32");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
    const auto k = key.contiguous(), v = value.contiguous(), slots = slot_mapping.contiguous();
    const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
    const int64_t block_size = key_cache.size(2), num_slots = key_cache.size(0) * block_size;
    TORCH_CHECK(key_cache.size(1) == num_kv_heads && key_cache.size(3) == head_dim && slots.size(0) == num_tokens,
                "key/value, cache and slot_mapping shapes disagree");
    const int64_t* slot_ptr = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_tokens; ++i) {
        TORCH_CHECK(slot_ptr[i] >= -1 && slot_ptr[i] < num_slots, "slot_mapping out of the cache");
    }
    const float* src_k = k.data_ptr<float>();
    const float* src_v = v.data_ptr<float>();
    if (key_cache.scalar_type() == at::kBFloat16) {
        write_slots(src_k, src_v, slot_ptr, num_tokens, num_kv_heads, block_size, head_dim,
                    elements<uint16_t>(key_cache), elements<uint16_t>(value_cache));
    } else {
        write_slots(src_k, src_v, slot_ptr, num_tokens, num_kv_heads, block_size, head_dim,
                    elements<float>(key_cache), elements<float>(value_cache));
    }
}

// ---- fused per-token ops (float32, one parallel pass over rows)

PAGEWISE_CLONES
void rms_norm_row(const float* x, const float* weight, float eps, int64_t size, float* out) {
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < size; ++i) squares += x[i] * x[i];
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) out[i] = weight[i] * (x[i] * inverse);
}

// out = weight * x / sqrt(mean(x^2) + eps), row by row over the last dimension of a 2-D x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2,
                "rms_norm takes a float32 [rows, size] input and weight");
    TORCH_CHECK(weight.numel() == x.size(1), "rms_norm weight size differs from the rows'");
    const auto in = x.contiguous();
    const auto w = weight.contiguous();
    auto out = at::empty_like(in);
    const int64_t rows = in.size(0), size = in.size(1);
    const float *in_ptr = in.data_ptr<float>(), *w_ptr = w.data_ptr<float>();
    float* out_ptr = out.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            rms_norm_row(in_ptr + r * size, w_ptr, static_cast<float>(eps), size, out_ptr + r * size);
    });
    return out;
}

PAGEWISE_CLONES
void rotate_row(float* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

// Rotary embedding (rotate-half form) in place on query [tokens, heads, dim] and key [tokens, kv_heads, dim]
// views: token t uses row positions[t] of the [max_positions, dim] cos/sin tables. Heads' rows must be contiguous.
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin) {
    TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && query.dim() == 3 &&
                    key.dim() == 3, "rotary_embedding takes float32 [tokens, heads, dim] query and key");
    TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && query.stride(1) == query.size(2) &&
                    key.stride(1) == key.size(2), "query and key heads must be contiguous rows");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                    cos.size(1) == query.size(2) && key.size(2) == query.size(2), "cos/sin tables disagree");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == query.size(0) &&
                    key.size(0) == query.size(0), "one position per token");
    const auto pos = positions.contiguous();
    const int64_t* pos_ptr = pos.data_ptr<int64_t>();
    const int64_t tokens = query.size(0), dim = query.size(2), max_positions = cos.size(0);
    for (int64_t t = 0; t < tokens; ++t)
        TORCH_CHECK(pos_ptr[t] >= 0 && pos_ptr[t] < max_positions, "position out of the rotary tables");
    const int64_t q_heads = query.size(1), k_heads = key.size(1), q_stride = query.stride(0), k_stride = key.stride(0);
    float *q_ptr = query.data_ptr<float>(), *k_ptr = key.data_ptr<float>();
    const float *cos_ptr = cos.data_ptr<float>(), *sin_ptr = sin.data_ptr<float>();
    at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float *c = cos_ptr + pos_ptr[t] * dim, *s = sin_ptr + pos_ptr[t] * dim;
            for (int64_t h = 0; h < q_heads; ++h) rotate_row(q_ptr + t * q_stride + h * dim, c, s, dim / 2);
            for (int64_t h = 0; h < k_heads; ++h) rotate_row(k_ptr + t * k_stride + h * dim, c, s, dim / 2);
        }
    });
}

PAGEWISE_CLONES
void silu_and_mul_row(const float* gate, const float* up, int64_t size, float* out) {
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// [rows, 2 * size] (gate then up) -> silu(gate) * up, [rows, size].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
    TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
                "silu_and_mul takes a float32 [rows, 2 * size] input");
    const auto in = gate_up.contiguous();
    const int64_t rows = in.size(0), size = in.size(1) / 2;
    auto out = at::empty({rows, size}, in.options());
    const float* in_ptr = in.data_ptr<float>();
    float* out_ptr = out.data_ptr<float>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            silu_and_mul_row(in_ptr + r * 2 * size, in_ptr + r * 2 * size + size, size, out_ptr + r * size);
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(pagewise_cpu, m) {
    m.def("paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
          "Tensor seq_lens, float scale) -> Tensor");
    m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
          "Tensor slot_mapping) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
    m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagewise_cpu, CPU, m) {
    m.impl("paged_attention_decode", &paged_attention_decode);
    m.impl("reshape_and_cache", &reshape_and_cache);
    m.impl("rms_norm", &rms_norm);
    m.impl("rotary_embedding", &rotary_embedding);
    m.impl("silu_and_mul", &silu_and_mul);
}
