// Compiled CPU ops: decode attention that reads K/V blocks in place, the cache write, the fused per-token ops of a
// decoder layer (RMSNorm, rotary embedding, SiLU-and-multiply, the residual add), each one pass over its rows,
// the batched LoRA delta of a projection (rows grouped by adapter slot), and a projection of a few rows.
//
// Layout (same as pagewise/kernels/reference.py): each layer's key and value caches are contiguous
// [num_blocks, num_kv_heads, block_size, head_dim]; the slot of a token is block_id * block_size + offset.
// Activations are float32, except where an op says it takes or gives the bf16 input or output of a bf16
// projection (RMSNorm's output, SiLU-and-multiply, the residual add's delta, the rotary embedding, the cache
// write and attention's query and result). The KV cache is float32 or bfloat16: a bf16 cache is read as float32 (a bf16 value is
// the top half of a float32's bits) and written rounded to nearest even, as torch's conversion rounds; the
// attention itself computes in float32 either way. Callers fall back to the torch reference for other dtypes.
//
// The hot loops live in functions built for several instruction sets (GCC `target_clones`): the loader picks the
// best one the CPU supports at run time, so one build runs on AVX2 and AVX-512 machines alike. A few are written
// for one instruction set with intrinsics and chosen at run time by the CPU's features: decode attention over a
// bf16 cache on AMX tiles or with AVX512-BF16, over a float32 cache with AVX2 on CPUs without AVX-512, and the loops of the
// few-rows product.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#define PAGEWISE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// A float32 stored in a cache or bf16 activation element: itself, or rounded to the nearest bf16 (ties to even; no NaNs arise
// under -ffast-math, and infinities stay infinite).
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) {
    uint32_t word;
    std::memcpy(&word, &x, sizeof word);
    word += 0x7FFFu + ((word >> 16) & 1u);
    *out = static_cast<uint16_t>(word >> 16);
}

// An activation row element as float32 (a float, or a bf16's bits).
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
    const uint32_t word = static_cast<uint32_t>(x) << 16;
    float out;
    std::memcpy(&out, &word, sizeof out);
    return out;
}

template <typename T>
inline __attribute__((always_inline)) void widen_row_body(const T* src, int64_t n, float* dst) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

PAGEWISE_CLONES
void widen_row(const float* src, int64_t n, float* dst) { widen_row_body(src, n, dst); }

PAGEWISE_CLONES
void widen_row(const uint16_t* src, int64_t n, float* dst) { widen_row_body(src, n, dst); }

// A row as bf16: copied, or rounded to nearest even.
void bf16_row(const uint16_t* src, int64_t n, uint16_t* dst) { std::memcpy(dst, src, n * sizeof(uint16_t)); }

PAGEWISE_CLONES
void bf16_row(const float* src, int64_t n, uint16_t* dst) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) narrow(src[i], dst + i);
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

// How many blocks ahead of the one being computed a pass over a sequence's cache asks for. Measured on Zen 4
// (30 layers, 64 x 256 tokens): 1 and 2 blocks ahead ran alike, 4 and 8 ran 15-25% slower (the requests crowd
// out the demand loads), so the next block only.
constexpr int64_t PREFETCH_BLOCKS = 1;

// The rows the pass at token `t` (the first of a run inside its block) will want `PREFETCH_BLOCKS` blocks later;
// at `t` = 0 every block up to there, so a pass starts with its first blocks on their way.
template <typename T>
inline void prefetch_ahead(const T* cache, const int32_t* table, int64_t t, int64_t context_len,
                           int64_t block_stride, int64_t head_offset, int64_t block_size, int64_t head_dim) {
    const int64_t block = t / block_size;
    for (int64_t b = t == 0 ? 1 : PREFETCH_BLOCKS; b <= PREFETCH_BLOCKS; ++b)
        prefetch_block(cache, table, (block + b) * block_size, context_len, block_stride, head_offset, block_size,
                       head_dim);
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
        prefetch_ahead(key_cache, table, t, context_len, block_stride, head_offset, block_size, head_dim);
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
        prefetch_ahead(value_cache, table, t, context_len, block_stride, head_offset, block_size, head_dim);
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

#if defined(__x86_64__)
// ---- decode attention over a bf16 cache with AVX512-BF16 dot products (Zen 4, Sapphire Rapids and later)
//
// The query is rounded to bf16 once per unit (the scale folded in first); each score is then a sum of exact
// products of two bf16 values accumulated in float32 (`vdpbf16ps`), and the cache's key rows are used as they lie,
// never widened. Sixteen tokens' partial sums are reduced together (a transpose-and-add tree, about three
// instructions per score instead of a horizontal sum each). The softmax runs in float32 with a vectorized exp, and
// the values are widened to float32 and accumulated with the exact float32 probabilities. So the result is the
// float32 attention of the bf16-rounded query over the cache, summed in another order.
#define PAGEWISE_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define PAGEWISE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

bool cpu_has_avx512() {
    static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    return has;
}

bool cpu_has_bf16_dot() {
    static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    return has;
}

// e^x for x <= 0 (scores minus their peak): x = n ln2 + r with |r| <= ln2/2 (ln 2 in two parts, so n ln 2 loses
// nothing), e^r by its degree-6 Taylor polynomial (relative error under 2e-7, Horner from the highest term), times
// 2^n; x is clamped at -87, where e^x is a tiny normal.
constexpr float EXP_FLOOR = -87.f, LOG2E = 1.44269504088896341f, LN2_HIGH = 0.693359375f, LN2_LOW = -2.12194440e-4f;
constexpr float EXP_TAYLOR[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

PAGEWISE_AVX512 inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LOW), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HIGH), x));
    __m512 p = _mm512_set1_ps(EXP_TAYLOR[0]);
    for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_TAYLOR[i]));
    return _mm512_scalef_ps(p, n);
}

// Lane j of the result: the sum of the sixteen lanes of v[j].
PAGEWISE_AVX512 inline __m512 sum_lanes_of_16(const __m512* v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] partials at 0 and 2, v[2i+1] at 1 and 3
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v[4i .. 4i+3] one partial each
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// s[r * s_stride + j] = x_r . w_j for r < rows (at most 4) and j < n, with bf16 input rows (x, `in` apart) and
// weight rows (w, `in` apart): each sum is of exact products of two bf16 values, accumulated in float32 (`vdpbf16ps`)
// 32 elements a step (the last step masked). Four weight rows at a time against all the input rows: up to sixteen
// accumulators, with fixed trip counts so they stay in registers, reduced together by `sum_lanes_of_16`.
PAGEWISE_BF16_DOT
void bf16_dot_rows(const uint16_t* x, int64_t rows, const uint16_t* w, int64_t n, int64_t in, float* s,
                   int64_t s_stride, const uint16_t* prefetch_end) {
    const int64_t full = in / 32 * 32;
    const __mmask32 tail = (__mmask32(1) << (in - full)) - 1;
    for (int64_t j = 0; j < n; j += 4) {
        const uint16_t* wr[4];
        for (int q = 0; q < 4; ++q) wr[q] = w + std::min(j + q, n - 1) * in;  // past n: a real row, its sums unused
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        // The four rows a group reads are 4 * in contiguous elements, read as four short streams the hardware
        // prefetcher barely learns: ask for the group four ahead (up to `prefetch_end`, which may lie past the
        // n rows: the caller's next rows), a quarter of it per step, ourselves.
        const char* ahead = reinterpret_cast<const char*>(w + (j + 16) * in);
        const char* ahead_end = std::min(reinterpret_cast<const char*>(w + (j + 20) * in),
                                         reinterpret_cast<const char*>(prefetch_end));
        for (int64_t k = 0; k < full; k += 32) {
            for (int q = 0; q < 4; ++q) {
                const char* line = ahead + (k / 32 * 4 + q) * 64;
                if (line < ahead_end) _mm_prefetch(line, _MM_HINT_T0);
            }
            __m512bh wq[4];
            for (int q = 0; q < 4; ++q) wq[q] = (__m512bh)_mm512_loadu_si512(wr[q] + k);
            for (int r = 0; r < 4; ++r) {
                if (r >= rows) break;
                const __m512bh xr = (__m512bh)_mm512_loadu_si512(x + r * in + k);
                for (int q = 0; q < 4; ++q) acc[r * 4 + q] = _mm512_dpbf16_ps(acc[r * 4 + q], xr, wq[q]);
            }
        }
        if (full < in) {
            __m512bh wq[4];
            for (int q = 0; q < 4; ++q) wq[q] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr[q] + full);
            for (int r = 0; r < 4; ++r) {
                if (r >= rows) break;
                const __m512bh xr = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * in + full);
                for (int q = 0; q < 4; ++q) acc[r * 4 + q] = _mm512_dpbf16_ps(acc[r * 4 + q], xr, wq[q]);
            }
        }
        alignas(64) float sums[16];
        _mm512_store_ps(sums, sum_lanes_of_16(acc));
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t q = 0; q < 4 && j + q < n; ++q) s[r * s_stride + j + q] = sums[r * 4 + q];
    }
}

// Sixteen float32 partial sums of a key row (`pairs` * 32 bf16) times a query row (as many bf16 pairs).
PAGEWISE_BF16_DOT inline __m512 dot_bf16(const uint16_t* k, const __m512bh* q, int64_t pairs) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < pairs; ++c) acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return acc;
}

