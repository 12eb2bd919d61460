/* sparsync's C kernels: stream compaction by magnitude (see sparsync/native/__init__.py).
 *
 * compact: the indices i with |x[i]| >= t, in ascending order, written to out[0 .. min(count, cap))
 * and their number returned (also when it exceeds cap: the caller grows its buffer and calls again).
 * NaN never passes (an ordered comparison is false for NaN), +-inf always does (t is finite).
 *
 * Why C: torch has no stream compaction on the CPU; `nonzero` over a mask costs ~2.5 ns per
 * element, several times a read of the input. Here a 64-element group is tested with eight AVX2
 * compares whose sign bits form one 64-bit mask, and only its set bits are visited
 * (count-trailing-zeros), so the pass runs near the speed of reading x.
 * Without AVX2 (another CPU, another compiler) a plain loop gives the same result.
 *
 * momentum_fold: momentum correction and error feedback in one pass (sparsync.convergence): per entry
 * u = m u + g, then r += u (or, Nesterov, r += g + m u). torch needs two passes for it (three with
 * Nesterov: the look-ahead goes through a buffer), each reading and writing whole arrays.
 * The arithmetic is torch's, operation by operation: `torch.add(g, u, alpha=m)` is a fused
 * multiply-add (one rounding) and `r.add_(x)` a plain add, so the bits are the same.
 *
 * zero_nt / sum_check: whole-array passes with non-temporal ("streaming") stores, for outputs far
 * larger than the caches. A normal store first reads the line it writes (read-for-ownership), so
 * torch's zero_ moves 2 bytes per byte written, a streaming store 1: measured at 25.6M fp32 on one
 * thread, zero_ 8.2 ms, glibc memset 4.0, zero_nt 2.8. sum_check writes out = r + g (or a copy of
 * g) and tells whether every out is finite in the same pass: the reducers' non-finite check of
 * their input (sparsync/reducers/base.py) without a read pass of its own, before anything is sent
 * and without touching r (out is another buffer, so nothing is lost when g holds a NaN). The sum
 * is checked, not g: a non-finite g makes it non-finite, and so does a finite g that overflows
 * the residual r.
 *
 * take_clear: out[p] = x[idx[p]], then x[idx[p]] = 0 - the gather of the values to send and the
 * error feedback's zeroing of the sent entries in one visit of each cache line instead of two.
 *
 * chunked_topk / add_packed: SparseLoCo's selection and the receiving side of its message
 * (sparsync/select/chunked.py, sparsync/select/quantise.py). torch finds a chunk's k-th magnitude
 * with a batched topk (a sort-like pass per row) and then compacts a mask; here one vectorised pass
 * gathers the entries at or above a guess (0.75 x the previous chunk's k-th magnitude) and, when they
 * are at least k, a radix select on their magnitudes' bits (the bits of |x| as an unsigned integer
 * order like |x|) finds the k-th among them and they are emitted in ascending order; otherwise the
 * radix select runs over the whole chunk (held in L1) and a last pass emits. add_packed unpacks a message's chunk-local
 * indices and value codes and adds the table's values in the same loop (torch: two unpacks through
 * int64 temporaries, a gather and an index_add_).
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The exported interface: every function the library exports, one prototype per line, and nothing
 * else is exported (-fvisibility=hidden). The compiler holds each definition to its prototype here
 * (-Wmissing-prototypes, conflicting types are an error); sparsync/native/binding.py reads this
 * block from the source the library reports it was built from and refuses a library whose
 * exports differ from its ctypes table. "ptr" parameters are all pointers to the data named. */
