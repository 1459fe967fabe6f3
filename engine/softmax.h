/* Row softmax in place, for the CPU attention of engine/cpu_attention.py.
 *
 * A row of scores [cols] becomes exp(x - max) / sum over its first `visible` entries and 0
 * after them (a causal mask: query r of a block sees keys up to its position). One call
 * covers rows of several query groups: row r sees first_visible + r % group keys.
 *
 * exp is 2**n * 2**f (n whole, f in [0, 1)), a degree-7 polynomial for 2**f and the
 * exponent bits for 2**n, as the MLX graph it replaces computed it, a vector register at a
 * time in the compiler's generic vectors; the row kernel is built three times on x86-64 (baseline,
 * AVX2+FMA, AVX-512F), picked once by the CPU's flags. Rows are split over up to MK_MAX_THREADS POSIX threads when there are
 * enough of them to pay for a thread start.
 */
#ifndef MLXKV_SOFTMAX_H
#define MLXKV_SOFTMAX_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(_WIN32)
#include <pthread.h>
#define MK_HAVE_THREADS 1
#else
#define MK_HAVE_THREADS 0
#endif

#define MK_MAX_THREADS 8
#define MK_LOG2E 1.4426950408889634f

/* The row kernel for vectors of `bytes` bytes in the compiler's generic vector types, built
 * once per instruction set: the vector width must be the target's own (wider generic
 * vectors are split into slow sequences for int<->float conversions). */
#define MK_DEFINE_KERNEL(sfx, attr, bytes)                                                   \
    typedef float vf_##sfx __attribute__((vector_size(bytes)));                              \
    typedef int32_t vi_##sfx __attribute__((vector_size(bytes)));                            \
    enum { W_##sfx = (bytes) / 4 };                                                          \
                                                                                             \
    attr static inline __attribute__((always_inline)) vf_##sfx load_##sfx(const float *p) {  \
        vf_##sfx v;                                                                          \
        memcpy(&v, p, sizeof v);                                                             \
        return v;                                                                            \
    }                                                                                        \
    /* a where mask (all bits set), else b */                                                \
    attr static inline __attribute__((always_inline)) vf_##sfx select_##sfx(                 \
        vi_##sfx mask, vf_##sfx a, vf_##sfx b) {                                             \
        return (vf_##sfx)((mask & (vi_##sfx)a) | (~mask & (vi_##sfx)b));                     \
    }                                                                                        \
    /* exp(x - m) for x <= m, lane by lane; -inf (a masked score) gives exactly 0. */        \
    attr static inline __attribute__((always_inline)) vf_##sfx exp_##sfx(vf_##sfx x,          \
                                                                        vf_##sfx m) {        \
        const vf_##sfx lowest = (vf_##sfx){0} - 127.0f;                                      \
        vf_##sfx y = (x - m) * MK_LOG2E;                                                     \
        y = select_##sfx(y > lowest, y, lowest); /* below 2**-126: 0 */                      \
        vi_##sfx ni = __builtin_convertvector(y, vi_##sfx); /* towards zero */               \
        vf_##sfx n = __builtin_convertvector(ni, vf_##sfx);                                  \
        vi_##sfx above = n > y; /* -1 where truncation went above y: floor is one less */    \
        ni = ni + above;                                                                     \
        n = n + __builtin_convertvector(above, vf_##sfx);                                    \
        vf_##sfx f = y - n;                                                                  \
        vf_##sfx p = f * 1.525273380405984e-05f + 0.00015403530393381609f;                   \
        p = p * f + 0.0013333558146428443f;                                                  \
        p = p * f + 0.009618129107628477f;                                                   \
        p = p * f + 0.05550410866482158f;                                                    \
        p = p * f + 0.2402265069591007f;                                                     \
        p = p * f + 0.6931471805599453f;                                                     \
        p = p * f + 1.0f;                                                                    \
        return p * (vf_##sfx)((ni + 127) << 23);                                             \
    }                                                                                        \
    /* x[0, n) in place, n < W: through a zero-padded vector */                              \
    attr static inline float exp_tail_##sfx(float *x, int64_t n, float m) {                  \
        float lane[W_##sfx];                                                                 \
        memset(lane, 0, sizeof lane);                                                        \
        memcpy(lane, x, (size_t)n * sizeof(float));                                          \
        vf_##sfx e = exp_##sfx(load_##sfx(lane), (vf_##sfx){0} + m);                         \
        memcpy(lane, &e, sizeof e);                                                          \
        memcpy(x, lane, (size_t)n * sizeof(float));                                          \
        float sum = 0.0f;                                                                    \
        for (int64_t k = 0; k < n; k++) sum += lane[k];                                      \
        return sum;                                                                          \
    }                                                                                        \
    attr static void mk_rows_##sfx(float *s, int64_t r0, int64_t r1, int64_t cols,           \
                                   int64_t group, int64_t first_visible) {                   \
        const int64_t w = W_##sfx;                                                           \
        for (int64_t r = r0; r < r1; r++) {                                                  \
            float *x = s + r * cols;                                                         \
            int64_t v = first_visible + (group > 0 ? r % group : 0);                         \
            if (v > cols) v = cols;                                                          \
            if (v < 0) v = 0;                                                                \
            vf_##sfx vm = (vf_##sfx){0} - INFINITY;                                          \
            int64_t j = 0;                                                                   \
            for (; j + w <= v; j += w) {                                                     \
                vf_##sfx xv = load_##sfx(x + j);                                             \
                vm = select_##sfx(xv > vm, xv, vm);                                          \
            }                                                                                \
            float m = -INFINITY;                                                             \
            for (int k = 0; k < w; k++) m = vm[k] > m ? vm[k] : m;                           \
            for (; j < v; j++) m = x[j] > m ? x[j] : m;                                      \
            if (m == -INFINITY) { /* nothing visible: no weight anywhere */                  \
                memset(x, 0, (size_t)cols * sizeof(float));                                  \
                continue;                                                                    \
            }                                                                                \
            vf_##sfx mv = (vf_##sfx){0} + m, acc = (vf_##sfx){0};                            \
            for (j = 0; j + w <= v; j += w) {                                                \
                vf_##sfx e = exp_##sfx(load_##sfx(x + j), mv);                               \
                memcpy(x + j, &e, sizeof e);                                                 \
                acc += e;                                                                    \
            }                                                                                \
            float sum = 0.0f;                                                                \
            for (int k = 0; k < w; k++) sum += acc[k];                                       \
            if (j < v) sum += exp_tail_##sfx(x + j, v - j, m);                               \
            float inv = 1.0f / sum;                                                          \
            vf_##sfx iv = (vf_##sfx){0} + inv;                                               \
            for (j = 0; j + w <= v; j += w) {                                                \
                vf_##sfx e = load_##sfx(x + j) * iv;                                         \
                memcpy(x + j, &e, sizeof e);                                                 \
            }                                                                                \
            for (; j < v; j++) x[j] *= inv;                                                  \
            if (v < cols) memset(x + v, 0, (size_t)(cols - v) * sizeof(float));              \
        }                                                                                    \
    }