// The bf16 pair (p[0], p[1]) — (p[0], 0) unless `both` — in every 32-bit lane.
PAGEWISE_BF16_DOT inline __m512bh probability_pair(const uint16_t* p, bool both) {
    uint32_t bits = p[0];
    if (both) std::memcpy(&bits, p, sizeof bits);  // little-endian: p[0] in the low half
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// Lanes of `vpermt2w` that interleave two rows' 32 bf16 elements by pairs: the first 16 elements of each row,
// then the last 16.
alignas(64) constexpr uint16_t PAIRS_LOW[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t PAIRS_HIGH[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// Two value rows' 32 bf16 elements a and b as pairs per 32-bit lane: lo lane k holds (a[k], b[k]) and hi lane k
// (a[16 + k], b[16 + k]), so one `vdpbf16ps` against the pair of their weights sums both rows' products.
struct ValuePairs {
    __m512bh lo, hi;
};
PAGEWISE_BF16_DOT inline ValuePairs interleave_value_pair(__m512i a, __m512i b) {
    return {(__m512bh)_mm512_permutex2var_epi16(a, _mm512_load_si512(PAIRS_LOW), b),
            (__m512bh)_mm512_permutex2var_epi16(a, _mm512_load_si512(PAIRS_HIGH), b)};
}

// out[g] += sum over i < n of p_g[i] * v[i] for g < G, 32 dims at a time: bf16 probabilities (row g at
// probs + g * probs_stride) against bf16 value rows (`head_dim` apart) read in place, two tokens per `vdpbf16ps`
// (`interleave_value_pair`): exact products, float32 sums. An odd last token pairs with zeros. The 2 * G
// accumulators of a 32-dim slice stay in registers over the rows.
template <int G>
PAGEWISE_BF16_DOT inline void add_value_pairs_of(const uint16_t* probs, int64_t probs_stride, const uint16_t* v,
                                                 int64_t n, int64_t head_dim, float* out) {
    for (int64_t c = 0; c < head_dim; c += 32) {
        __m512 acc[G][2];
        for (int g = 0; g < G; ++g) {
            acc[g][0] = _mm512_loadu_ps(out + g * head_dim + c);
            acc[g][1] = _mm512_loadu_ps(out + g * head_dim + c + 16);
        }
        for (int64_t i = 0; i < n; i += 2) {
            const bool both = i + 1 < n;
            const ValuePairs pairs = interleave_value_pair(
                _mm512_loadu_si512(v + i * head_dim + c),
                both ? _mm512_loadu_si512(v + (i + 1) * head_dim + c) : _mm512_setzero_si512());
            for (int g = 0; g < G; ++g) {
                const __m512bh p = probability_pair(probs + g * probs_stride + i, both);
                acc[g][0] = _mm512_dpbf16_ps(acc[g][0], p, pairs.lo);
                acc[g][1] = _mm512_dpbf16_ps(acc[g][1], p, pairs.hi);
            }
        }
        for (int g = 0; g < G; ++g) {
            _mm512_storeu_ps(out + g * head_dim + c, acc[g][0]);
            _mm512_storeu_ps(out + g * head_dim + c + 16, acc[g][1]);
        }
    }
}

// `add_value_pairs_of` for a group of up to 8 query heads.
PAGEWISE_BF16_DOT inline void add_value_pairs(const uint16_t* probs, int64_t probs_stride, const uint16_t* v,
                                              int64_t n, int64_t head_dim, int64_t group, float* out) {
    switch (group) {
        case 1: return add_value_pairs_of<1>(probs, probs_stride, v, n, head_dim, out);
        case 2: return add_value_pairs_of<2>(probs, probs_stride, v, n, head_dim, out);
        case 3: return add_value_pairs_of<3>(probs, probs_stride, v, n, head_dim, out);
        case 4: return add_value_pairs_of<4>(probs, probs_stride, v, n, head_dim, out);
        case 5: return add_value_pairs_of<5>(probs, probs_stride, v, n, head_dim, out);
        case 6: return add_value_pairs_of<6>(probs, probs_stride, v, n, head_dim, out);
        case 7: return add_value_pairs_of<7>(probs, probs_stride, v, n, head_dim, out);
        default: return add_value_pairs_of<8>(probs, probs_stride, v, n, head_dim, out);
    }
}

// Kv heads a decode pass over a bf16 cache takes together: their rows of a block lie side by side, so each block
// is read as one run of up to four heads' rows rather than one head's rows at a time.
constexpr int64_t DECODE_HEADS = 4;

// Decode attention of one sequence over a bf16 cache, every kv head, head_dim a multiple of 32 (at most 256) and
// at most 8 query heads per kv head: the scores of the scaled query rounded to bf16, their softmax in float32
// rounded to bf16, and the value sum of those probabilities (`add_value_pairs`) — what the AMX kernel computes,
// as bf16 attention does. `scores` holds num_heads * context_len + 16 floats; `queries` and `out` are the
// sequence's rows of every query head. (The scratch `tile` of `attend_sequence_bf16`'s signature is not needed.)
PAGEWISE_BF16_DOT
void attend_sequence_bf16_dot(const float* queries, const uint16_t* key_cache, const uint16_t* value_cache,
                              const int32_t* table, int64_t context_len, int64_t num_kv_heads, int64_t block_size,
                              int64_t head_dim, int64_t group, float scale, float* scores, float*, float* out) {
    const int64_t block_stride = num_kv_heads * block_size * head_dim, head_stride = block_size * head_dim;
    const int64_t pairs = head_dim / 32;  // 32 bf16 per dot-product instruction
    const int64_t full = context_len & ~int64_t{15};
    for (int64_t h0 = 0; h0 < num_kv_heads; h0 += DECODE_HEADS) {
        const int64_t heads = std::min(DECODE_HEADS, num_kv_heads - h0), rows = heads * group;
        const int64_t head_offset = h0 * head_stride;
        const float* first_query = queries + h0 * group * head_dim;
        float* first_out = out + h0 * group * head_dim;
        __m512bh q[DECODE_HEADS * 8][8];
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < pairs; ++c) {
                const float* row = first_query + r * head_dim + 32 * c;
                q[r][c] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + 16), _mm512_set1_ps(scale)),
                                              _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_set1_ps(scale)));
            }
        // The heads' rows of one block are one contiguous run; ask for the next block's (all of them) ahead.
        auto prefetch_next = [&](int64_t t) {
            const int64_t next = (t / block_size + 1) * block_size;
            if (next >= context_len) return;
            for (int64_t h = 0; h < heads; ++h)
                prefetch_block(key_cache, table, next, context_len, block_stride, head_offset + h * head_stride,
                               block_size, head_dim);
        };
        for (int64_t t = 0; t < context_len;) {
            const int64_t run = std::min(block_size - t % block_size, context_len - t);
            prefetch_next(t);
            for (int64_t h = 0; h < heads; ++h) {
                const uint16_t* k = block_rows(key_cache, table, t, block_stride, head_offset + h * head_stride,
                                               block_size, head_dim);
                int64_t i = 0;
                for (; i + 16 <= run; i += 16) {
                    for (int64_t g = 0; g < group; ++g) {
                        __m512 partial[16];
                        for (int j = 0; j < 16; ++j) partial[j] = dot_bf16(k + (i + j) * head_dim, q[h * group + g], pairs);
                        _mm512_storeu_ps(scores + (h * group + g) * context_len + t + i, sum_lanes_of_16(partial));
                    }
                }
                for (; i < run; ++i)
                    for (int64_t g = 0; g < group; ++g)
                        scores[(h * group + g) * context_len + t + i] =
                            _mm512_reduce_add_ps(dot_bf16(k + i * head_dim, q[h * group + g], pairs));
            }
            t += run;
        }
        for (int64_t h = 0; h < heads; ++h)
            prefetch_block(value_cache, table, 0, context_len, block_stride, head_offset + h * head_stride, block_size,
                           head_dim);
        for (int64_t r = 0; r < rows; ++r) {
            float* row = scores + r * context_len;
            __m512 peak16 = _mm512_set1_ps(-std::numeric_limits<float>::max());
            for (int64_t t = 0; t < full; t += 16) peak16 = _mm512_max_ps(peak16, _mm512_loadu_ps(row + t));
            float peak = _mm512_reduce_max_ps(peak16);
            for (int64_t t = full; t < context_len; ++t) peak = std::max(peak, row[t]);
            const __m512 peaks = _mm512_set1_ps(peak);
            __m512 total16 = _mm512_setzero_ps();
            for (int64_t t = 0; t < context_len; t += 16) {
                const __mmask16 live = t + 16 <= context_len ? __mmask16(0xFFFF) : __mmask16((1u << (context_len - t)) - 1);
                const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + t), peaks));
                _mm512_mask_storeu_ps(row + t, live, e);
                total16 = _mm512_add_ps(total16, _mm512_maskz_mov_ps(live, e));
            }
            // The probabilities, normalised in float32 and rounded to bf16, over the first half of the row's
            // floats: each 16 written (32 bytes at 2t) only after they are read (64 bytes at 4t), and never over
            // floats still to be read.
            const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total16));
            uint16_t* probs = reinterpret_cast<uint16_t*>(row);
            for (int64_t t = 0; t < context_len; t += 16) {
                const __mmask16 live = t + 16 <= context_len ? __mmask16(0xFFFF) : __mmask16((1u << (context_len - t)) - 1);
                const __m256bh p = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + t), inverse));
                _mm256_mask_storeu_epi16(probs + t, live, (__m256i)p);
            }
            std::fill(first_out + r * head_dim, first_out + (r + 1) * head_dim, 0.f);
        }
        for (int64_t t = 0; t < context_len;) {
            const int64_t run = std::min(block_size - t % block_size, context_len - t);
            const int64_t next = (t / block_size + 1) * block_size;
            for (int64_t h = 0; h < heads && next < context_len; ++h)
                prefetch_block(value_cache, table, next, context_len, block_stride, head_offset + h * head_stride,
                               block_size, head_dim);
            for (int64_t h = 0; h < heads; ++h) {
                const uint16_t* v = block_rows(value_cache, table, t, block_stride, head_offset + h * head_stride,
                                               block_size, head_dim);
                add_value_pairs(reinterpret_cast<const uint16_t*>(scores + h * group * context_len) + t,
                                2 * context_len, v, run, head_dim, group, first_out + h * group * head_dim);
            }
            t += run;
        }
    }
}

// ---- decode attention over a bf16 cache on AMX tiles (Sapphire Rapids and later)
//
// Both products of a kv head's decode are tile multiplies (`tdpbf16ps`: bf16 pairs, exact products, float32
// sums). Scores: sixteen key rows are one tile read from the cache where they lie (A, 16 keys x 32 dims), the
// group's scaled queries rounded to bf16 are the other (B, laid out as pairs of dims per query), giving 16 keys x
// group scores. Values: the probabilities, normalized in float32 and rounded to bf16, are A (group rows x 32
// tokens) and 32 value rows interleaved by pairs of tokens are B (16 token pairs x 16 dims), giving the group's
// outputs for 16 dims. So the result is the attention of the bf16-rounded scaled query over the cache with the
// probabilities rounded to bf16 (as bf16 attention computes them), summed in float32.
#define PAGEWISE_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// AMX-BF16 and AMX-TILE (CPUID leaf 7, EDX bits 22 and 24), and the tile state granted to this process: Linux
// hands it out on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) before the first tile
// instruction, and refuses it where the kernel does not manage it.
bool cpu_has_amx_bf16() {
    static const bool has = [] {
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (!cpu_has_bf16_dot() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
        if (!((edx >> 22) & 1u) || !((edx >> 24) & 1u)) return false;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return has;
}

// The palette-1 tile configuration `ldtilecfg` reads: per tile register its rows and bytes per row.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    void set(int tile, int64_t tile_rows, int64_t bytes) {
        rows[tile] = static_cast<uint8_t>(tile_rows);
        colsb[tile] = static_cast<uint16_t>(bytes);
    }
};

// Floats of scratch `attend_sequence_amx` takes past its scores (the `tile` argument): value pairs, query pairs,
// a tile of scores, staged key rows and the probabilities in bf16.
inline int64_t amx_decode_scratch(int64_t num_heads, int64_t head_dim, int64_t longest) {
    return 4 * 256 + 4 * head_dim + 16 * 8 + 8 * head_dim + num_heads * (longest + 32) / 2 + 64;
}

// C(dst) += A(0) B(1) for the tile register `dst` chosen at run time (the instruction takes it as an immediate).
PAGEWISE_AMX inline void tile_accumulate(int dst) {
    switch (dst) {
        case 2: _tile_dpbf16ps(2, 0, 1); break;
        case 3: _tile_dpbf16ps(3, 0, 1); break;
        case 4: _tile_dpbf16ps(4, 0, 1); break;
        default: _tile_dpbf16ps(5, 0, 1); break;
    }
}

PAGEWISE_AMX inline void tile_zero(int dst) {
    switch (dst) {
        case 2: _tile_zero(2); break;
        case 3: _tile_zero(3); break;
        case 4: _tile_zero(4); break;
        default: _tile_zero(5); break;
    }
}

PAGEWISE_AMX inline void tile_store(int src, float* dst, int64_t stride) {
    switch (src) {
        case 2: _tile_stored(2, dst, stride); break;
        case 3: _tile_stored(3, dst, stride); break;
        case 4: _tile_stored(4, dst, stride); break;
        default: _tile_stored(5, dst, stride); break;
    }
}

// How far ahead (tokens) of the sixteen a pass computes it asks for rows; the first pass of a head asks for every
// row up to there. Measured on the AMX Xeon (`pagewise bench step --num-seqs 64 --contexts 1024`): 16, 64 and 128
// tokens ran alike (attention 117.5, 117.5, 115.4 ms).
constexpr int64_t AMX_AHEAD = 64;

// Asks for the (up to) sixteen rows of one kv head from token `t` (16-aligned) that lie in the context: their
// bytes within `t`'s block, and the next block's where a block holds fewer than sixteen.
inline void prefetch_rows(const uint16_t* cache, const int32_t* table, int64_t t, int64_t context_len,
                          int64_t block_stride, int64_t head_offset, int64_t block_size, int64_t head_dim) {
    for (int64_t u = t; u < std::min(t + 16, context_len); u += block_size - u % block_size) {
        const char* rows = reinterpret_cast<const char*>(
            block_rows(cache, table, u, block_stride, head_offset, block_size, head_dim));
        const int64_t bytes = std::min({block_size - u % block_size, t + 16 - u, context_len - u}) * head_dim * 2;
        for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(rows + line);
    }
}

// Decode attention of one sequence over a bf16 cache on AMX, every kv head; the shapes `bf16_dot_shapes` takes.
// `scores` holds num_heads * context_len + 16 floats, `tile` `amx_decode_scratch` floats; `queries` and `out`
// are the sequence's rows of every query head.
PAGEWISE_AMX
void attend_sequence_amx(const float* queries, const uint16_t* key_cache, const uint16_t* value_cache,
                         const int32_t* table, int64_t context_len, int64_t num_kv_heads, int64_t block_size,
                         int64_t head_dim, int64_t group, float scale, float* scores, float* tile, float* out) {
    const int64_t block_stride = num_kv_heads * block_size * head_dim, head_stride = block_size * head_dim;
    const int64_t padded = (context_len + 31) & ~int64_t{31};  // a value pass takes 32 tokens
    uint16_t* value_pairs = reinterpret_cast<uint16_t*>(tile);  // 4 tiles of 16 token pairs x 16 dims
    uint32_t* query_pairs = reinterpret_cast<uint32_t*>(value_pairs + 4 * 512);  // [head_dim / 32][16][group]
    float* key_scores = reinterpret_cast<float*>(query_pairs + head_dim / 2 * 8);  // 16 keys x group
    uint16_t* staged = reinterpret_cast<uint16_t*>(key_scores + 16 * 8);  // 16 key rows, small blocks only
    uint16_t* probs = staged + 16 * head_dim;  // [group][padded]
    static const uint16_t zeros[256] = {};
    const bool in_place = block_size % 16 == 0;  // sixteen keys from a 16-aligned token lie in one block
    TileConfig scoring, summing;
    scoring.set(0, 16, 64);         // 16 key rows x 32 dims
    scoring.set(1, 16, group * 4);  // 16 pairs of dims x the group's queries
    scoring.set(2, 16, group * 4);  // scores: 16 keys x group
    summing.set(0, group, 64);      // probabilities: group x 32 tokens
    summing.set(1, 16, 64);         // 16 pairs of tokens x 16 dims
    for (int t = 2; t < 6; ++t) summing.set(t, group, 64);  // outputs: group x 16 dims, four at a time
    const __m512i lane_pairs = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i interleave_low, interleave_high;  // token a's and token b's element d side by side
    {
        alignas(64) uint16_t low[32], high[32];
        for (int i = 0; i < 16; ++i) {
            low[2 * i] = i, low[2 * i + 1] = 32 + i;
            high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;
        }
        interleave_low = _mm512_load_si512(low), interleave_high = _mm512_load_si512(high);
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t head_offset = h * head_stride;
        const float* first_query = queries + h * group * head_dim;
        float* first_out = out + h * group * head_dim;
        for (int64_t g = 0; g < group; ++g)
            for (int64_t c = 0; c < head_dim / 32; ++c) {
                const float* row = first_query + g * head_dim + 32 * c;
                const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + 16), _mm512_set1_ps(scale)),
                                                                   _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_set1_ps(scale)));
                _mm512_i32scatter_epi32(query_pairs + c * 16 * group + g,
                                        _mm512_mullo_epi32(lane_pairs, _mm512_set1_epi32(group)), pairs, 4);
            }
        _tile_loadconfig(&scoring);
        const __m512i by_group = _mm512_mullo_epi32(lane_pairs, _mm512_set1_epi32(group));
        for (int64_t t = 0; t < context_len; t += 16) {
            for (int64_t ahead = t == 0 ? 0 : AMX_AHEAD; ahead <= AMX_AHEAD; ahead += 16)
                prefetch_rows(key_cache, table, t + ahead, context_len, block_stride, head_offset, block_size, head_dim);
            const int64_t live = std::min<int64_t>(16, context_len - t);
            const uint16_t* keys;
            if (in_place) {
                keys = block_rows(key_cache, table, t, block_stride, head_offset, block_size, head_dim);
            } else {
                for (int64_t i = 0; i < live; ++i)
                    std::memcpy(staged + i * head_dim,
                                block_rows(key_cache, table, t + i, block_stride, head_offset, block_size, head_dim),
                                head_dim * sizeof(uint16_t));
                keys = staged;
            }
            _tile_zero(2);
            for (int64_t c = 0; c < head_dim / 32; ++c) {
                _tile_loadd(0, keys + 32 * c, head_dim * sizeof(uint16_t));
                _tile_loadd(1, query_pairs + c * 16 * group, group * 4);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, key_scores, group * 4);
            const __mmask16 mask = live == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
            for (int64_t g = 0; g < group; ++g)
                _mm512_mask_storeu_ps(scores + g * context_len + t, mask,
                                      _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, by_group, key_scores + g, 4));
        }
        for (int64_t g = 0; g < group; ++g) {
            float* row = scores + g * context_len;
            __m512 peak16 = _mm512_set1_ps(-std::numeric_limits<float>::max());
            for (int64_t t = 0; t < context_len; t += 16) {
                const __mmask16 live = t + 16 <= context_len ? __mmask16(0xFFFF) : __mmask16((1u << (context_len - t)) - 1);
                peak16 = _mm512_mask_max_ps(peak16, live, peak16, _mm512_maskz_loadu_ps(live, row + t));
            }
            const __m512 peaks = _mm512_set1_ps(_mm512_reduce_max_ps(peak16));
            __m512 total16 = _mm512_setzero_ps();
            for (int64_t t = 0; t < context_len; t += 16) {
                const __mmask16 live = t + 16 <= context_len ? __mmask16(0xFFFF) : __mmask16((1u << (context_len - t)) - 1);
                const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + t), peaks)));
                _mm512_mask_storeu_ps(row + t, live, e);
                total16 = _mm512_add_ps(total16, e);
            }
            const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total16));
            for (int64_t t = 0; t < padded; t += 16) {  // zeros past the context: a value pass adds nothing there
                const __mmask16 live = t + 16 <= context_len ? __mmask16(0xFFFF)
                                       : t < context_len   ? __mmask16((1u << (context_len - t)) - 1)
                                                           : __mmask16(0);
                const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + t), inverse);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * padded + t), (__m256i)_mm512_cvtneps_pbh(p));
            }
        }
        _tile_loadconfig(&summing);
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            const int64_t outputs = std::min<int64_t>(4, (head_dim - d0) / 16);  // 2 or 4: head_dim % 32 == 0
            for (int64_t c = 0; c < outputs; ++c) tile_zero(2 + c);
            for (int64_t t0 = 0; t0 < padded; t0 += 32) {
                for (int64_t ahead = t0 == 0 ? 0 : AMX_AHEAD; ahead <= AMX_AHEAD; ahead += 16)
                    for (int64_t t = t0 + ahead; t < t0 + ahead + 32; t += 16)
                        prefetch_rows(value_cache, table, t, context_len, block_stride, head_offset, block_size, head_dim);
                for (int64_t p = 0; p < 16; ++p) {
                    const int64_t a = t0 + 2 * p, b = a + 1;
                    const uint16_t* row_a =
                        a < context_len ? block_rows(value_cache, table, a, block_stride, head_offset, block_size, head_dim) + d0
                                        : zeros;
                    const uint16_t* row_b =
                        b < context_len ? block_rows(value_cache, table, b, block_stride, head_offset, block_size, head_dim) + d0
                                        : zeros;
                    for (int64_t j = 0; j < outputs / 2; ++j) {
                        const __m512i va = _mm512_loadu_si512(row_a + 32 * j), vb = _mm512_loadu_si512(row_b + 32 * j);
                        _mm512_storeu_si512(value_pairs + (2 * j) * 512 + 32 * p, _mm512_permutex2var_epi16(va, interleave_low, vb));
                        _mm512_storeu_si512(value_pairs + (2 * j + 1) * 512 + 32 * p, _mm512_permutex2var_epi16(va, interleave_high, vb));
                    }
                }
                _tile_loadd(0, probs + t0, padded * sizeof(uint16_t));
                for (int64_t c = 0; c < outputs; ++c) {
                    _tile_loadd(1, value_pairs + c * 512, 64);
                    tile_accumulate(2 + c);
                }
            }
            for (int64_t c = 0; c < outputs; ++c) tile_store(2 + c, first_out + d0 + 16 * c, head_dim * sizeof(float));
        }
    }
    _tile_release();
}