#define SPARSYNC_API __attribute__((visibility("default")))
/* exports: begin */
SPARSYNC_API const char *sparsync_source_sha(void);
SPARSYNC_API int sparsync_vectorised(void);
SPARSYNC_API int64_t sparsync_compact_abs_ge_f32(const float *x, int64_t n, float t, int64_t base, int64_t *out, int64_t cap);
SPARSYNC_API int64_t sparsync_compact_rows_abs_ge_f32(const float *x, int64_t rows, int64_t cols, const float *t, int64_t *out, int64_t cap);
SPARSYNC_API void sparsync_bucket_count_f32(const float *v, int64_t n, const float *edges, int64_t ne, int64_t *bucket, int64_t *hist);
SPARSYNC_API int64_t sparsync_decode_block16(const int16_t *msg, int64_t nb, int64_t start, int64_t count, int64_t *out);
SPARSYNC_API void sparsync_momentum_fold_f32(float *u, float *r, const float *g, int64_t n, float m, int nesterov);
SPARSYNC_API void sparsync_zero_nt(void *p, int64_t nbytes);
SPARSYNC_API int sparsync_sum_check_f32(float *out, const float *r, const float *g, int64_t n);
SPARSYNC_API int sparsync_take_clear_f32(float *x, int64_t n, const int64_t *idx, int64_t k, float *out);
SPARSYNC_API int64_t sparsync_chunked_topk_f32(const float *x, int64_t n, int64_t chunk, int64_t k, int64_t klast, int64_t *out);
SPARSYNC_API int64_t sparsync_add_packed_f32(float *out, int64_t n, const uint8_t *msg, int64_t count, int64_t chunk, int64_t k, int width, int bits);
/* exports: end */

/* The SHA-256 of this file, given by the build (-DSPARSYNC_SOURCE_SHA="..."): the version of the
 * interface, derived rather than numbered by hand (a library built from other source is refused). */
#ifndef SPARSYNC_SOURCE_SHA
#define SPARSYNC_SOURCE_SHA "unknown"
#endif
const char *sparsync_source_sha(void) { return SPARSYNC_SOURCE_SHA; }

static int64_t compact_plain(const float *x, int64_t n, float t, int64_t base, int64_t *out, int64_t cap) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        if (fabsf(x[i]) >= t) {
            if (c < cap) out[c] = base + i;
            c++;
        }
    }
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPARSYNC_HAVE_AVX2_PATH 1

__attribute__((target("avx2")))
static int64_t compact_avx2(const float *x, int64_t n, float t, int64_t base, int64_t *out, int64_t cap) {
    int64_t c = 0, i = 0;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 tv = _mm256_set1_ps(t);
    for (; i + 64 <= n; i += 64) {
        uint64_t m = 0;
        for (int g = 0; g < 8; g++) {
            __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i + 8 * g), absmask);
            m |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, tv, _CMP_GE_OQ)) << (8 * g);
        }
        if (c + 64 <= cap) {
            while (m) {
                out[c++] = base + i + __builtin_ctzll(m);
                m &= m - 1;
            }
        } else {
            while (m) {
                if (c < cap) out[c] = base + i + __builtin_ctzll(m);
                c++;
                m &= m - 1;
            }
        }
    }
    int64_t room = cap > c ? cap - c : 0;
    return c + compact_plain(x + i, n - i, t, base + i, out + c, room);
}
#endif

/* The CPU's features, read once when the library is loaded (a constructor runs at dlopen), not per
 * call: every kernel below branches on these two flags. */
static int cpu_avx2;

#ifdef SPARSYNC_HAVE_AVX2_PATH
static int cpu_fma;

__attribute__((constructor)) static void detect_cpu(void) {
    __builtin_cpu_init();  /* required before __builtin_cpu_supports in a constructor */
    cpu_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    cpu_fma = __builtin_cpu_supports("fma") ? 1 : 0;
}
#endif

/* 1 when the vectorised path runs on this CPU (reported by sparsync.native.info()). */
int sparsync_vectorised(void) { return cpu_avx2; }

int64_t sparsync_compact_abs_ge_f32(const float *x, int64_t n, float t, int64_t base, int64_t *out, int64_t cap) {
#ifdef SPARSYNC_HAVE_AVX2_PATH
    if (cpu_avx2) return compact_avx2(x, n, t, base, out, cap);
#endif
    return compact_plain(x, n, t, base, out, cap);
}

/* Row by row of a row-major [rows, cols] matrix with a threshold per row: flat indices r*cols + c,
 * ascending (SparDL's per-block selection in one call, no loop over blocks in Python). */
int64_t sparsync_compact_rows_abs_ge_f32(const float *x, int64_t rows, int64_t cols, const float *t,
                                         int64_t *out, int64_t cap) {
    int64_t c = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t room = cap > c ? cap - c : 0;
        c += sparsync_compact_abs_ge_f32(x + r * cols, cols, t[r], r * cols, out + (cap > c ? c : cap), room);
    }
    return c;
}

