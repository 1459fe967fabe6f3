/* CPU kernels of the engine's prefill (engine/cpu_attention.py, engine/mlx_lm_compat.py):
 * a row softmax in place, and silu(gate) * up in place.
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
#ifndef MLXKV_KERNELS_H
#define MLXKV_KERNELS_H

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
    /* exp(x - m), lane by lane; -inf (a masked score) gives exactly 0, +inf 2**127. */      \
    attr static inline __attribute__((always_inline)) vf_##sfx exp_##sfx(vf_##sfx x,          \
                                                                        vf_##sfx m) {        \
        const vf_##sfx lowest = (vf_##sfx){0} - 127.0f, highest = (vf_##sfx){0} + 127.0f;    \
        vf_##sfx y = (x - m) * MK_LOG2E;                                                     \
        y = select_##sfx(y > lowest, y, lowest); /* below 2**-126: 0 */                      \
        y = select_##sfx(y < highest, y, highest); /* above 2**127: 2**127 (finite) */       \
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
    }                                                                                        \
    /* g[i] = silu(g[i]) * u[i] = g * u / (1 + exp(-g)) for i in [i0, i1) */                  \
    attr static void mk_swiglu_##sfx(float *g, const float *u, int64_t i0, int64_t i1) {     \
        const int64_t w = W_##sfx;                                                           \
        const vf_##sfx zero = (vf_##sfx){0}, one = zero + 1.0f;                              \
        int64_t j = i0;                                                                      \
        for (; j + w <= i1; j += w) {                                                        \
            vf_##sfx gv = load_##sfx(g + j);                                                 \
            vf_##sfx r = gv * load_##sfx(u + j) / (one + exp_##sfx(zero - gv, zero));         \
            memcpy(g + j, &r, sizeof r);                                                     \
        }                                                                                    \
        if (j < i1) {                                                                        \
            float ga[W_##sfx], ua[W_##sfx];                                                  \
            memset(ga, 0, sizeof ga);                                                        \
            memset(ua, 0, sizeof ua);                                                        \
            memcpy(ga, g + j, (size_t)(i1 - j) * sizeof(float));                             \
            memcpy(ua, u + j, (size_t)(i1 - j) * sizeof(float));                             \
            vf_##sfx gv = load_##sfx(ga);                                                    \
            vf_##sfx r = gv * load_##sfx(ua) / (one + exp_##sfx(zero - gv, zero));            \
            memcpy(ga, &r, sizeof r);                                                        \
            memcpy(g + j, ga, (size_t)(i1 - j) * sizeof(float));                             \
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
typedef void (*mk_swiglu_fn)(float *, const float *, int64_t, int64_t);

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

/* One thread's share: softmax rows [i0, i1), or swiglu elements [i0, i1). */
typedef struct {
    int isa;
    float *s;
    const float *u; /* NULL: softmax */
    int64_t i0, i1, cols, group, first_visible;
} mk_job;

static void *mk_run_job(void *arg) {
    mk_job *j = (mk_job *)arg;
    mk_rows_fn rows = mk_rows_base;
    mk_swiglu_fn swiglu = mk_swiglu_base;
#if MK_X86
    if (j->isa == 2) rows = mk_rows_avx512, swiglu = mk_swiglu_avx512;
    if (j->isa == 1) rows = mk_rows_avx2, swiglu = mk_swiglu_avx2;
#endif
    if (j->u == NULL)
        rows(j->s, j->i0, j->i1, j->cols, j->group, j->first_visible);
    else
        swiglu(j->s, j->u, j->i0, j->i1);
    return NULL;
}

/* `job` over [0, count) split in `threads` shares (the calling thread runs one); `work`:
 * the elements it touches, which decide whether threads pay for their start. */
static void mk_parallel(mk_job job, int64_t count, int64_t work, int threads) {
    if (mk_isa < 0) mk_isa = mk_best_isa();
    job.isa = mk_isa;
    if (threads > MK_MAX_THREADS) threads = MK_MAX_THREADS;
    /* A thread start costs tens of microseconds: only for a few hundred thousand elements. */
    if (threads > 1 && work / threads < (1 << 17)) threads = (int)(work >> 17);
    if (threads > count) threads = (int)count;
#if MK_HAVE_THREADS
    if (threads > 1) {
        pthread_t tid[MK_MAX_THREADS];
        mk_job jobs[MK_MAX_THREADS];
        int started[MK_MAX_THREADS];
        for (int t = 0; t < threads; t++) {
            jobs[t] = job;
            jobs[t].i0 = count * t / threads;
            jobs[t].i1 = count * (t + 1) / threads;
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
    job.i0 = 0;
    job.i1 = count;
    mk_run_job(&job);
}

/* Rows [0, rows) of s ([rows, cols], C order) in place, over up to `threads` threads. */
static void mk_softmax_rows(float *s, int64_t rows, int64_t cols, int64_t group,
                            int64_t first_visible, int threads) {
    mk_job job = {0, s, NULL, 0, 0, cols, group, first_visible};
    mk_parallel(job, rows, rows * cols, threads);
}

/* g = silu(g) * u over n elements, in place, over up to `threads` threads. */
static void mk_swiglu(float *g, const float *u, int64_t n, int threads) {
    mk_job job = {0, g, u, 0, 0, 0, 0, 0};
    mk_parallel(job, n, n, threads);
}

#endif