// Decode attention of one sequence over a bf16 cache: on AMX tiles where the CPU has them, else with AVX512-BF16
// dot products; `tile` holds `bf16_decode_scratch` floats.
void attend_sequence_bf16(const float* queries, const uint16_t* key_cache, const uint16_t* value_cache,
                          const int32_t* table, int64_t context_len, int64_t num_kv_heads, int64_t block_size,
                          int64_t head_dim, int64_t group, float scale, float* scores, float* tile, float* out) {
    const auto attend = cpu_has_amx_bf16() ? attend_sequence_amx : attend_sequence_bf16_dot;
    attend(queries, key_cache, value_cache, table, context_len, num_kv_heads, block_size, head_dim, group, scale,
           scores, tile, out);
}

// The AMX kernel's scratch; the AVX512-BF16 one needs none past its scores.
inline int64_t bf16_decode_scratch(int64_t num_heads, int64_t head_dim, int64_t longest) {
    return cpu_has_amx_bf16() ? amx_decode_scratch(num_heads, head_dim, longest) : 0;
}

// ---- prefill attention over a bf16 cache (AVX512-BF16): a tile of a sequence's new tokens at once
//
// A decode row streams the cache once for a handful of query rows, so its cost is memory; a prefill chunk's
// tokens share their keys, so a tile of them takes each key once for all its query rows and the cost becomes
// arithmetic. The scores of one query row against sixteen keys are one register: the sixteen key rows are laid
// out as bf16 pairs per lane (key j's elements 2d and 2d+1 in lane j of register d), so each `vdpbf16ps` takes one
// pair of the query (broadcast) against one pair of sixteen keys and no horizontal sum is needed. Keys go
// `PREFILL_KEYS` at a time: every row's scores against them, then each row's softmax over them (the online one:
// a running peak and total per row, the partial output rescaled when the peak rises), then each row's value sum
// with its output held in registers: the pass's value rows are interleaved by pairs of tokens once for all the
// tile's rows, and each row's weights, rounded to bf16, go against them two tokens per `vdpbf16ps` (as decode's
// `add_value_pairs`). A row sees the keys up to its own position only. Numerically: the query times the scale
// rounded to bf16, exact bf16 products summed in float32 for the scores; per pass, each weight (the exp of its
// score less the row's running peak, in float32) rounded to bf16 against the bf16 values, float32 sums; the
// normaliser the float32 sum of the unrounded weights — bf16 attention's rounding of the probabilities, taken
// before the normalisation as online softmax must (decode rounds the normalised probabilities).
constexpr int64_t PREFILL_TILE = 32;   // query tokens per work unit
constexpr int64_t PREFILL_ROWS = 8;    // query rows whose scores are computed together (shared key registers)
constexpr int64_t PREFILL_KEYS = 256;  // keys per pass (a multiple of 16)

// o_r += sum over pairs i < n of (w_r[2i], w_r[2i + 1]) . (values' pair i) for R rows at once: row r's bf16
// weights at w + r * w_stride, its float32 output (16 * C dims) at o + r * 16 * C; `values` holds a pass's value
// rows interleaved by pairs of tokens (`interleave_value_pair`), C registers a pair. Each pair is loaded once for
// the R rows, and the R * C output vectors stay in registers across the pairs.
template <int C, int R>
PAGEWISE_BF16_DOT inline void add_shared_pairs(const uint16_t* w, int64_t w_stride, const uint16_t* values,
                                               int64_t n, float* o) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + (r * C + c) * 16);
    for (int64_t i = 0; i < n; ++i) {
        __m512bh pair[C];
        for (int c = 0; c < C; ++c) pair[c] = (__m512bh)_mm512_loadu_si512(values + (i * C + c) * 32);
        for (int r = 0; r < R; ++r) {
            const __m512bh weights = probability_pair(w + r * w_stride + 2 * i, true);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], weights, pair[c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + (r * C + c) * 16, acc[r][c]);
}

// Rows of C = head_dim / 16 output registers each that `add_shared_pairs` takes at once: as many as keep the
// outputs, one pair's registers and a weight pair within the 32 vector registers.
constexpr int shared_pair_rows(int C) { return C == 2 ? 8 : C == 4 ? 6 : C == 6 ? 4 : C == 8 ? 2 : 1; }

// `add_shared_pairs` for a group of `rows` <= `shared_pair_rows(C)` rows (row r's weights at w + r * w_stride, its
// output at o + r * 16 * C): all at once when the group is full, else one row at a time.
template <int C>
PAGEWISE_BF16_DOT inline void add_pairs_of(const uint16_t* w, int64_t w_stride, const uint16_t* values, int64_t n,
                                           int64_t rows, float* o) {
    constexpr int R = shared_pair_rows(C);
    if (rows == R) return add_shared_pairs<C, R>(w, w_stride, values, n, o);
    for (int64_t r = 0; r < rows; ++r) add_shared_pairs<C, 1>(w + r * w_stride, w_stride, values, n, o + r * 16 * C);
}

// `add_pairs_of` for a head of `chunks` (an even number up to 16) vectors of 16 floats.
PAGEWISE_BF16_DOT inline void add_pairs(const uint16_t* w, int64_t w_stride, const uint16_t* values, int64_t n,
                                        int64_t rows, int64_t chunks, float* o) {
    switch (chunks) {
        case 2: return add_pairs_of<2>(w, w_stride, values, n, rows, o);
        case 4: return add_pairs_of<4>(w, w_stride, values, n, rows, o);
        case 6: return add_pairs_of<6>(w, w_stride, values, n, rows, o);
        case 8: return add_pairs_of<8>(w, w_stride, values, n, rows, o);
        case 10: return add_pairs_of<10>(w, w_stride, values, n, rows, o);
        case 12: return add_pairs_of<12>(w, w_stride, values, n, rows, o);
        case 14: return add_pairs_of<14>(w, w_stride, values, n, rows, o);
        default: return add_pairs_of<16>(w, w_stride, values, n, rows, o);
    }
}

// Per-thread buffers of `prefill_unit_bf16_dot` for tiles of up to `PREFILL_TILE` tokens of `group` query rows.
struct PrefillScratch {
    std::vector<uint32_t> queries;  // rows x head_dim / 2: bf16 pairs
    std::vector<float> peak, total, out;
    std::vector<float> scores;      // rows x PREFILL_KEYS: then each row's bf16 weights over its first half
    std::vector<uint32_t> keys;     // head_dim / 2 registers of 16 lanes
    std::vector<uint16_t> values;   // PREFILL_KEYS / 2 pairs of value rows, interleaved (`interleave_value_pair`)
    PrefillScratch(int64_t group, int64_t head_dim)
        : queries(PREFILL_TILE * group * head_dim / 2), peak(PREFILL_TILE * group), total(PREFILL_TILE * group),
          out(PREFILL_TILE * group * head_dim), scores(PREFILL_TILE * group * PREFILL_KEYS), keys(8 * head_dim),
          values(PREFILL_KEYS * head_dim) {}
};

// The `tokens` query tokens of one tile (token i's row of query head kv_head * group + g at
// `query + i * query_stride + g * head_dim`, its output at `out + i * out_stride + g * head_dim`) attend over the cache's tokens
// 0 .. first_pos + i (first_pos: the position of the tile's first token). head_dim a multiple of 32, at most 256.
PAGEWISE_BF16_DOT
void prefill_unit_bf16_dot(const float* query, int64_t query_stride, const uint16_t* key_cache,
                           const uint16_t* value_cache, const int32_t* table, int64_t first_pos, int64_t tokens,
                           int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                           int64_t group, float scale, PrefillScratch& scratch, float* out, int64_t out_stride) {
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t head_offset = kv_head * block_size * head_dim;
    const int64_t rows = tokens * group, pairs = head_dim / 2, chunks = head_dim / 16;
    uint32_t* q = scratch.queries.data();
    float *peak = scratch.peak.data(), *total = scratch.total.data(), *o = scratch.out.data();
    float* s = scratch.scores.data();
    uint32_t* kt = scratch.keys.data();
    uint16_t* v = scratch.values.data();
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = query + (r / group) * query_stride + (r % group) * head_dim;
        for (int64_t c = 0; c < head_dim; c += 32)
            _mm512_storeu_si512(q + r * pairs + c / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + c + 16), _mm512_set1_ps(scale)),
                                                            _mm512_mul_ps(_mm512_loadu_ps(row + c), _mm512_set1_ps(scale))));
        peak[r] = -std::numeric_limits<float>::max();
        total[r] = 0.f;
        std::fill(o + r * head_dim, o + (r + 1) * head_dim, 0.f);
    }
    const int64_t last = first_pos + tokens - 1;  // the tile's last token sees keys 0 .. last
    for (int64_t k0 = 0; k0 <= last; k0 += PREFILL_KEYS) {
        const int64_t kn = std::min(PREFILL_KEYS, last + 1 - k0);
        // Rows before token k0 - first_pos see none of these keys (a row's position grows with its token).
        const int64_t first_row = std::max<int64_t>(0, k0 - first_pos) * group;
        auto seen = [&](int64_t r) { return std::min(kn, first_pos + r / group - k0 + 1); };
        for (int64_t kb = 0; kb < kn; kb += 16) {
            const int64_t n = std::min<int64_t>(16, kn - kb);
            for (int64_t j = 0; j < 16; ++j) {
                if (j < n) {
                    const int64_t t = k0 + kb + j;
                    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(
                        block_rows(key_cache, table, t, block_stride, head_offset, block_size, head_dim));
                    for (int64_t d = 0; d < pairs; ++d) kt[d * 16 + j] = k32[d];
                } else {  // lanes past the keys: scores never read
                    for (int64_t d = 0; d < pairs; ++d) kt[d * 16 + j] = 0;
                }
            }
            for (int64_t j = 0; j < n; j += 2) {  // an odd last key pairs with zeros (its partner's weight is 0)
                const int64_t t = k0 + kb + j;
                const uint16_t* a = block_rows(value_cache, table, t, block_stride, head_offset, block_size, head_dim);
                const uint16_t* b = j + 1 < n ? block_rows(value_cache, table, t + 1, block_stride, head_offset,
                                                           block_size, head_dim)
                                              : nullptr;
                uint16_t* dst = v + (kb + j) / 2 * 2 * head_dim;
                for (int64_t c = 0; c < head_dim; c += 32) {
                    const ValuePairs both = interleave_value_pair(_mm512_loadu_si512(a + c),
                                                                  b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512());
                    _mm512_storeu_si512(dst + 2 * c, (__m512i)both.lo);
                    _mm512_storeu_si512(dst + 2 * c + 32, (__m512i)both.hi);
                }
            }
            // Rows that see none of this block's keys are skipped too.
            const int64_t from = std::max(first_row, std::max<int64_t>(0, k0 + kb - first_pos) * group);
            for (int64_t r0 = from; r0 < rows; r0 += PREFILL_ROWS) {
                __m512 acc[PREFILL_ROWS][2];
                for (int i = 0; i < PREFILL_ROWS; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
                for (int64_t d = 0; d < pairs; ++d) {
                    const __m512bh keys = (__m512bh)_mm512_loadu_si512(kt + d * 16);
                    for (int i = 0; i < PREFILL_ROWS; ++i) {  // past the rows: a real row, its scores unused
                        const int64_t r = std::min(r0 + i, rows - 1);
                        const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + d]));
                        acc[i][d & 1] = _mm512_dpbf16_ps(acc[i][d & 1], pair, keys);
                    }
                }
                for (int64_t i = 0; i < PREFILL_ROWS && r0 + i < rows; ++i)
                    _mm512_storeu_ps(s + (r0 + i) * PREFILL_KEYS + kb, _mm512_add_ps(acc[i][0], acc[i][1]));
            }
        }
        for (int64_t r = first_row; r < rows; ++r) {
            float* row = s + r * PREFILL_KEYS;
            // The bf16 weights over the row's first half: 16 written at 2t after the 16 floats at 4t were read.
            uint16_t* weights = reinterpret_cast<uint16_t*>(row);
            const int64_t count = seen(r), full = count & ~int64_t{15};
            const __mmask16 tail = static_cast<__mmask16>((1u << (count - full)) - 1);
            __m512 peak16 = _mm512_set1_ps(-std::numeric_limits<float>::max());
            for (int64_t t = 0; t < full; t += 16) peak16 = _mm512_max_ps(peak16, _mm512_loadu_ps(row + t));
            if (tail) peak16 = _mm512_mask_max_ps(peak16, tail, peak16, _mm512_maskz_loadu_ps(tail, row + full));
            const float old_peak = peak[r], new_peak = std::max(old_peak, _mm512_reduce_max_ps(peak16));
            const __m512 peaks = _mm512_set1_ps(new_peak);
            __m512 sum16 = _mm512_setzero_ps();
            for (int64_t t = 0; t < kn; t += 16) {  // weights past the row's keys are 0 (rows share value sums)
                const __mmask16 live = t < full ? __mmask16(0xFFFF) : t == full ? tail : __mmask16(0);
                const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + t), peaks)));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + t), (__m256i)_mm512_cvtneps_pbh(e));
                sum16 = _mm512_add_ps(sum16, e);
            }
            if (new_peak > old_peak && total[r] > 0.f) {  // rescale what was summed under the old peak
                const float shrink = std::exp(old_peak - new_peak);
                total[r] *= shrink;
                float* out_row = o + r * head_dim;
                for (int64_t c = 0; c < chunks; ++c)
                    _mm512_storeu_ps(out_row + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(out_row + 16 * c), _mm512_set1_ps(shrink)));
            }
            peak[r] = new_peak;
            total[r] += _mm512_reduce_add_ps(sum16);
        }
        // Rows in groups `add_pairs` takes at once, each group up to the keys its last row sees (the most).
        const int64_t shared = shared_pair_rows(static_cast<int>(chunks));
        for (int64_t r = first_row; r < rows; r += shared) {
            const int64_t m = std::min(shared, rows - r), count = seen(r + m - 1);
            add_pairs(reinterpret_cast<const uint16_t*>(s + r * PREFILL_KEYS), 2 * PREFILL_KEYS, v, (count + 1) / 2, m,
                      chunks, o + r * head_dim);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 inverse = _mm512_set1_ps(1.f / total[r]);
        float* dst = out + (r / group) * out_stride + (r % group) * head_dim;
        for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + r * head_dim + 16 * c), inverse));
    }
}
#endif