/* Bucket of every value among sorted edges: bucket[i] = #{j : edges[j] <= v[i]} (NaN: ne, as
 * torch.bucketize(right=True) puts it), and hist[b] = #{i : bucket[i] = b} for b in [0, ne]
 * (hist has ne + 1 entries; zeroed here). A branch-free binary search per value (a mispredicted
 * branch per halving made the branching form slower than the torch form): MiCRO's calibration histogram
 * of its candidates without the log, the rounding fix and the bincount of the torch form. */
void sparsync_bucket_count_f32(const float *v, int64_t n, const float *edges, int64_t ne,
                               int64_t *bucket, int64_t *hist) {
    for (int64_t b = 0; b <= ne; b++) hist[b] = 0;
    for (int64_t i = 0; i < n; i++) {
        float x = v[i];
        int64_t b;
        if (x != x) {
            b = ne;
        } else {
            /* branchless: the count lies in [p - edges, p - edges + m]; halve m with a select */
            const float *p = edges;
            int64_t m = ne;
            while (m > 1) {
                int64_t h = m >> 1;
                p = (p[h] <= x) ? p + h : p;
                m -= h;
            }
            b = (p - edges) + (p[0] <= x);
        }
        bucket[i] = b;
        hist[b]++;
    }
}

/* MiCRO's 16-bit block offsets (sparsync/blockindex.py): msg = nb int32 counts (as 2 nb int16
 * words, read with memcpy: the words need not be 4-byte aligned), then one int16 offset per index,
 * stored as (idx - start) mod 65536 - 32768. Writes out[0 .. count) (block by block, so the
 * indices come out sorted) and returns the sum of the counts; the caller checks it equals count
 * and never reads past msg[2 nb + count) (decoding stops at count). */
int64_t sparsync_decode_block16(const int16_t *msg, int64_t nb, int64_t start, int64_t count, int64_t *out) {
    int64_t total = 0, i = 0;
    const int16_t *off = msg + 2 * nb;
    for (int64_t b = 0; b < nb; b++) {
        int32_t c;
        memcpy(&c, msg + 2 * b, sizeof c);
        total += c;
        int64_t base = start + b * 65536 + 32768;
        for (int32_t j = 0; j < c && i < count; j++, i++) out[i] = base + off[i];
    }
    return total;
}

/* u = m u + g; r += u, or r += g + m u with nesterov (each product-sum one rounding, as torch's
 * add with alpha). g == NULL: the gradient is zero, u = u * m and r += u, or r += u * m (torch's
 * mul_, which keeps the sign of a zero product). */
static void fold_plain(float *u, float *r, const float *g, int64_t i, int64_t n, float m, int nesterov) {
    for (; i < n; i++) {
        float gi = g ? g[i] : 0.0f;
        float ui = g ? fmaf(u[i], m, gi) : u[i] * m;
        u[i] = ui;
        r[i] = r[i] + (nesterov ? (g ? fmaf(ui, m, gi) : ui * m) : ui);
    }
}

#ifdef SPARSYNC_HAVE_AVX2_PATH
__attribute__((target("avx2,fma")))
static int64_t fold_avx2(float *u, float *r, const float *g, int64_t n, float m, int nesterov) {
    int64_t i = 0;
    const __m256 mv = _mm256_set1_ps(m);
    if (!g)
        return 0;  /* rare (an unused parameter): the plain loop */
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 uv = _mm256_fmadd_ps(_mm256_loadu_ps(u + i), mv, gv);
        _mm256_storeu_ps(u + i, uv);
        __m256 add = nesterov ? _mm256_fmadd_ps(uv, mv, gv) : uv;
        _mm256_storeu_ps(r + i, _mm256_add_ps(_mm256_loadu_ps(r + i), add));
    }
    return i;
}
#endif

void sparsync_momentum_fold_f32(float *u, float *r, const float *g, int64_t n, float m, int nesterov) {
    int64_t i = 0;
#ifdef SPARSYNC_HAVE_AVX2_PATH
    if (cpu_avx2 && cpu_fma)
        i = fold_avx2(u, r, g, n, m, nesterov);
#endif
    fold_plain(u, r, g, i, n, m, nesterov);
}

/* ---- whole-array passes with streaming stores (zero_nt, sum_check) ---- */

static int finite_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7f800000u) != 0x7f800000u;  /* exponent all ones: Inf or NaN */
}