MK_DEFINE_KERNEL(base, , 16)

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MK_X86 1
MK_DEFINE_KERNEL(avx2, __attribute__((target("avx2,fma"))), 32)
MK_DEFINE_KERNEL(avx512, __attribute__((target("avx512f"))), 64)
#else
#define MK_X86 0
#endif

typedef void (*mk_rows_fn)(float *, int64_t, int64_t, int64_t, int64_t, int64_t);

/* 0: baseline, 1: AVX2+FMA, 2: AVX-512F; -1: not picked yet. */
static int mk_isa = -1;

static int mk_best_isa(void) {
#if MK_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

static mk_rows_fn mk_rows_for(int isa) {
#if MK_X86
    if (isa == 2) return mk_rows_avx512;
    if (isa == 1) return mk_rows_avx2;
#endif
    (void)isa;
    return mk_rows_base;
}

typedef struct {
    mk_rows_fn fn;
    float *s;
    int64_t r0, r1, cols, group, first_visible;
} mk_job;

#if MK_HAVE_THREADS
static void *mk_run_job(void *arg) {
    mk_job *j = (mk_job *)arg;
    j->fn(j->s, j->r0, j->r1, j->cols, j->group, j->first_visible);
    return NULL;
}
#endif

/* Rows [0, rows) of s ([rows, cols], C order) in place, over up to `threads` threads
 * (the calling one among them). */
static void mk_softmax_rows(float *s, int64_t rows, int64_t cols, int64_t group,
                            int64_t first_visible, int threads) {
    if (mk_isa < 0) mk_isa = mk_best_isa();
    mk_rows_fn fn = mk_rows_for(mk_isa);
    if (threads > MK_MAX_THREADS) threads = MK_MAX_THREADS;
    /* A thread start costs tens of microseconds: only for a few hundred thousand scores. */
    if (threads > 1 && rows * cols / threads < (1 << 17)) threads = (int)(rows * cols >> 17);
    if (threads > rows) threads = (int)rows;
#if MK_HAVE_THREADS
    if (threads > 1) {
        pthread_t tid[MK_MAX_THREADS];
        mk_job jobs[MK_MAX_THREADS];
        int started[MK_MAX_THREADS];
        for (int t = 0; t < threads; t++) {
            jobs[t] = (mk_job){fn, s, rows * t / threads, rows * (t + 1) / threads, cols, group,
                               first_visible};
            started[t] = t > 0 && pthread_create(&tid[t], NULL, mk_run_job, &jobs[t]) == 0;
        }
        for (int t = 1; t < threads; t++)
            if (!started[t]) mk_run_job(&jobs[t]); /* no thread: run its share here */
        mk_run_job(&jobs[0]);
        for (int t = 1; t < threads; t++)
            if (started[t]) pthread_join(tid[t], NULL);
        return;
    }
#endif
    fn(s, 0, rows, cols, group, first_visible);
}

#endif