#if defined(__x86_64__)
// ---- AVX2 and FMA (every x86-64 CPU of this kind): decode attention over a float32 cache on CPUs without AVX-512,
// and the float32 loop of the few-rows product
#define PAGEWISE_AVX2_FMA __attribute__((target("avx2,fma")))

bool cpu_has_avx2_fma() {
    static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return has;
}

// Lane j of the result: the sum of the eight lanes of v[j].
PAGEWISE_AVX2_FMA inline __m256 sum_lanes_of_8(const __m256* v) {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]; twice gives, per 128-bit half, one
    // partial sum of each of four vectors, and the halves' sums are the totals
    const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

PAGEWISE_AVX2_FMA inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

PAGEWISE_AVX2_FMA inline float max_lanes(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// e^x for x <= 0 as `exp_nonpositive`, 2^n made from its exponent bits: x >= -87 keeps n >= -126, a normal float.
PAGEWISE_AVX2_FMA inline __m256 exp_nonpositive_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LOW), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HIGH), x));
    __m256 p = _mm256_set1_ps(EXP_TAYLOR[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_TAYLOR[i]));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// o[0 .. 8C) += sum over j < rows of p[j] * v[j * stride .. + 8C): the C output vectors held in registers across
// the rows.
template <int C>
PAGEWISE_AVX2_FMA inline void accumulate_f32_rows_of(const float* p, const float* v, int64_t rows, int64_t stride,
                                                     float* o) {
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_loadu_ps(o + 8 * c);
    for (int64_t j = 0; j < rows; ++j) {
        const __m256 weight = _mm256_set1_ps(p[j]);
        for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + j * stride + 8 * c), acc[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
}

// `accumulate_f32_rows_of` over a whole head (head_dim a multiple of 8), eight vectors at a time.
PAGEWISE_AVX2_FMA inline void accumulate_f32_rows(const float* p, const float* v, int64_t rows, int64_t head_dim,
                                                  float* o) {
    int64_t d = 0;
    for (; d + 64 <= head_dim; d += 64) accumulate_f32_rows_of<8>(p, v + d, rows, head_dim, o + d);
    switch ((head_dim - d) / 8) {
        case 1: return accumulate_f32_rows_of<1>(p, v + d, rows, head_dim, o + d);
        case 2: return accumulate_f32_rows_of<2>(p, v + d, rows, head_dim, o + d);
        case 3: return accumulate_f32_rows_of<3>(p, v + d, rows, head_dim, o + d);
        case 4: return accumulate_f32_rows_of<4>(p, v + d, rows, head_dim, o + d);
        case 5: return accumulate_f32_rows_of<5>(p, v + d, rows, head_dim, o + d);
        case 6: return accumulate_f32_rows_of<6>(p, v + d, rows, head_dim, o + d);
        case 7: return accumulate_f32_rows_of<7>(p, v + d, rows, head_dim, o + d);
        default: return;
    }
}

// One (sequence, kv head) unit as `attend_body`, for a float32 cache with head_dim a multiple of 8, on AVX2: the
// scores of eight tokens at a time per query head (eight accumulators over the head's vectors, the query vector
// loaded once for the eight, reduced together by `sum_lanes_of_8`; the portable body reduces every token's sum
// on its own), the scale folded into the query first, a vectorized softmax, and the values accumulated into
// output vectors held in registers across a block's rows. `scores` holds group * context_len floats,
// `scaled` group * head_dim.
PAGEWISE_AVX2_FMA
void attend_unit_f32_avx2(const float* queries, const float* key_cache, const float* value_cache,
                          const int32_t* table, int64_t context_len, int64_t kv_head, int64_t num_kv_heads,
                          int64_t block_size, int64_t head_dim, int64_t group, float scale, float* scores,
                          float* scaled, float* out) {
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t head_offset = kv_head * block_size * head_dim;
    for (int64_t i = 0; i < group * head_dim; ++i) scaled[i] = queries[i] * scale;
    for (int64_t t = 0; t < context_len;) {
        const float* k = block_rows(key_cache, table, t, block_stride, head_offset, block_size, head_dim);
        const int64_t run = std::min(block_size - t % block_size, context_len - t);
        prefetch_ahead(key_cache, table, t, context_len, block_stride, head_offset, block_size, head_dim);
        int64_t i = 0;
        for (; i + 8 <= run; i += 8) {
            const float* rows = k + i * head_dim;
            for (int64_t g = 0; g < group; ++g) {
                const float* q = scaled + g * head_dim;
                __m256 acc[8];
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 8) {
                    const __m256 qd = _mm256_loadu_ps(q + d);
                    for (int j = 0; j < 8; ++j)
                        acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows + j * head_dim + d), acc[j]);
                }
                _mm256_storeu_ps(scores + g * context_len + t + i, sum_lanes_of_8(acc));
            }
        }
        for (; i < run; ++i)
            for (int64_t g = 0; g < group; ++g) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(scaled + g * head_dim + d),
                                          _mm256_loadu_ps(k + i * head_dim + d), acc);
                scores[g * context_len + t + i] = sum_lanes(acc);
            }
        t += run;
    }
    prefetch_block(value_cache, table, 0, context_len, block_stride, head_offset, block_size, head_dim);
    const int64_t full = context_len & ~int64_t{7};
    for (int64_t g = 0; g < group; ++g) {
        float* row = scores + g * context_len;
        __m256 peak8 = _mm256_set1_ps(-std::numeric_limits<float>::max());
        for (int64_t t = 0; t < full; t += 8) peak8 = _mm256_max_ps(peak8, _mm256_loadu_ps(row + t));
        float peak = max_lanes(peak8);
        for (int64_t t = full; t < context_len; ++t) peak = std::max(peak, row[t]);
        const __m256 peaks = _mm256_set1_ps(peak);
        __m256 total8 = _mm256_setzero_ps();
        for (int64_t t = 0; t < full; t += 8) {
            const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + t), peaks));
            _mm256_storeu_ps(row + t, e);
            total8 = _mm256_add_ps(total8, e);
        }
        float total = sum_lanes(total8);
        for (int64_t t = full; t < context_len; ++t) total += row[t] = std::exp(row[t] - peak);
        const float inverse = 1.f / total;
        const __m256 inverse8 = _mm256_set1_ps(inverse);
        for (int64_t t = 0; t < full; t += 8) _mm256_storeu_ps(row + t, _mm256_mul_ps(_mm256_loadu_ps(row + t), inverse8));
        for (int64_t t = full; t < context_len; ++t) row[t] *= inverse;
        std::fill(out + g * head_dim, out + (g + 1) * head_dim, 0.f);
    }
    for (int64_t t = 0; t < context_len;) {
        const float* v = block_rows(value_cache, table, t, block_stride, head_offset, block_size, head_dim);
        const int64_t run = std::min(block_size - t % block_size, context_len - t);
        prefetch_ahead(value_cache, table, t, context_len, block_stride, head_offset, block_size, head_dim);
        for (int64_t g = 0; g < group; ++g)
            accumulate_f32_rows(scores + g * context_len + t, v, run, head_dim, out + g * head_dim);
        t += run;
    }
}
#endif

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

// `work(i, state)` for every i < count on the pool's threads, each thread with its own `state` (from
// `make_state()`), taking the next i from a shared counter rather than a fixed share: the items' costs differ
// (sequences' lengths, tiles' key counts), and a thread the OS takes away for a while (another process woke on
// its core) leaves its items to the others instead of holding them all up.
template <typename MakeState, typename Work>
void claim_in_turn(int64_t count, MakeState make_state, Work work) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
        auto state = make_state();
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) work(i, state);
    });
}

// The shapes the AVX512-BF16 attention loops take: head_dim a multiple of 32 up to 256, at most 8 query heads per
// kv head.
inline bool bf16_dot_shapes(int64_t head_dim, int64_t group) {
    return head_dim % 32 == 0 && head_dim <= 256 && group <= 8;
}

// The query's [tokens, heads, head_dim] rows as given where each token's heads lie side by side (the QKV split's
// view, token rows strided), else a contiguous copy.
at::Tensor query_rows(const at::Tensor& query) {
    return query.stride(2) == 1 && query.stride(1) == query.size(2) ? query : query.contiguous();
}

// The attention ops take a float32 or bf16 query (a bf16 projection's output) and give their result in its
// dtype; they compute in float32. A bf16 query's rows are widened once (exactly) into float32 rows side by side,
// and the float32 result is rounded once to nearest even: so a bf16 query's result is bit for bit the float32
// query's rounded.
void check_query(const at::Tensor& query, const char* shape) {
    TORCH_CHECK((query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) && query.dim() == 3,
                "query must be float32 or bfloat16 ", shape);
}

at::Tensor float_query(const at::Tensor& query) {
    if (query.scalar_type() == at::kFloat) return query_rows(query);
    const auto rows = query.stride(2) == 1 ? query : query.contiguous();
    auto q = at::empty(rows.sizes(), rows.options().dtype(at::kFloat));
    const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2);
    const uint16_t* src = elements<const uint16_t>(rows);
    float* dst = q.data_ptr<float>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
            for (int64_t h = 0; h < heads; ++h)
                widen_row(src + t * rows.stride(0) + h * rows.stride(1), dim, dst + (t * heads + h) * dim);
    });
    return q;
}

at::Tensor in_query_dtype(const at::Tensor& out, const at::Tensor& query) {
    if (query.scalar_type() == at::kFloat) return out;
    auto narrowed = at::empty(out.sizes(), out.options().dtype(at::kBFloat16));
    const int64_t tokens = out.size(0), row = out.numel() / std::max<int64_t>(tokens, 1);
    const float* src = out.data_ptr<float>();
    uint16_t* dst = elements<uint16_t>(narrowed);
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
        bf16_row(src + begin * row, (end - begin) * row, dst + begin * row);
    });
    return narrowed;
}