/* out[i] = r[i] + g[i] (r == NULL: g[i]) for i in [i, n); 0 when some out[i] is not finite */
static int sum_check_plain(float *out, const float *r, const float *g, int64_t i, int64_t n) {
    int ok = 1;
    for (; i < n; i++) {
        float s = r ? r[i] + g[i] : g[i];
        ok &= finite_bits(s);
        out[i] = s;
    }
    return ok;
}

#ifdef SPARSYNC_HAVE_AVX2_PATH
__attribute__((target("avx2")))
static void zero_avx2(char *p, int64_t nbytes) {
    int64_t i = 0;
    const __m256i z = _mm256_setzero_si256();
    int64_t head = (int64_t)((32 - ((uintptr_t)p & 31)) & 31);
    if (head > nbytes) head = nbytes;
    memset(p, 0, (size_t)head);
    for (i = head; i + 128 <= nbytes; i += 128) {
        _mm256_stream_si256((__m256i *)(p + i), z);
        _mm256_stream_si256((__m256i *)(p + i + 32), z);
        _mm256_stream_si256((__m256i *)(p + i + 64), z);
        _mm256_stream_si256((__m256i *)(p + i + 96), z);
    }
    memset(p + i, 0, (size_t)(nbytes - i));
    _mm_sfence();
}

/* the aligned middle of out: returns where it stopped; *ok cleared on a non-finite g */
__attribute__((target("avx2")))
static int64_t sum_check_avx2(float *out, const float *r, const float *g, int64_t i, int64_t n, int *ok) {
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 sv = r ? _mm256_add_ps(_mm256_loadu_ps(r + i), gv) : gv;
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(sv), em), em));
        _mm256_stream_ps(out + i, sv);
    }
    _mm_sfence();
    if (!_mm256_testz_si256(bad, bad)) *ok = 0;
    return i;
}
#endif

void sparsync_zero_nt(void *p, int64_t nbytes) {
#ifdef SPARSYNC_HAVE_AVX2_PATH
    if (cpu_avx2) {
        zero_avx2((char *)p, nbytes);
        return;
    }
#endif
    memset(p, 0, (size_t)nbytes);
}

/* out = r + g (r == NULL: out = g); returns 1 when every out[i] is finite, else 0 (out is written
 * either way). out must not overlap r or g. */
int sparsync_sum_check_f32(float *out, const float *r, const float *g, int64_t n) {
    int64_t i = 0;
    int ok = 1;
#ifdef SPARSYNC_HAVE_AVX2_PATH
    if (cpu_avx2) {
        int64_t head = (int64_t)(((32 - ((uintptr_t)out & 31)) & 31) / sizeof(float));
        if ((uintptr_t)out % sizeof(float) == 0) {
            if (head > n) head = n;
            ok &= sum_check_plain(out, r, g, 0, head);
            i = sum_check_avx2(out, r, g, head, n, &ok);
        }
    }
#endif
    ok &= sum_check_plain(out, r, g, i, n);
    return ok;
}

/* out[p] = x[idx[p]]; x[idx[p]] = +0.0 for p in [0, k), idx strictly ascending in [0, n) (one visit
 * per entry). Returns 0, or -1 without writing anything when idx is not. */
int sparsync_take_clear_f32(float *x, int64_t n, const int64_t *idx, int64_t k, float *out) {
    for (int64_t p = 0; p < k; p++)
        if (idx[p] < 0 || idx[p] >= n || (p > 0 && idx[p] <= idx[p - 1]))
            return -1;
    for (int64_t p = 0; p < k; p++) {
        float *e = x + idx[p];
        out[p] = *e;
        *e = 0.0f;
    }
    return 0;
}

/* The entries of u[0 .. m) (all below 2^31) in [lo, hi), copied to vals in ascending i (vals may be u
 * itself: an entry is written at or before where it was read); returns their count. A kept entry is
 * rare and falls anywhere, so a branch per entry mispredicts on each: the AVX2 form tests 64 entries
 * at once and visits only the set bits of the mask. */
static int64_t in_range_plain(const uint32_t *u, int64_t m, uint32_t lo, uint32_t hi, uint32_t *vals) {
    int64_t c = 0;
    for (int64_t i = 0; i < m; i++)
        if (u[i] >= lo && u[i] < hi) vals[c++] = u[i];
    return c;
}

