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
 */
#include <stdint.h>
#include <math.h>
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