// query [num_seqs, num_heads, head_dim]: one token per sequence, at position seq_lens[s] - 1 (already cached).
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
    check_caches(key_cache, value_cache);
    check_query(query, "[seqs, heads, dim]");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2, "block_tables must be int32 2-D");
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1, "seq_lens must be int32 1-D");
    const auto q = float_query(query);
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
    auto out = at::empty(q.sizes(), q.options());
    const float* q_ptr = q.data_ptr<float>();
    const int32_t* table_ptr = tables.data_ptr<int32_t>();
    float* out_ptr = out.data_ptr<float>();
    const int64_t longest = *std::max_element(len_ptr, len_ptr + num_seqs);
    // Every (sequence, kv head) unit through `attend` (a unit function: they share one signature), a sequence (all
    // its kv heads, whose rows lie side by side in each block) at a time, each thread with a scores buffer of
    // `scores_size` floats and a scratch one of `scratch_size`.
    auto attend_units = [&](auto attend, const auto* k_ptr, const auto* v_ptr, int64_t scores_size,
                            int64_t scratch_size) {
        auto buffers = [&] { return std::pair(std::vector<float>(scores_size), std::vector<float>(scratch_size)); };
        claim_in_turn(num_seqs, buffers, [&](int64_t s, auto& state) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                const int64_t heads = h * group * head_dim;
                attend(q_ptr + s * q.stride(0) + heads, k_ptr, v_ptr, table_ptr + s * max_blocks, len_ptr[s], h,
                       num_kv_heads, block_size, head_dim, group, static_cast<float>(scale), state.first.data(),
                       state.second.data(), out_ptr + s * num_heads * head_dim + heads);
            }
        });
    };
    auto portable = [](auto... args) { attend_unit(args...); };
    if (key_cache.scalar_type() == at::kBFloat16) {
        const uint16_t* k_ptr = elements<const uint16_t>(key_cache);
        const uint16_t* v_ptr = elements<const uint16_t>(value_cache);
#if defined(__x86_64__)
        if (cpu_has_bf16_dot() && bf16_dot_shapes(head_dim, group)) {
            auto buffers = [&] {
                return std::pair(std::vector<float>(num_heads * longest + 16),
                                 std::vector<float>(bf16_decode_scratch(num_heads, head_dim, longest)));
            };
            claim_in_turn(num_seqs, buffers, [&](int64_t s, auto& state) {
                attend_sequence_bf16(q_ptr + s * q.stride(0), k_ptr, v_ptr, table_ptr + s * max_blocks, len_ptr[s],
                                         num_kv_heads, block_size, head_dim, group, static_cast<float>(scale),
                                         state.first.data(), state.second.data(), out_ptr + s * num_heads * head_dim);
            });
            return in_query_dtype(out, query);
        }
#endif
        attend_units(portable, k_ptr, v_ptr, group * longest, 16 * head_dim);
    } else {
        const float* k_ptr = elements<const float>(key_cache);
        const float* v_ptr = elements<const float>(value_cache);
#if defined(__x86_64__)
        if (!cpu_has_avx512() && cpu_has_avx2_fma() && head_dim % 8 == 0) {
            attend_units(attend_unit_f32_avx2, k_ptr, v_ptr, group * longest, group * head_dim);
            return in_query_dtype(out, query);
        }
#endif
        attend_units(portable, k_ptr, v_ptr, group * longest, 16 * head_dim);
    }
    return in_query_dtype(out, query);
}

// query [num_tokens, num_heads, head_dim]: sequence s's new tokens are rows query_start_loc[s] ..
// query_start_loc[s + 1] - 1, at the last positions of its seq_lens[s] cached tokens (written before this call).
// A step of decodes and prefill chunks together, over a bf16 cache on a CPU with AVX512-BF16: a decoding
// sequence (one new token) is one unit for the decode kernel (all its kv heads), a prefill chunk is one unit per
// kv head and tile of `PREFILL_TILE` tokens. The threads take units from a shared counter, costliest first.
at::Tensor paged_attention_mixed(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 const at::Tensor& query_start_loc, double scale) {
#if defined(__x86_64__)
    check_caches(key_cache, value_cache);
    TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16 && cpu_has_bf16_dot(),
                "paged_attention_mixed takes a bf16 cache on a CPU with AVX512-BF16");
    check_query(query, "[tokens, heads, dim]");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2, "block_tables must be int32 2-D");
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1, "seq_lens must be int32 1-D");
    TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1,
                "query_start_loc must be int32 1-D");
    const auto q = float_query(query);
    const auto tables = block_tables.contiguous();
    const auto lens = seq_lens.contiguous();
    const auto starts = query_start_loc.contiguous();
    const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t num_seqs = lens.size(0), num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
    TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "query and cache shapes disagree");
    const int64_t group = num_heads / num_kv_heads, max_blocks = tables.size(1);
    TORCH_CHECK(bf16_dot_shapes(head_dim, group),
                "paged_attention_mixed takes head_dim a multiple of 32 up to 256 and up to 8 query heads per kv head");
    TORCH_CHECK(tables.size(0) == num_seqs && starts.size(0) == num_seqs + 1,
                "one block table and length per sequence, num_seqs + 1 query starts");
    const int32_t* len_ptr = lens.data_ptr<int32_t>();
    const int32_t* start_ptr = starts.data_ptr<int32_t>();
    TORCH_CHECK(start_ptr[0] == 0 && start_ptr[num_seqs] == num_tokens, "query_start_loc must span the query rows");
    struct Unit {
        int64_t seq, kv_head, first, tokens, cost;  // kv_head -1: a decode, all its kv heads
    };
    std::vector<Unit> units;
    int64_t longest = 1;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = start_ptr[s + 1] - start_ptr[s], len = len_ptr[s];
        TORCH_CHECK(q_len >= 0 && len >= q_len && len <= max_blocks * block_size,
                    "each sequence's query rows must lie in its context, and the context in its block table");
        longest = std::max(longest, len);
        if (q_len == 1) {
            units.push_back({s, -1, 0, 1, num_heads * len});
        } else {
            for (int64_t h = 0; h < num_kv_heads; ++h)
                for (int64_t i = 0; i < q_len; i += PREFILL_TILE) {
                    const int64_t tokens = std::min(PREFILL_TILE, q_len - i), first_pos = len - q_len + i;
                    units.push_back({s, h, i, tokens, group * tokens * (first_pos + tokens)});
                }
        }
    }
    std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
    auto out = at::empty(q.sizes(), q.options());
    const float* q_ptr = q.data_ptr<float>();
    const int32_t* table_ptr = tables.data_ptr<int32_t>();
    float* out_ptr = out.data_ptr<float>();
    const uint16_t* k_ptr = elements<const uint16_t>(key_cache);
    const uint16_t* v_ptr = elements<const uint16_t>(value_cache);
    const int64_t num_units = static_cast<int64_t>(units.size()), q_stride = q.stride(0), out_stride = num_heads * head_dim;
    const float scale_f = static_cast<float>(scale);
    struct Buffers {
        std::vector<float> scores, tile;
        PrefillScratch prefill;
    };
    auto buffers = [&] {
        return Buffers{std::vector<float>(num_heads * longest + 16),
                       std::vector<float>(bf16_decode_scratch(num_heads, head_dim, longest)),
                       PrefillScratch(group, head_dim)};
    };
    claim_in_turn(num_units, buffers, [&](int64_t u, Buffers& state) {
        const Unit& unit = units[u];
        const int32_t* table = table_ptr + unit.seq * max_blocks;
        const int64_t len = len_ptr[unit.seq], token = start_ptr[unit.seq] + unit.first;
        if (unit.kv_head < 0) {
            attend_sequence_bf16(q_ptr + token * q_stride, k_ptr, v_ptr, table, len, num_kv_heads, block_size,
                                 head_dim, group, scale_f, state.scores.data(), state.tile.data(),
                                 out_ptr + token * out_stride);
        } else {
            const int64_t q_len = start_ptr[unit.seq + 1] - start_ptr[unit.seq];
            const int64_t heads = unit.kv_head * group * head_dim;
            prefill_unit_bf16_dot(q_ptr + token * q_stride + heads, q_stride, k_ptr, v_ptr, table,
                                  len - q_len + unit.first, unit.tokens, unit.kv_head, num_kv_heads, block_size,
                                  head_dim, group, scale_f, state.prefill, out_ptr + token * out_stride + heads,
                                  out_stride);
        }
    });
    return in_query_dtype(out, query);
#else
    TORCH_CHECK(false, "paged_attention_mixed needs an x86-64 CPU");
#endif
}

// One cache row: `n` float32 or bf16 activations stored as the cache's element (rounded to nearest even from
// float32 to bf16, widened exactly from bf16 to float32); a plain loop, built for several instruction sets so it is
// vectorized.
PAGEWISE_CLONES void store_row(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
void store_row(const float* src, int64_t n, uint16_t* dst) { bf16_row(src, n, dst); }
void store_row(const uint16_t* src, int64_t n, uint16_t* dst) { bf16_row(src, n, dst); }
void store_row(const uint16_t* src, int64_t n, float* dst) { widen_row(src, n, dst); }

// Tokens per thread of the cache write: a decode step's few tokens are written by one thread, a prefill chunk's
// by all.
constexpr int64_t WRITE_GRAIN = 256;

// Token i's key and value rows of every kv head (at src + i * token_stride + h * head_stride, head_dim elements
// each) into slot `slots[i]` of caches of element `T`; slot -1 skipped.
template <typename S, typename T>
void write_slots(const S* src_k, const S* src_v, int64_t k_token_stride, int64_t v_token_stride,
                 int64_t k_head_stride, int64_t v_head_stride, const int64_t* slots, int64_t num_tokens,
                 int64_t num_kv_heads, int64_t block_size, int64_t head_dim, T* dst_k, T* dst_v) {
    at::parallel_for(0, num_tokens, WRITE_GRAIN, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t slot = slots[i];
            if (slot < 0) continue;
            const int64_t block = slot / block_size, offset = slot % block_size;
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
                store_row(src_k + i * k_token_stride + h * k_head_stride, head_dim, dst_k + dst);
                store_row(src_v + i * v_token_stride + h * v_head_stride, head_dim, dst_v + dst);
            }
        }
    });
}

// key/value [num_tokens, num_kv_heads, head_dim], float32 or both bf16 (each row contiguous; the tokens and heads
// may be strided, as the QKV projection's split leaves them) into their slots; slot -1 is skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
    check_caches(key_cache, value_cache);
    const bool bf16 = key.scalar_type() == at::kBFloat16;
    TORCH_CHECK((bf16 || key.scalar_type() == at::kFloat) && value.scalar_type() == key.scalar_type(),
                "key/value must be float32 or both bfloat16");
    TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [tokens, kv_heads, head_dim]");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
    const auto k = key.stride(2) == 1 ? key : key.contiguous();
    const auto v = value.stride(2) == 1 ? value : value.contiguous();
    const auto slots = slot_mapping.contiguous();
    const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
    const int64_t block_size = key_cache.size(2), num_slots = key_cache.size(0) * block_size;
    TORCH_CHECK(key_cache.size(1) == num_kv_heads && key_cache.size(3) == head_dim && slots.size(0) == num_tokens,
                "key/value, cache and slot_mapping shapes disagree");
    const int64_t* slot_ptr = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_tokens; ++i) {
        TORCH_CHECK(slot_ptr[i] >= -1 && slot_ptr[i] < num_slots, "slot_mapping out of the cache");
    }
    auto write = [&](const auto* src_k, const auto* src_v) {
        auto into = [&](auto* dst_k, auto* dst_v) {
            write_slots(src_k, src_v, k.stride(0), v.stride(0), k.stride(1), v.stride(1), slot_ptr, num_tokens,
                        num_kv_heads, block_size, head_dim, dst_k, dst_v);
        };
        if (key_cache.scalar_type() == at::kBFloat16) into(elements<uint16_t>(key_cache), elements<uint16_t>(value_cache));
        else into(elements<float>(key_cache), elements<float>(value_cache));
    };
    if (bf16) write(elements<const uint16_t>(k), elements<const uint16_t>(v));
    else write(k.data_ptr<float>(), v.data_ptr<float>());
}

// ---- fused per-token ops (computed in float32, one parallel pass over rows)
//
// Activations between two projections may be bf16 (under dtype auto, where the projections run in bf16): such a
// row is widened to float32 on load and rounded to nearest even on store, inside the op's own loop, so the
// result is bit for bit the float32 op followed by torch's conversion, without a separate pass over the row.

template <typename Out>
inline __attribute__((always_inline)) void rms_norm_body(const float* x, const float* weight, float eps,
                                                         int64_t size, Out* out) {
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < size; ++i) squares += x[i] * x[i];
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) narrow(weight[i] * (x[i] * inverse), out + i);
}

PAGEWISE_CLONES
void rms_norm_row(const float* x, const float* weight, float eps, int64_t size, float* out) {
    rms_norm_body(x, weight, eps, size, out);
}

PAGEWISE_CLONES
void rms_norm_row(const float* x, const float* weight, float eps, int64_t size, uint16_t* out) {
    rms_norm_body(x, weight, eps, size, out);
}

// out = weight * x / sqrt(mean(x^2) + eps), row by row over the last dimension of a 2-D float32 x; the result in
// `out_dtype` (float32, the default, or bfloat16: the float32 result rounded to nearest even).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, std::optional<at::ScalarType> out_dtype) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2,
                "rms_norm takes a float32 [rows, size] input and weight");
    TORCH_CHECK(weight.numel() == x.size(1), "rms_norm weight size differs from the rows'");
    const at::ScalarType dtype = out_dtype.value_or(at::kFloat);
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rms_norm writes float32 or bfloat16");
    const auto in = x.contiguous();
    const auto w = weight.contiguous();
    auto out = at::empty(in.sizes(), in.options().dtype(dtype));
    const int64_t rows = in.size(0), size = in.size(1);
    const float *in_ptr = in.data_ptr<float>(), *w_ptr = w.data_ptr<float>();
    auto norm_all = [&](auto* out_ptr) {
        at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r)
                rms_norm_row(in_ptr + r * size, w_ptr, static_cast<float>(eps), size, out_ptr + r * size);
        });
    };
    if (dtype == at::kBFloat16) {
        norm_all(reinterpret_cast<uint16_t*>(out.data_ptr()));
    } else {
        norm_all(out.data_ptr<float>());
    }
    return out;
}

template <typename T>
inline __attribute__((always_inline)) void add_rows_body(float* residual, const T* delta, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) residual[i] += widen(delta[i]);
}

PAGEWISE_CLONES
void add_rows(float* residual, const float* delta, int64_t n) { add_rows_body(residual, delta, n); }

PAGEWISE_CLONES
void add_rows(float* residual, const uint16_t* delta, int64_t n) { add_rows_body(residual, delta, n); }