#ifdef SPARSYNC_HAVE_AVX2_PATH
__attribute__((target("avx2")))
static int64_t in_range_avx2(const uint32_t *u, int64_t m, uint32_t lo, uint32_t hi, uint32_t *vals) {
    int64_t c = 0, i = 0;
    const __m256i below = _mm256_set1_epi32((int32_t)lo - 1), top = _mm256_set1_epi32((int32_t)hi);
    for (; i + 64 <= m; i += 64) {
        uint64_t mask = 0;
        for (int g = 0; g < 8; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(u + i + 8 * g));
            __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(v, below), _mm256_cmpgt_epi32(top, v));
            mask |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(in)) << (8 * g);
        }
        for (; mask; mask &= mask - 1) vals[c++] = u[i + __builtin_ctzll(mask)];
    }
    return c + in_range_plain(u + i, m - i, lo, hi, vals + c);
}
#endif

static int64_t in_range(const uint32_t *u, int64_t m, uint32_t lo, uint32_t hi, uint32_t *vals) {
#ifdef SPARSYNC_HAVE_AVX2_PATH
    if (cpu_avx2 && hi <= 0x7fffffffu) return in_range_avx2(u, m, lo, hi, vals);
#endif
    return in_range_plain(u, m, lo, hi, vals);
}

/* base + i for every u[i] > t and the first `need` of u[i] == t, in ascending i, to out; returns the count
 * (the last pass of the chunked top-k, masked as in_range is). */
static int64_t emit_top_plain(const uint32_t *u, int64_t m, uint32_t t, int64_t need, int64_t base, int64_t *out) {
    int64_t o = 0;
    for (int64_t i = 0; i < m; i++)
        if (u[i] > t || (u[i] == t && need-- > 0)) out[o++] = base + i;
    return o;
}

#ifdef SPARSYNC_HAVE_AVX2_PATH
__attribute__((target("avx2")))
static int64_t emit_top_avx2(const uint32_t *u, int64_t m, uint32_t t, int64_t need, int64_t base, int64_t *out) {
    int64_t o = 0, i = 0;
    const __m256i below = _mm256_set1_epi32((int32_t)t - 1);
    for (; i + 64 <= m; i += 64) {
        uint64_t mask = 0;
        for (int g = 0; g < 8; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(u + i + 8 * g));
            mask |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, below))) << (8 * g);
        }
        while (mask) {
            int64_t j = i + __builtin_ctzll(mask);
            if (u[j] > t || need-- > 0) out[o++] = base + j;
            mask &= mask - 1;
        }
    }
    for (; i < m; i++)
        if (u[i] > t || (u[i] == t && need-- > 0)) out[o++] = base + i;
    return o;
}
#endif

static int64_t emit_top(const uint32_t *u, int64_t m, uint32_t t, int64_t need, int64_t base, int64_t *out) {
#ifdef SPARSYNC_HAVE_AVX2_PATH
    if (cpu_avx2) return emit_top_avx2(u, m, t, need, base, out);
#endif
    return emit_top_plain(u, m, t, need, base, out);
}

/* The k-th largest of u[0 .. m) (0 < k <= m, all below 2^31), returned as t, and in *need how many of
 * the entries equal to t belong to the k largest. A radix select over the 31 magnitude bits in digits of
 * 8, 8, 8, 7 bits: each level counts the candidates' digit, keeps those in the digit where the k-th
 * largest lies (the threshold's next digit) and goes on with what is still needed. cand: scratch of m
 * entries (may be u itself when u may be overwritten). */
static uint32_t radix_select(const uint32_t *u, int64_t m, int64_t k, uint32_t *cand, int64_t *need_out) {
    static const int shift[4] = {23, 15, 7, 0};
    static const uint32_t digit_mask[4] = {0xff, 0xff, 0xff, 0x7f};
    int64_t hist[256];
    int32_t h4[4][256];  /* the first level's count in four interleaved tables: most entries share a
                          * few exponents, and one table would chain every increment on the last */
    int64_t nc = m, need = k;
    uint32_t t = 0;
    memset(h4, 0, sizeof h4);
    int64_t i4 = 0;
    for (; i4 + 4 <= m; i4 += 4)
        for (int j = 0; j < 4; j++) h4[j][u[i4 + j] >> 23]++;
    for (; i4 < m; i4++) h4[0][u[i4] >> 23]++;
    const uint32_t *src = u;
    for (int level = 0; level < 4; level++) {
        int s = shift[level];
        uint32_t dm = digit_mask[level];
        if (level == 0) {
            for (int b = 0; b < 256; b++) hist[b] = (int64_t)h4[0][b] + h4[1][b] + h4[2][b] + h4[3][b];
        } else {
            memset(hist, 0, sizeof hist);
            for (int64_t i = 0; i < nc; i++) hist[(src[i] >> s) & dm]++;
        }
        int64_t above = 0;
        int d = (int)dm;
        while (above + hist[d] < need) above += hist[d--];
        need -= above;
        t |= (uint32_t)d << s;
        /* the candidates keep the digits found so far: [t, t + 2^s) */
        nc = in_range(src, nc, t, t + (1u << s), cand);
        src = cand;
    }
    *need_out = need;
    return t;
}

/* The k largest |x[i]| of x[0 .. m) (0 < k < m), ties at the k-th magnitude taken by ascending i, written
 * to out as base + i in ascending order; returns k. u and cand are scratch of m entries each: u holds
 * the magnitudes' bits, the radix select finds the threshold t, a last pass emits. */
static int64_t topk_chunk(const float *x, int64_t m, int64_t k, int64_t base, uint32_t *u, uint32_t *cand,
                          int64_t *out, uint32_t *t_out) {
    int64_t need;
    for (int64_t i = 0; i < m; i++) {  /* the magnitudes' bits, in one pass */
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        u[i] = b & 0x7fffffffu;
    }
    uint32_t t = radix_select(u, m, k, cand, &need);
    *t_out = t;
    return emit_top(u, m, t, need, base, out);
}

/* Every i of x[0 .. m) whose magnitude's bits are >= g (g >= 1), ascending, to idx as off + i, and
 * those bits to vals; returns the count (the candidates of a guessed threshold). */
static int64_t gather_ge_plain(const float *x, int64_t m, uint32_t g, int64_t off, int32_t *idx, uint32_t *vals) {
    int64_t c = 0;
    for (int64_t i = 0; i < m; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        b &= 0x7fffffffu;
        if (b >= g) {
            idx[c] = (int32_t)(off + i);
            vals[c++] = b;
        }
    }
    return c;
}

#ifdef SPARSYNC_HAVE_AVX2_PATH
__attribute__((target("avx2")))
static int64_t gather_ge_avx2(const float *x, int64_t m, uint32_t g, int32_t *idx, uint32_t *vals) {
    int64_t c = 0, i = 0;
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), below = _mm256_set1_epi32((int32_t)(g - 1));
    for (; i + 64 <= m; i += 64) {
        uint64_t mask = 0;
        for (int q = 0; q < 8; q++) {
            __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 8 * q)), absmask);
            mask |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, below))) << (8 * q);
        }
        for (; mask; mask &= mask - 1) {
            int64_t j = i + __builtin_ctzll(mask);
            uint32_t b;
            memcpy(&b, x + j, sizeof b);
            idx[c] = (int32_t)j;
            vals[c++] = b & 0x7fffffffu;
        }
    }
    return c + gather_ge_plain(x + i, m - i, g, i, idx + c, vals + c);
}
#endif

static int64_t gather_ge(const float *x, int64_t m, uint32_t g, int32_t *idx, uint32_t *vals) {
#ifdef SPARSYNC_HAVE_AVX2_PATH
    if (cpu_avx2) return gather_ge_avx2(x, m, g, idx, vals);
#endif
    return gather_ge_plain(x, m, g, 0, idx, vals);
}

/* The next chunk's guessed threshold from this one's: GUESS_FACTOR x its k-th magnitude (chunks of one
 * tensor have similar scales). A guess that leaves fewer than k entries costs one pass more. */
#define GUESS_FACTOR 0.75f

static uint32_t next_guess(uint32_t t) {
    float f;
    memcpy(&f, &t, sizeof f);
    f *= GUESS_FACTOR;
    uint32_t g;
    memcpy(&g, &f, sizeof g);
    return g;
}