// residual += delta in place: a contiguous float32 residual stream and a delta of its shape in float32 or bfloat16
// (widened exactly), so a bf16 projection's output joins the stream without a converted copy.
void residual_add(at::Tensor& residual, const at::Tensor& delta) {
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous(),
                "residual_add takes a contiguous float32 residual");
    TORCH_CHECK(delta.sizes() == residual.sizes() &&
                    (delta.scalar_type() == at::kFloat || delta.scalar_type() == at::kBFloat16),
                "residual_add takes a float32 or bfloat16 delta of the residual's shape");
    const auto d = delta.contiguous();
    float* r_ptr = residual.data_ptr<float>();
    const int64_t n = residual.numel();
    auto add_all = [&](const auto* d_ptr) {
        at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
            add_rows(r_ptr + begin, d_ptr + begin, end - begin);
        });
    };
    if (d.scalar_type() == at::kBFloat16) {
        add_all(reinterpret_cast<const uint16_t*>(d.data_ptr()));
    } else {
        add_all(d.data_ptr<float>());
    }
}

// The order of a float32's or bf16's bits as an int32: a larger value has a larger key, -0 and +0 share one, and
// every NaN sits above +inf (torch's max and argmax return a NaN's index). Integer compares stay exact under
// -ffast-math, which may drop float NaN tests.
inline int32_t order_key(uint32_t bits) {
    const int32_t magnitude = static_cast<int32_t>(bits & 0x7FFFFFFFu);
    if (magnitude > 0x7F800000) return std::numeric_limits<int32_t>::max();
    return (bits & 0x80000000u) ? -magnitude : magnitude;
}
inline int32_t order_key(uint16_t bits) { return order_key(static_cast<uint32_t>(bits) << 16); }  // a bf16's float32

// The index of a row's largest element, the first of ties: the largest key of each chunk of the row in one
// vectorised pass, then the first index holding it inside the first chunk that reached it.
template <typename Bits>
inline __attribute__((always_inline)) int64_t argmax_row_body(const Bits* x, int64_t n) {
    constexpr int64_t chunk = 512;
    int32_t best = std::numeric_limits<int32_t>::min();
    int64_t best_start = 0;
    for (int64_t start = 0; start < n; start += chunk) {
        const int64_t end = std::min(start + chunk, n);
        int32_t top = std::numeric_limits<int32_t>::min();
#pragma omp simd reduction(max : top)
        for (int64_t i = start; i < end; ++i) top = std::max(top, order_key(x[i]));
        if (top > best) {
            best = top;
            best_start = start;
        }
    }
    const int64_t end = std::min(best_start + chunk, n);
    for (int64_t i = best_start; i < end; ++i)
        if (order_key(x[i]) == best) return i;
    return best_start;
}

PAGEWISE_CLONES
int64_t argmax_row(const uint16_t* x, int64_t n) { return argmax_row_body(x, n); }

PAGEWISE_CLONES
int64_t argmax_row(const uint32_t* x, int64_t n) { return argmax_row_body(x, n); }

// The index of each row's largest element (the first of ties, a NaN's if the row has one: torch.argmax's result)
// of a 2-D float32 or bfloat16 tensor whose rows are contiguous, as int64 [rows]. Reads a bf16 row as it is: the
// greedy token of a bf16 LM head's output without a float32 copy.
at::Tensor argmax_rows(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1 &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "argmax_rows takes a 2-D float32 or bfloat16 tensor with contiguous, non-empty rows");
    const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
    auto out = at::empty({rows}, x.options().dtype(at::kLong));
    int64_t* out_ptr = out.data_ptr<int64_t>();
    auto scan_all = [&](const auto* base) {
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) out_ptr[r] = argmax_row(base + r * stride, n);
        });
    };
    if (x.scalar_type() == at::kBFloat16) {
        scan_all(reinterpret_cast<const uint16_t*>(x.data_ptr()));
    } else {
        scan_all(reinterpret_cast<const uint32_t*>(x.data_ptr()));
    }
    return out;
}

template <typename T>
inline __attribute__((always_inline)) void rotate_row_body(T* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float a = widen(x[i]), b = widen(x[i + half]);
        narrow(a * cos[i] - b * sin[i], x + i);
        narrow(b * cos[i + half] + a * sin[i + half], x + i + half);
    }
}

PAGEWISE_CLONES
void rotate_row(float* x, const float* cos, const float* sin, int64_t half) { rotate_row_body(x, cos, sin, half); }

PAGEWISE_CLONES
void rotate_row(uint16_t* x, const float* cos, const float* sin, int64_t half) { rotate_row_body(x, cos, sin, half); }

// Rotary embedding (rotate-half form) in place on query [tokens, heads, dim] and key [tokens, kv_heads, dim]
// views, float32 or both bf16 (a bf16 projection's output: rotated in float32, rounded once): token t uses row
// positions[t] of the [max_positions, dim] cos/sin tables. Heads' rows must be contiguous.
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin) {
    const bool bf16 = query.scalar_type() == at::kBFloat16;
    TORCH_CHECK((bf16 || query.scalar_type() == at::kFloat) && key.scalar_type() == query.scalar_type() &&
                    query.dim() == 3 && key.dim() == 3,
                "rotary_embedding takes float32 or bfloat16 [tokens, heads, dim] query and key of one dtype");
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
    const float *cos_ptr = cos.data_ptr<float>(), *sin_ptr = sin.data_ptr<float>();
    auto rotate_all = [&](auto* q_ptr, auto* k_ptr) {
        at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                const float *c = cos_ptr + pos_ptr[t] * dim, *s = sin_ptr + pos_ptr[t] * dim;
                for (int64_t h = 0; h < q_heads; ++h) rotate_row(q_ptr + t * q_stride + h * dim, c, s, dim / 2);
                for (int64_t h = 0; h < k_heads; ++h) rotate_row(k_ptr + t * k_stride + h * dim, c, s, dim / 2);
            }
        });
    };
    if (bf16) rotate_all(elements<uint16_t>(query), elements<uint16_t>(key));
    else rotate_all(query.data_ptr<float>(), key.data_ptr<float>());
}

template <typename T>
inline __attribute__((always_inline)) void silu_and_mul_body(const T* gate, const T* up, int64_t size, T* out) {
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) {
        const float g = widen(gate[i]);
        narrow(g / (1.f + std::exp(-g)) * widen(up[i]), out + i);
    }
}

PAGEWISE_CLONES
void silu_and_mul_row(const float* gate, const float* up, int64_t size, float* out) {
    silu_and_mul_body(gate, up, size, out);
}

PAGEWISE_CLONES
void silu_and_mul_row(const uint16_t* gate, const uint16_t* up, int64_t size, uint16_t* out) {
    silu_and_mul_body(gate, up, size, out);
}

#if defined(__x86_64__)
// `silu_times` on eight float32 lanes.
PAGEWISE_AVX2_FMA void silu_and_mul_row_avx2(const float* gate, const float* up, int64_t size, float* out) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 8 <= size; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_nonpositive_avx2(_mm256_min_ps(g, _mm256_sub_ps(zero, g)));
        const __m256 above = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(above, _mm256_add_ps(one, e))),
                                                _mm256_loadu_ps(up + i)));
    }
    silu_and_mul_row(gate + i, up + i, size - i, out + i);
}
#endif


// ---- LoRA: each row's adapter delta, rows grouped by adapter slot (Punica's SGMV).
//
// y[order[i]] += scaling[s] * (x[order[i]] @ lora_a[slot]^T) @ lora_b[slot] for every position i of segment s, where
// lora_a is [slots, R, in] and lora_b [slots, R, out], both float32 or both bf16 (the stacks of a bf16 projection).
// A fused projection's parts own R / parts rank rows each and only their own columns (column_bounds[p] ..
// column_bounds[p + 1]): the other blocks are zero and skipped. Work goes in blocks of up to LORA_ROWS rows of one
// segment: a block's inputs are packed once, each weight row is loaded once for all its rows, the shrink's result
// and the delta stay float32, and the delta is added to y (widened and rounded back for a bf16 y) row by row.
// Float32 stacks: float32 products. bf16 stacks: the inputs are rounded to bf16 as the bf16 projection itself
// rounds them; on a CPU with AVX512-BF16 the shrink is `bf16_dot_rows`, elsewhere
// the weights are widened as they are loaded; the expand widens its bf16 weights and multiplies in float32.

constexpr int64_t LORA_ROWS = 4;

// s[r * rank + j] = x_r . a_j for the block's rows (x rows packed [rows, in], float32; weights float32 or bf16). A
// full block takes the weight rows four at a time: sixteen independent sums (four input rows by four weight rows),
// so each loaded element feeds four multiply-adds and no multiply-add waits on another.
template <typename W>
inline __attribute__((always_inline)) void lora_shrink_body(const float* x, int64_t rows, const W* a, int64_t rank,
                                                            int64_t in, float* s) {
    int64_t j = 0;
    if (rows == LORA_ROWS) {
        const float *x0 = x, *x1 = x + in, *x2 = x + 2 * in, *x3 = x + 3 * in;
        for (; j + 4 <= rank; j += 4) {
            const W *w0 = a + j * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
            float s00 = 0.f, s01 = 0.f, s02 = 0.f, s03 = 0.f, s10 = 0.f, s11 = 0.f, s12 = 0.f, s13 = 0.f;
            float s20 = 0.f, s21 = 0.f, s22 = 0.f, s23 = 0.f, s30 = 0.f, s31 = 0.f, s32 = 0.f, s33 = 0.f;
#pragma omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)
            for (int64_t k = 0; k < in; ++k) {
                const float a0 = x0[k], a1 = x1[k], a2 = x2[k], a3 = x3[k];
                const float b0 = widen(w0[k]), b1 = widen(w1[k]), b2 = widen(w2[k]), b3 = widen(w3[k]);
                s00 += a0 * b0, s01 += a0 * b1, s02 += a0 * b2, s03 += a0 * b3;
                s10 += a1 * b0, s11 += a1 * b1, s12 += a1 * b2, s13 += a1 * b3;
                s20 += a2 * b0, s21 += a2 * b1, s22 += a2 * b2, s23 += a2 * b3;
                s30 += a3 * b0, s31 += a3 * b1, s32 += a3 * b2, s33 += a3 * b3;
            }
            float* out = s + j;
            out[0] = s00, out[1] = s01, out[2] = s02, out[3] = s03;
            out += rank;
            out[0] = s10, out[1] = s11, out[2] = s12, out[3] = s13;
            out += rank;
            out[0] = s20, out[1] = s21, out[2] = s22, out[3] = s23;
            out += rank;
            out[0] = s30, out[1] = s31, out[2] = s32, out[3] = s33;
        }
    }
    for (; j < rank; ++j) {
        const W* w = a + j * in;
        for (int64_t r = 0; r < rows; ++r) {
            const float* xr = x + r * in;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t k = 0; k < in; ++k) sum += xr[k] * widen(w[k]);
            s[r * rank + j] = sum;
        }
    }
}

PAGEWISE_CLONES
void lora_shrink(const float* x, int64_t rows, const float* a, int64_t rank, int64_t in, float* s) {
    lora_shrink_body(x, rows, a, rank, in, s);
}

PAGEWISE_CLONES
void lora_shrink(const float* x, int64_t rows, const uint16_t* a, int64_t rank, int64_t in, float* s) {
    lora_shrink_body(x, rows, a, rank, in, s);
}

#if defined(__x86_64__)
// ---- the same on AVX-512: every loop over a block's rows or a tile's vectors has a fixed trip count, so the
// sixteen accumulators stay in registers (rows past the block's end are skipped, never read or written).

// Sixteen weights as float32: loaded, or widened from bf16 (the top half of a float32's bits); lanes outside
// `mask` are zero.
PAGEWISE_AVX512 inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
PAGEWISE_AVX512 inline __m512 load16(const uint16_t* p, __mmask16 mask) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Stores the lanes of `v` in `mask`: as they are, or rounded to nearest even bf16 (as `narrow`).
PAGEWISE_AVX512 inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
PAGEWISE_AVX512 inline void store16(uint16_t* p, __m512 v, __mmask16 mask) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm512_mask_cvtepi32_storeu_epi16(p, mask, _mm512_srli_epi32(rounded, 16));
}

inline __mmask16 lanes_below(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// silu(g) * u lane by lane: g * sigmoid(g), the sigmoid from e = e^-|g| (at most 1, so nothing overflows):
// 1 / (1 + e) where g >= 0, e / (1 + e) below.
PAGEWISE_AVX512 inline __m512 silu_times(__m512 g, __m512 u) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
    const __m512 e = exp_nonpositive(_mm512_min_ps(g, _mm512_sub_ps(zero, g)));
    const __m512 above = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, zero, _CMP_GE_OQ), e, one);
    return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(above, _mm512_add_ps(one, e))), u);
}

template <typename T>
PAGEWISE_AVX512 void silu_and_mul_row_avx512(const T* gate, const T* up, int64_t size, T* out) {
    for (int64_t i = 0; i < size; i += 16) {
        const __mmask16 live = lanes_below(size - i);
        store16(out + i, silu_times(load16(gate + i, live), load16(up + i, live)), live);
    }
}

// `lora_shrink` on AVX-512 (float32 input rows; float32 or bf16 weights): four weight rows by the block's rows,
// sixteen inputs a step (the last step masked), reduced together by `sum_lanes_of_16`.
template <typename W>
PAGEWISE_AVX512 void lora_shrink_avx512(const float* x, int64_t rows, const W* a, int64_t rank, int64_t in, float* s) {
    for (int64_t j = 0; j < rank; j += 4) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < in; k += 16) {
            const __mmask16 mask = lanes_below(in - k);
            __m512 w[4];
            for (int q = 0; q < 4; ++q) w[q] = j + q < rank ? load16(a + (j + q) * in + k, mask) : _mm512_setzero_ps();
            for (int r = 0; r < 4; ++r) {
                if (r >= rows) break;
                const __m512 xr = _mm512_maskz_loadu_ps(mask, x + r * in + k);
                for (int q = 0; q < 4; ++q) acc[r * 4 + q] = _mm512_fmadd_ps(xr, w[q], acc[r * 4 + q]);
            }
        }
        alignas(64) float sums[16];
        _mm512_store_ps(sums, sum_lanes_of_16(acc));
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t q = 0; q < 4 && j + q < rank; ++q) s[r * rank + j + q] = sums[r * 4 + q];
    }
}

// y_r[o] += scaling * sum over rank rows j in [j_lo, j_hi) of s[r * rank + j] * b[j * out + o], for o in [lo, hi)
// and each of the block's rows r: 64 columns at a time, their sums for the block's rows in sixteen registers
// across the rank rows, added to y (rounded back for a bf16 y) once per tile.
template <typename W, typename Y>
PAGEWISE_AVX512 void lora_expand_add_avx512(const float* s, int64_t rows, int64_t rank, const W* b, int64_t out,
                                            int64_t j_lo, int64_t j_hi, int64_t lo, int64_t hi, float scaling,
                                            Y* const* y_rows) {
    for (int64_t o0 = lo; o0 < hi; o0 += 64) {
        __mmask16 masks[4];
        for (int c = 0; c < 4; ++c) masks[c] = lanes_below(std::max<int64_t>(hi - o0 - 16 * c, 0));
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t j = j_lo; j < j_hi; ++j) {
            __m512 w[4];
            for (int c = 0; c < 4; ++c) w[c] = load16(b + j * out + o0 + 16 * c, masks[c]);
            for (int r = 0; r < 4; ++r) {
                if (r >= rows) break;
                const __m512 coef = _mm512_set1_ps(s[r * rank + j]);
                for (int c = 0; c < 4; ++c) acc[r * 4 + c] = _mm512_fmadd_ps(coef, w[c], acc[r * 4 + c]);
            }
        }
        const __m512 scale = _mm512_set1_ps(scaling);
        for (int r = 0; r < 4; ++r) {
            if (r >= rows) break;
            for (int c = 0; c < 4; ++c) {
                Y* dst = y_rows[r] + o0 + 16 * c;
                store16(dst, _mm512_fmadd_ps(scale, acc[r * 4 + c], load16(dst, masks[c])), masks[c]);
            }
        }
    }
}
#endif

// [rows, 2 * size] (gate then up) -> silu(gate) * up, [rows, size], in the input's dtype (float32 or bfloat16;
// computed in float32, a bf16 result rounded once to nearest even): sixteen lanes at a time on AVX-512, eight on
// AVX2 for float32 (the exp of `exp_nonpositive`: within a few float32 ulps of the exact function), else a plain
// loop.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
    TORCH_CHECK((gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16) &&
                    gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
                "silu_and_mul takes a float32 or bfloat16 [rows, 2 * size] input");
    const auto in = gate_up.contiguous();
    const int64_t rows = in.size(0), size = in.size(1) / 2;
    auto out = at::empty({rows, size}, in.options());
    const bool bf16 = in.scalar_type() == at::kBFloat16;
    // every row through `row`, on elements of one type
    auto over = [&](auto row, const auto* in_ptr, auto* out_ptr) {
        at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r)
                row(in_ptr + r * 2 * size, in_ptr + r * 2 * size + size, size, out_ptr + r * size);
        });
    };
    // the same on the input's elements, `row` having an overload for each
    auto run_all = [&](auto row) {
        if (bf16) over(row, elements<const uint16_t>(in), elements<uint16_t>(out));
        else over(row, in.data_ptr<float>(), out.data_ptr<float>());
    };
#if defined(__x86_64__)
    if (cpu_has_avx512()) {
        run_all([](const auto* gate, const auto* up, int64_t n, auto* o) { silu_and_mul_row_avx512(gate, up, n, o); });
        return out;
    }
    if (!bf16 && cpu_has_avx2_fma()) {
        over(silu_and_mul_row_avx2, in.data_ptr<float>(), out.data_ptr<float>());
        return out;
    }
#endif
    run_all([](const auto* gate, const auto* up, int64_t n, auto* o) { silu_and_mul_row(gate, up, n, o); });
    return out;
}

constexpr int64_t LORA_TILE = 32;  // output columns whose sums a block keeps in registers across the rank rows

// d[r * out + o] = sum over the part's rank rows j of s[r * rank + j] * b[j * out + o], for o in [lo, hi): a tile
// of columns at a time, its sums for the block's rows held across the rank rows (each weight element loaded
// once per block, widened to float32 if it is bf16).
template <typename W>
inline __attribute__((always_inline)) void lora_expand_body(const float* s, int64_t rows, int64_t rank, const W* b,
                                                            int64_t out, int64_t j_lo, int64_t j_hi, int64_t lo,
                                                            int64_t hi, float* d) {
    for (int64_t o0 = lo; o0 < hi; o0 += LORA_TILE) {
        const int64_t width = std::min(LORA_TILE, hi - o0);
        float acc[LORA_ROWS][LORA_TILE] = {};
        if (rows == LORA_ROWS && width == LORA_TILE) {
            for (int64_t j = j_lo; j < j_hi; ++j) {
                const W* bj = b + j * out + o0;
                const float c0 = s[j], c1 = s[rank + j], c2 = s[2 * rank + j], c3 = s[3 * rank + j];
#pragma omp simd
                for (int64_t o = 0; o < LORA_TILE; ++o) {
                    const float w = widen(bj[o]);
                    acc[0][o] += c0 * w, acc[1][o] += c1 * w, acc[2][o] += c2 * w, acc[3][o] += c3 * w;
                }
            }
        } else {
            for (int64_t j = j_lo; j < j_hi; ++j) {
                const W* bj = b + j * out + o0;
                for (int64_t r = 0; r < rows; ++r) {
                    const float coef = s[r * rank + j];
#pragma omp simd
                    for (int64_t o = 0; o < width; ++o) acc[r][o] += coef * widen(bj[o]);
                }
            }
        }
        for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * out + o0, acc[r], width * sizeof(float));
    }
}

PAGEWISE_CLONES
void lora_expand(const float* s, int64_t rows, int64_t rank, const float* b, int64_t out, int64_t j_lo, int64_t j_hi,
                 int64_t lo, int64_t hi, float* d) {
    lora_expand_body(s, rows, rank, b, out, j_lo, j_hi, lo, hi, d);
}

PAGEWISE_CLONES
void lora_expand(const float* s, int64_t rows, int64_t rank, const uint16_t* b, int64_t out, int64_t j_lo,
                 int64_t j_hi, int64_t lo, int64_t hi, float* d) {
    lora_expand_body(s, rows, rank, b, out, j_lo, j_hi, lo, hi, d);
}


// Each element of a float32 row rounded to the nearest bf16 (kept as float32).
PAGEWISE_CLONES
void round_to_bf16(float* row, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        uint16_t rounded;
        narrow(row[i], &rounded);
        row[i] = widen(rounded);
    }
}


template <typename T>
inline __attribute__((always_inline)) void add_scaled_body(T* y, const float* d, float scaling, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t o = lo; o < hi; ++o) narrow(widen(y[o]) + scaling * d[o], y + o);
}

PAGEWISE_CLONES
void add_scaled(float* y, const float* d, float scaling, int64_t lo, int64_t hi) { add_scaled_body(y, d, scaling, lo, hi); }

PAGEWISE_CLONES
void add_scaled(uint16_t* y, const float* d, float scaling, int64_t lo, int64_t hi) {
    add_scaled_body(y, d, scaling, lo, hi);
}

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& order, const at::Tensor& segment_starts, const at::Tensor& segment_slots,
              const at::Tensor& segment_scalings, const at::Tensor& column_bounds) {
    const bool x_ok = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
    const bool y_ok = y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16;
    TORCH_CHECK(x_ok && y_ok && x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
                "lora_add takes float32 or bfloat16 [rows, in] x and [rows, out] y");
    TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "lora_add: rows of x and y must be contiguous");
    const bool stacks_bf16 = lora_a.scalar_type() == at::kBFloat16;
    TORCH_CHECK((lora_a.scalar_type() == at::kFloat || stacks_bf16) && lora_b.scalar_type() == lora_a.scalar_type() &&
                    lora_a.is_contiguous() && lora_b.is_contiguous() && lora_a.dim() == 3 && lora_b.dim() == 3 &&
                    lora_a.size(2) == x.size(1) && lora_b.size(2) == y.size(1) && lora_a.size(1) == lora_b.size(1) &&
                    lora_a.size(0) == lora_b.size(0),
                "lora_add takes contiguous [slots, R, in] and [slots, R, out] stacks, both float32 or both bfloat16");
    const auto ord = order.to(at::kLong).contiguous();
    const auto starts = segment_starts.to(at::kLong).contiguous();
    const auto slots = segment_slots.to(at::kLong).contiguous();
    const auto scalings = segment_scalings.to(at::kFloat).contiguous();
    const auto bounds = column_bounds.to(at::kLong).contiguous();
    const int64_t num_segments = slots.numel(), num_slots = lora_a.size(0), rank = lora_a.size(1);
    const int64_t in = x.size(1), out = y.size(1), num_parts = bounds.numel() - 1;
    TORCH_CHECK(starts.numel() == num_segments + 1 && scalings.numel() == num_segments, "lora_add: segments disagree");
    TORCH_CHECK(num_parts >= 1 && rank % num_parts == 0 && bounds.data_ptr<int64_t>()[num_parts] == out,
                "lora_add: column bounds must split the output among the parts");
    const int64_t *ord_ptr = ord.data_ptr<int64_t>(), *start_ptr = starts.data_ptr<int64_t>();
    const int64_t *slot_ptr = slots.data_ptr<int64_t>(), *bound_ptr = bounds.data_ptr<int64_t>();
    TORCH_CHECK(start_ptr[num_segments] == ord.numel(), "lora_add: segments must cover the order");
    for (int64_t i = 0; i < ord.numel(); ++i)
        TORCH_CHECK(ord_ptr[i] >= 0 && ord_ptr[i] < x.size(0), "lora_add: row out of range");
    for (int64_t g = 0; g < num_segments; ++g)
        TORCH_CHECK(slot_ptr[g] >= 0 && slot_ptr[g] < num_slots && start_ptr[g] <= start_ptr[g + 1],
                    "lora_add: bad segment");
    std::vector<std::pair<int64_t, int64_t>> blocks;  // (segment, first position) of each block of rows
    for (int64_t g = 0; g < num_segments; ++g)
        for (int64_t p = start_ptr[g]; p < start_ptr[g + 1]; p += LORA_ROWS) blocks.emplace_back(g, p);
    const float* scale_ptr = scalings.data_ptr<float>();
    const int64_t part_rank = rank / num_parts;
#if defined(__x86_64__)
    const bool avx512 = cpu_has_avx512(), bf16_dot = stacks_bf16 && cpu_has_bf16_dot();
#else
    const bool avx512 = false, bf16_dot = false;
#endif
    auto run_all = [&](const auto* x_ptr, auto* y_ptr, const auto* a_ptr, const auto* b_ptr) {
        using W = std::decay_t<decltype(*a_ptr)>;
        using Y = std::decay_t<decltype(*y_ptr)>;
        const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
        at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
            std::vector<float> s(LORA_ROWS * rank), xs(bf16_dot ? 0 : LORA_ROWS * in), d(avx512 ? 0 : LORA_ROWS * out);
            std::vector<uint16_t> xh(bf16_dot ? LORA_ROWS * in : 0);
            for (int64_t i = begin; i < end; ++i) {
                const auto [g, first] = blocks[i];
                const int64_t rows = std::min(LORA_ROWS, start_ptr[g + 1] - first);
                const W* a = a_ptr + slot_ptr[g] * rank * in;
                const W* b = b_ptr + slot_ptr[g] * rank * out;
                Y* y_rows[LORA_ROWS];
                for (int64_t r = 0; r < rows; ++r) y_rows[r] = y_ptr + ord_ptr[first + r] * y_stride;
                bool shrunk = false;
                if constexpr (std::is_same_v<W, uint16_t>) {
#if defined(__x86_64__)
                    if (bf16_dot) {
                        for (int64_t r = 0; r < rows; ++r)
                            bf16_row(x_ptr + ord_ptr[first + r] * x_stride, in, xh.data() + r * in);
                        bf16_dot_rows(xh.data(), rows, a, rank, in, s.data(), rank, a + rank * in);
                        shrunk = true;
                    }
#endif
                }
                if (!shrunk) {
                    for (int64_t r = 0; r < rows; ++r) {
                        widen_row(x_ptr + ord_ptr[first + r] * x_stride, in, xs.data() + r * in);
                        if constexpr (std::is_same_v<W, uint16_t>) round_to_bf16(xs.data() + r * in, in);
                    }
#if defined(__x86_64__)
                    if (avx512) lora_shrink_avx512(xs.data(), rows, a, rank, in, s.data());
                    else
#endif
                        lora_shrink(xs.data(), rows, a, rank, in, s.data());
                }
#if defined(__x86_64__)
                if (avx512) {
                    for (int64_t p = 0; p < num_parts; ++p)
                        lora_expand_add_avx512(s.data(), rows, rank, b, out, p * part_rank, (p + 1) * part_rank,
                                               bound_ptr[p], bound_ptr[p + 1], scale_ptr[g], y_rows);
                    continue;
                }
#endif
                for (int64_t p = 0; p < num_parts; ++p)
                    lora_expand(s.data(), rows, rank, b, out, p * part_rank, (p + 1) * part_rank, bound_ptr[p],
                                bound_ptr[p + 1], d.data());
                for (int64_t r = 0; r < rows; ++r) add_scaled(y_rows[r], d.data() + r * out, scale_ptr[g], 0, out);
            }
        });
    };
    auto with_stacks = [&](const auto* x_ptr, auto* y_ptr) {
        if (stacks_bf16)
            run_all(x_ptr, y_ptr, elements<const uint16_t>(lora_a), elements<const uint16_t>(lora_b));
        else
            run_all(x_ptr, y_ptr, lora_a.data_ptr<float>(), lora_b.data_ptr<float>());
    };
    const bool x_bf16 = x.scalar_type() == at::kBFloat16, y_bf16 = y.scalar_type() == at::kBFloat16;
    const auto* xf = x_bf16 ? nullptr : x.data_ptr<float>();
    const auto* xb = x_bf16 ? elements<const uint16_t>(x) : nullptr;
    auto* yf = y_bf16 ? nullptr : y.data_ptr<float>();
    auto* yb = y_bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr;
    if (x_bf16 && y_bf16) with_stacks(xb, yb);
    else if (x_bf16) with_stacks(xb, yf);
    else if (y_bf16) with_stacks(xf, yb);
    else with_stacks(xf, yf);
}