/* Per-chunk top-k of |x| (sparsync.select.chunked.chunked_topk): every full chunk of `chunk` entries
 * gives k indices, a last short chunk klast; written to out in ascending order (full / chunk * k +
 * klast entries: the caller sizes out). Returns the count, or -1 for a k outside [1, chunk] or a
 * klast outside [1, rest] (nothing written). */
int64_t sparsync_chunked_topk_f32(const float *x, int64_t n, int64_t chunk, int64_t k, int64_t klast, int64_t *out) {
    int64_t full = n / chunk, rest = n % chunk, o = 0;
    if (chunk < 1 || k < 1 || k > chunk || (rest && (klast < 1 || klast > rest)) || chunk > INT32_MAX) return -1;
    uint32_t *scratch = malloc((size_t)chunk * 4 * sizeof(uint32_t));
    if (!scratch) return -2;
    uint32_t *u = scratch, *cand = scratch + chunk, *cval = scratch + 2 * chunk;
    int32_t *cidx = (int32_t *)(scratch + 3 * chunk);
    uint32_t guess = 0, t;
    for (int64_t c = 0; c <= full; c++) {
        int64_t m = c < full ? chunk : rest, kk = c < full ? k : klast, base = c * chunk;
        if (m == 0) break;
        if (kk >= m) {
            for (int64_t i = 0; i < m; i++) out[o++] = base + i;
            continue;
        }
        /* Every entry at or above the guess, in ascending order: when there are at least kk, the kk
         * largest are among them (all others lie below each of them), ties included, so selecting
         * from them alone gives the same indices in one pass over the chunk. */
        int64_t nc = guess ? gather_ge(x + base, m, guess, cidx, cval) : 0, need;
        if (nc >= kk) {
            t = radix_select(cval, nc, kk, cand, &need);
            for (int64_t j = 0; j < nc; j++)
                if (cval[j] > t || (cval[j] == t && need-- > 0)) out[o++] = base + cidx[j];
        } else {
            o += topk_chunk(x + base, m, kk, base, u, cand, out + o, &t);
        }
        guess = next_guess(t);
    }
    free(scratch);
    return o;
}

/* Bits [pos, pos + width) of a little-endian bit stream b of nbytes (width <= 25): one unaligned 4-byte
 * load inside the stream, byte by byte at its end. */
static inline uint32_t read_bits(const uint8_t *b, int64_t nbytes, int64_t pos, int width) {
    int64_t byte = pos >> 3;
    uint32_t w = 0;
    if (byte + 4 <= nbytes) {
        memcpy(&w, b + byte, 4);  /* little-endian hosts (x86-64, aarch64) */
    } else {
        for (int j = 0; j < 4 && byte + j < nbytes; j++) w |= (uint32_t)b[byte + j] << (8 * j);
    }
    return (w >> (pos & 7)) & ((1u << width) - 1u);
}

/* One SparseLoCo message (sparsync.select.quantise.encode_message with 2, 4 or 8-bit values): count
 * chunk-local indices of `width` bits, count codes of `bits` bits, a float32 table of 2^bits entries.
 * Entries [q k, (q + 1) k) lie in chunk q (the rest in the chunk after the last full one):
 * out[chunk start + index] += table[code], in entry order (torch's index_add_ of the decode, the
 * same bits). Returns 0, or -1 without writing when an index falls outside out[0 .. n). */
int64_t sparsync_add_packed_f32(float *out, int64_t n, const uint8_t *msg, int64_t count, int64_t chunk, int64_t k,
                                int width, int bits) {
    int64_t ni = (count * width + 7) / 8, nc = (count * bits + 7) / 8, full = n / chunk;
    const uint8_t *codes = msg + ni;
    float table[256];
    memcpy(table, msg + ni + nc, sizeof(float) * ((size_t)1 << bits));
    for (int pass = 0; pass < 2; pass++) {
        int64_t p = 0;
        for (int64_t q = 0; p < count; q++) {
            int64_t start = (q < full ? q : full) * chunk, end = q < full ? p + k : count;
            if (end > count) end = count;
            if (pass == 0) {
                for (; p < end; p++)
                    if (start + read_bits(msg, ni, p * width, width) >= n) return -1;
            } else {
                for (; p < end; p++)
                    out[start + read_bits(msg, ni, p * width, width)] += table[read_bits(codes, nc, p * bits, bits)];
            }
        }
    }
    return 0;
}