#if defined(__x86_64__)
// s[r * s_stride + j] = x_r . w_j for r < rows (at most 4) and j < n, with float32 input rows (x, `in` apart) and
// weight rows (w, `in` apart), accumulated in float32 eight elements a step (the last step masked). Two weight rows
// at a time against all the input rows: up to eight accumulators beside two weight and one input register, fixed
// trip counts so they stay among AVX2's sixteen registers, reduced together by `sum_lanes_of_8`. As in
// `bf16_dot_rows`, the group four ahead (up to `prefetch_end`) is prefetched by hand, a line per step.
PAGEWISE_AVX2_FMA
void f32_dot_rows(const float* x, int64_t rows, const float* w, int64_t n, int64_t in, float* s, int64_t s_stride,
                  const float* prefetch_end) {
    const int64_t full = in / 8 * 8;
    alignas(32) int32_t tail_bits[8];
    for (int64_t i = 0; i < 8; ++i) tail_bits[i] = i < in - full ? -1 : 0;
    const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail_bits));
    for (int64_t j = 0; j < n; j += 2) {
        const float* w0 = w + j * in;
        const float* w1 = w + std::min(j + 1, n - 1) * in;  // past n: a real row, its sums unused
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        const char* ahead = reinterpret_cast<const char*>(w + (j + 8) * in);
        const char* ahead_end = std::min(reinterpret_cast<const char*>(w + (j + 10) * in),
                                         reinterpret_cast<const char*>(prefetch_end));
        for (int64_t k = 0; k < full; k += 8) {
            if (ahead + 8 * k < ahead_end) _mm_prefetch(ahead + 8 * k, _MM_HINT_T0);  // two rows: 64 bytes a step
            const __m256 a = _mm256_loadu_ps(w0 + k), b = _mm256_loadu_ps(w1 + k);
            for (int r = 0; r < 4; ++r) {
                if (r >= rows) break;
                const __m256 xr = _mm256_loadu_ps(x + r * in + k);
                acc[2 * r] = _mm256_fmadd_ps(xr, a, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(xr, b, acc[2 * r + 1]);
            }
        }
        if (full < in) {
            const __m256 a = _mm256_maskload_ps(w0 + full, tail), b = _mm256_maskload_ps(w1 + full, tail);
            for (int r = 0; r < 4; ++r) {
                if (r >= rows) break;
                const __m256 xr = _mm256_maskload_ps(x + r * in + full, tail);
                acc[2 * r] = _mm256_fmadd_ps(xr, a, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(xr, b, acc[2 * r + 1]);
            }
        }
        alignas(32) float sums[8];
        _mm256_store_ps(sums, sum_lanes_of_8(acc));
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t q = 0; q < 2 && j + q < n; ++q) s[r * s_stride + j + q] = sums[2 * r + q];
    }
}
#endif

#if defined(__x86_64__)
// ---- a projection of a few rows on AMX tiles
//
// The transposed product, sixteen outputs at a time: sixteen weight rows are one tile read where they lie (A: 16
// rows x 32 inputs, so the weight streams from memory once per call, in long runs per row), the input rows the
// other (B: 16 pairs of inputs x 16 rows, laid out once per call), and C holds 16 outputs x 16 rows in float32.
// Up to `AMX_ROW_TILES` tiles of rows share each weight tile. Products of bf16 pairs are exact and summed in
// float32, as the AVX512-BF16 loop sums them (in another order).
constexpr int64_t AMX_ROW_TILES = 4;
// Chunks of 32 inputs ahead of the one multiplied that a block asks for (`pagewise bench gemm --json` on the AMX
// Xeon, the few-rows product at 4 / 8 rows: 78.7 / 146.7 GFLOP/s without, 82.8 / 153.2 with).
constexpr int64_t AMX_WEIGHT_AHEAD = 4;

// The tile configuration of the product: A and B, then up to four tiles of sums, 16 rows of 64 bytes each.
inline TileConfig amx_product_tiles() {
    TileConfig config;
    for (int t = 0; t < 2 + AMX_ROW_TILES; ++t) config.set(t, 16, 64);
    return config;
}

// A thread's tile state for the product: configured when made, released when done.
struct AmxProductState {
    alignas(64) float sums[256];
    PAGEWISE_AMX explicit AmxProductState(const TileConfig& config) { _tile_loadconfig(&config); }
    AmxProductState(AmxProductState&&) = delete;
    PAGEWISE_AMX ~AmxProductState() { _tile_release(); }
};

// `x` (rows x in bf16) as the B tiles of the product: for tile of rows i and chunk c of 32 inputs, 16 pairs of
// inputs x 16 rows (uint32: a pair of bf16), zeros past the last row.
PAGEWISE_AMX
void amx_input_pairs(const uint16_t* x, int64_t rows, int64_t in, uint32_t* pairs) {
    const int64_t chunks = in / 32, tiles = (rows + 15) / 16;
    std::fill(pairs, pairs + tiles * chunks * 256, 0u);
    const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < chunks; ++c)
            _mm512_i32scatter_epi32(pairs + ((r / 16) * chunks + c) * 256 + r % 16, across,
                                    _mm512_loadu_si512(x + r * in + 32 * c), 4);
}

// Sixteen float32 lanes as bf16, rounded to nearest even (as `narrow`).
PAGEWISE_AMX inline __m256i narrow16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}
PAGEWISE_AMX inline void store_outputs(__m512 v, float* y) { _mm512_storeu_ps(y, v); }
PAGEWISE_AMX inline void store_outputs(__m512 v, uint16_t* y) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), narrow16(v)); }

// Outputs j0 .. j0 + 15 of every row: y[r][j0 + j] = w_{j0 + j} . x_r (+ bias[j0 + j]); `w` the weight (out x in
// bf16, in a multiple of 32), `pairs` from `amx_input_pairs`.
template <typename Out>
PAGEWISE_AMX void amx_product_block(const uint16_t* w, int64_t in, int64_t j0, const uint32_t* pairs, int64_t rows,
                                    const float* bias, Out* y, int64_t out, float* sums) {
    const int64_t chunks = in / 32, tiles = (rows + 15) / 16;
    const __m512 b = bias ? _mm512_loadu_ps(bias + j0) : _mm512_setzero_ps();
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const uint16_t* block = w + j0 * in;
    for (int64_t t0 = 0; t0 < tiles; t0 += AMX_ROW_TILES) {
        const int64_t count = std::min(AMX_ROW_TILES, tiles - t0);
        for (int64_t i = 0; i < count; ++i) tile_zero(2 + i);
        for (int64_t c = 0; c < chunks; ++c) {
            if (c + AMX_WEIGHT_AHEAD < chunks)  // sixteen row streams: ask for each row's line that many chunks on
                for (int64_t i = 0; i < 16; ++i)
                    _mm_prefetch(reinterpret_cast<const char*>(block + i * in + 32 * (c + AMX_WEIGHT_AHEAD)), _MM_HINT_T0);
            _tile_loadd(0, block + 32 * c, in * sizeof(uint16_t));
            for (int64_t i = 0; i < count; ++i) {
                _tile_loadd(1, pairs + ((t0 + i) * chunks + c) * 256, 64);
                tile_accumulate(2 + i);
            }
        }
        for (int64_t i = 0; i < count; ++i) {
            tile_store(2 + i, sums, 64);  // sums[j * 16 + r]: output j0 + j of row (t0 + i) * 16 + r
            const int64_t first = (t0 + i) * 16;
            for (int64_t r = 0; r < std::min<int64_t>(16, rows - first); ++r)
                store_outputs(_mm512_add_ps(_mm512_i32gather_ps(column, sums + r, 4), b), y + (first + r) * out + j0);
        }
    }
}
#endif

// ---- projections of a few rows (a decode step at low load): y = x W^T + b, W [out, in] float32 or bf16 as it lies
// (the dense weight a packed matmul path keeps beside its blocked one). A step of a handful of rows does little
// arithmetic per weight, so its time is the time to stream the weights; this reads each block of 64 weight rows
// once for all the input rows (four input rows at a time, the block held in cache between them), the inputs
// converted to the weight's dtype once. A bf16 weight takes exact bf16 products (`bf16_dot_rows`, AVX512-BF16), a
// float32 one float32 products (`f32_dot_rows`, AVX2 and FMA); on an AMX CPU a bf16 weight whose shapes the tiles
// take goes through `amx_product_block` instead. Sums in float32; the bias (float32) added to them,
// then the result stored in `out_dtype` (a bf16 result rounded once, to nearest even). How many rows it pays for
// is the caller's to measure (`pagewise/engine/gemm_selection.py`).
constexpr int64_t FEW_ROWS_BLOCK = 64;

at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::ScalarType out_dtype) {
#if defined(__x86_64__)
    const bool bf16 = weight.scalar_type() == at::kBFloat16;
    TORCH_CHECK((bf16 || weight.scalar_type() == at::kFloat) && weight.dim() == 2 && weight.is_contiguous(),
                "linear_few_rows takes a contiguous float32 or bf16 [out, in] weight");
    TORCH_CHECK(bf16 ? cpu_has_bf16_dot() : cpu_has_avx2_fma(),
                bf16 ? "linear_few_rows needs a CPU with AVX512-BF16 for a bf16 weight"
                     : "linear_few_rows needs a CPU with AVX2 and FMA for a float32 weight");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1) &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "linear_few_rows takes a float32 or bf16 [rows, in] input");
    TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "linear_few_rows gives float32 or bf16");
    TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0)), "linear_few_rows: bias is [out]");
    const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
    const at::Tensor xc = x.to(weight.scalar_type()).contiguous();
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
    at::Tensor y = at::empty({rows, out}, x.options().dtype(out_dtype));
    const float* bp = b ? b->data_ptr<float>() : nullptr;
    if (bf16 && cpu_has_amx_bf16() && in % 32 == 0 && out % 16 == 0) {
        std::vector<uint32_t> pairs((rows + 15) / 16 * (in / 32) * 256);
        amx_input_pairs(elements<const uint16_t>(xc), rows, in, pairs.data());
        const TileConfig config = amx_product_tiles();
        const uint16_t* wp = elements<const uint16_t>(weight);
        auto run_tiles = [&](auto* yp) {
            claim_in_turn(out / 16, [&] { return AmxProductState(config); }, [&](int64_t block, AmxProductState& state) {
                amx_product_block(wp, in, block * 16, pairs.data(), rows, bp, yp, out, state.sums);
            });
        };
        if (out_dtype == at::kBFloat16) run_tiles(reinterpret_cast<uint16_t*>(y.data_ptr()));
        else run_tiles(y.data_ptr<float>());
        return y;
    }
    // sums[r * FEW_ROWS_BLOCK + j] = x_{r0 + r} . w_{j0 + j} for r < m and j < n; no weight row from `end_row` on
    // (another thread's) is prefetched
    auto dot_rows = [&](int64_t r0, int64_t m, int64_t j0, int64_t n, float* sums, int64_t end_row) {
        if (bf16) {
            const uint16_t* xp = elements<const uint16_t>(xc);
            const uint16_t* wp = elements<const uint16_t>(weight);
            bf16_dot_rows(xp + r0 * in, m, wp + j0 * in, n, in, sums, FEW_ROWS_BLOCK, wp + end_row * in);
        } else {
            const float* xp = xc.data_ptr<float>();
            const float* wp = weight.data_ptr<float>();
            f32_dot_rows(xp + r0 * in, m, wp + j0 * in, n, in, sums, FEW_ROWS_BLOCK, wp + end_row * in);
        }
    };
    const int64_t blocks = (out + FEW_ROWS_BLOCK - 1) / FEW_ROWS_BLOCK;
    auto run = [&](auto* yp) {
        at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
            alignas(64) float sums[4 * FEW_ROWS_BLOCK];
            const int64_t end_row = std::min(end * FEW_ROWS_BLOCK, out);  // this thread's last weight row, + 1
            for (int64_t block = begin; block < end; ++block) {
                const int64_t j0 = block * FEW_ROWS_BLOCK, n = std::min(FEW_ROWS_BLOCK, out - j0);
                for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                    const int64_t m = std::min<int64_t>(4, rows - r0);
                    dot_rows(r0, m, j0, n, sums, end_row);
                    for (int64_t r = 0; r < m; ++r)
                        for (int64_t j = 0; j < n; ++j)
                            narrow(sums[r * FEW_ROWS_BLOCK + j] + (bp ? bp[j0 + j] : 0.f), yp + (r0 + r) * out + j0 + j);
                }
            }
        });
    };
    if (out_dtype == at::kBFloat16) run(reinterpret_cast<uint16_t*>(y.data_ptr()));
    else run(y.data_ptr<float>());
    return y;
#else
    TORCH_CHECK(false, "linear_few_rows needs an x86-64 CPU");
#endif
}

}  // namespace

TORCH_LIBRARY(pagewise_cpu, m) {
    m.def("paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
          "Tensor seq_lens, float scale) -> Tensor");
    m.def("paged_attention_mixed(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
          "Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
    m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
          "Tensor slot_mapping) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps, ScalarType? out_dtype=None) -> Tensor");
    m.def("residual_add(Tensor(a!) residual, Tensor delta) -> ()");
    m.def("argmax_rows(Tensor x) -> Tensor");
    m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
    m.def("silu_and_mul(Tensor gate_up) -> Tensor");
    m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor order, Tensor segment_starts, "
          "Tensor segment_slots, Tensor segment_scalings, Tensor column_bounds) -> ()");
    m.def("linear_few_rows(Tensor x, Tensor weight, Tensor? bias, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagewise_cpu, CPU, m) {
    m.impl("paged_attention_decode", &paged_attention_decode);
    m.impl("paged_attention_mixed", &paged_attention_mixed);
    m.impl("reshape_and_cache", &reshape_and_cache);
    m.impl("rms_norm", &rms_norm);
    m.impl("residual_add", &residual_add);
    m.impl("argmax_rows", &argmax_rows);
    m.impl("rotary_embedding", &rotary_embedding);
    m.impl("silu_and_mul", &silu_and_mul);
    m.impl("lora_add", &lora_add);
    m.impl("linear_few_rows", &linear_few_rows);
}
