/*
 * XXH3-64 for mlxkv, written from the public algorithm description
 * (xxHash spec, doc/xxhash_spec.md: "XXH3 Algorithm Description").
 * Output is bit-identical to the reference XXH3_64bits_withSeed for every length and seed;
 * tests/test_blocks.py checks it against the `xxhash` package.
 *
 * Layout of this header (static functions, included by _blocks.pyx only):
 *   - little helpers (LE loads, 64x64->128 fold, avalanches)
 *   - short inputs (0..16), medium (17..240)
 *   - long inputs: stripe accumulation + block scramble, one loop per ISA
 *     (scalar, SSE2, AVX2, AVX-512 on x86-64 picked at run time; NEON/scalar elsewhere)
 *   - one-shot mk_xxh3_64() and a streaming state (init/update/digest) that the packer feeds
 *     chunk by chunk, plus mk_xxh3_update_copy() which copies and hashes in one pass.
 * Each hash runs one loop from start to end: the *_isa() entry points name it, the others
 * read the selected one once (one-shot: per call; streaming: at init).
 */
#ifndef MLXKV_XXH3_H
#define MLXKV_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define MK_X86 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define MK_NEON 1
#include <arm_neon.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MK_INLINE static inline __attribute__((always_inline))
#define MK_ALIGN64 __attribute__((aligned(64)))
#define MK_API static __attribute__((unused)) /* not every includer uses every function */
#else
#define MK_INLINE static inline
#define MK_ALIGN64
#define MK_API static
#endif

#define MK_P32_1 0x9E3779B1U
#define MK_P32_2 0x85EBCA77U
#define MK_P32_3 0xC2B2AE3DU
#define MK_P64_1 0x9E3779B185EBCA87ULL
#define MK_P64_2 0xC2B2AE3D27D4EB4FULL
#define MK_P64_3 0x165667B19E3779F9ULL
#define MK_P64_4 0x85EBCA77C2B2AE63ULL
#define MK_P64_5 0x27D4EB2F165667C5ULL
#define MK_PMX1 0x165667919E3779F9ULL
#define MK_PMX2 0x9FB21C651E98DF25ULL

#define MK_SECRET_LEN 192
#define MK_STRIPE 64
#define MK_STRIPES_PER_BLOCK ((MK_SECRET_LEN - MK_STRIPE) / 8) /* 16 */
#define MK_MIDSIZE_MAX 240
#define MK_BUF_LEN 256 /* streaming buffer: >= 240 and a multiple of the stripe */

/* The default 192-byte secret (a constant of the algorithm, listed in the spec). */
static const uint8_t mk_default_secret[MK_SECRET_LEN] MK_ALIGN64 = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ---------------------------------------------------------------- helpers */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define MK_BIG_ENDIAN 1
#endif

MK_INLINE uint32_t mk_bswap32(uint32_t x) { return __builtin_bswap32(x); }
MK_INLINE uint64_t mk_bswap64(uint64_t x) { return __builtin_bswap64(x); }

MK_INLINE uint32_t mk_read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#ifdef MK_BIG_ENDIAN
    v = mk_bswap32(v);
#endif
    return v;
}

MK_INLINE uint64_t mk_read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#ifdef MK_BIG_ENDIAN
    v = mk_bswap64(v);
#endif
    return v;
}

MK_INLINE void mk_write64(uint8_t *p, uint64_t v) {
#ifdef MK_BIG_ENDIAN
    v = mk_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

MK_INLINE uint64_t mk_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* 64x64 -> 128 multiply, folded to 64 bits (low xor high). */
MK_INLINE uint64_t mk_mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
#else
    uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t hi = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lo = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lo ^ hi;
#endif
}

/* XXH3's own final mix. */
MK_INLINE uint64_t mk_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= MK_PMX1;
    h ^= h >> 32;
    return h;
}

/* XXH64's final mix, used by the tiny-input paths. */
MK_INLINE uint64_t mk_avalanche_xxh64(uint64_t h) {
    h ^= h >> 33;
    h *= MK_P64_2;
    h ^= h >> 29;
    h *= MK_P64_3;
    h ^= h >> 32;
    return h;
}

/* ---------------------------------------------------------- short inputs */

MK_INLINE uint64_t mk_len_0(const uint8_t *secret, uint64_t seed) {
    return mk_avalanche_xxh64(seed ^ mk_read64(secret + 56) ^ mk_read64(secret + 64));
}

MK_INLINE uint64_t mk_len_1to3(const uint8_t *p, size_t len, const uint8_t *secret,
                               uint64_t seed) {
    /* bytes: | last | length | first | middle | from LSB to MSB */
    uint32_t combined = ((uint32_t)p[len - 1]) | ((uint32_t)len << 8) | ((uint32_t)p[0] << 16) |
                        ((uint32_t)p[len >> 1] << 24);
    uint64_t flip = (uint64_t)(mk_read32(secret) ^ mk_read32(secret + 4)) + seed;
    return mk_avalanche_xxh64((uint64_t)combined ^ flip);
}

MK_INLINE uint64_t mk_len_4to8(const uint8_t *p, size_t len, const uint8_t *secret,
                               uint64_t seed) {
    seed ^= (uint64_t)mk_bswap32((uint32_t)seed) << 32;
    uint64_t first = mk_read32(p);
    uint64_t last = mk_read32(p + len - 4);
    uint64_t flip = (mk_read64(secret + 8) ^ mk_read64(secret + 16)) - seed;
    uint64_t v = (last | (first << 32)) ^ flip;
    v ^= mk_rotl64(v, 49) ^ mk_rotl64(v, 24);
    v *= MK_PMX2;
    v ^= (v >> 35) + (uint64_t)len;
    v *= MK_PMX2;
    v ^= v >> 28;
    return v;
}

MK_INLINE uint64_t mk_len_9to16(const uint8_t *p, size_t len, const uint8_t *secret,
                                uint64_t seed) {
    uint64_t lo = ((mk_read64(secret + 24) ^ mk_read64(secret + 32)) + seed) ^ mk_read64(p);
    uint64_t hi = ((mk_read64(secret + 40) ^ mk_read64(secret + 48)) - seed) ^
                  mk_read64(p + len - 8);
    uint64_t v = (uint64_t)len + mk_bswap64(lo) + hi + mk_mul128_fold64(lo, hi);
    return mk_avalanche(v);
}

/* One 16-byte chunk of data against 16 bytes of secret. */
MK_INLINE uint64_t mk_mix16(const uint8_t *p, const uint8_t *s, uint64_t seed) {
    uint64_t lo = mk_read64(p) ^ (mk_read64(s) + seed);
    uint64_t hi = mk_read64(p + 8) ^ (mk_read64(s + 8) - seed);
    return mk_mul128_fold64(lo, hi);
}

static uint64_t mk_len_17to128(const uint8_t *p, size_t len, const uint8_t *secret,
                               uint64_t seed) {
    /* Pairs of chunks from both ends; the accumulator only adds, so order is free. */
    uint64_t acc = (uint64_t)len * MK_P64_1;
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = 0; i < rounds; i++) {
        acc += mk_mix16(p + 16 * i, secret + 32 * i, seed);
        acc += mk_mix16(p + len - 16 - 16 * i, secret + 32 * i + 16, seed);
    }
    return mk_avalanche(acc);
}

static uint64_t mk_len_129to240(const uint8_t *p, size_t len, const uint8_t *secret,
                                uint64_t seed) {
    uint64_t acc = (uint64_t)len * MK_P64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) acc += mk_mix16(p + 16 * i, secret + 16 * i, seed);
    acc = mk_avalanche(acc);
    for (size_t i = 8; i < chunks; i++) acc += mk_mix16(p + 16 * i, secret + 16 * (i - 8) + 3, seed);
    acc += mk_mix16(p + len - 16, secret + 136 - 17, seed);
    return mk_avalanche(acc);
}

/* Any input of at most 240 bytes (always hashed with the default secret and the seed). */
static uint64_t mk_xxh3_short(const uint8_t *p, size_t len, uint64_t seed) {
    const uint8_t *s = mk_default_secret;
    if (len <= 16) {
        if (len > 8) return mk_len_9to16(p, len, s, seed);
        if (len >= 4) return mk_len_4to8(p, len, s, seed);
        if (len > 0) return mk_len_1to3(p, len, s, seed);
        return mk_len_0(s, seed);
    }
    if (len <= 128) return mk_len_17to128(p, len, s, seed);
    return mk_len_129to240(p, len, s, seed);
}

/* ----------------------------------------------------------- long inputs */

/* For a seeded long hash the secret is derived: 64-bit words alternately + and - seed. */
static void mk_derive_secret(uint8_t *out, uint64_t seed) {
    for (int i = 0; i < MK_SECRET_LEN / 16; i++) {
        mk_write64(out + 16 * i, mk_read64(mk_default_secret + 16 * i) + seed);
        mk_write64(out + 16 * i + 8, mk_read64(mk_default_secret + 16 * i + 8) - seed);
    }
}

MK_INLINE void mk_acc_init(uint64_t *acc) {
    acc[0] = MK_P32_3;
    acc[1] = MK_P64_1;
    acc[2] = MK_P64_2;
    acc[3] = MK_P64_3;
    acc[4] = MK_P64_4;
    acc[5] = MK_P32_2;
    acc[6] = MK_P64_5;
    acc[7] = MK_P32_1;
}

/* Scalar stripe step: acc[i] += lo32(d^s) * hi32(d^s); acc[i^1] += d. */
MK_INLINE void mk_accumulate_scalar(uint64_t *acc, const uint8_t *p, const uint8_t *s) {
    for (int i = 0; i < 8; i++) {
        uint64_t d = mk_read64(p + 8 * i);
        uint64_t k = d ^ mk_read64(s + 8 * i);
        acc[i ^ 1] += d;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

MK_INLINE void mk_scramble_scalar(uint64_t *acc, const uint8_t *s) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= mk_read64(s + 8 * i);
        acc[i] = a * MK_P32_1;
    }
}

/*
 * Consume `n` full stripes at p, continuing a block that already holds *nb stripes.
 * Callers only pass stripes that are known NOT to be the input's last one, so a completed
 * block is always followed by more data and is scrambled at once.
 * When dst is non-NULL the stripes are also copied there (fused copy + hash); with nt set
 * and dst aligned for the ISA's vectors, with non-temporal stores: a large packed block is
 * headed for the disk, not the cache, and streaming stores skip reading each destination
 * line before writing it (a third of the memory traffic of a plain copy).
 * One definition per ISA: STEP accumulates a stripe, STEPC also stores it to dst from the
 * same registers, STEPNT stores it non-temporally, SCRAMBLE ends a block, FENCE orders
 * non-temporal stores before the function returns.
 */
#define MK_BLOCK_LOOP(STEPX, ADVANCE_DST, SCRAMBLE)                                     \
    while (n) {                                                                         \
        size_t m = MK_STRIPES_PER_BLOCK - k;                                            \
        if (m > n) m = n;                                                               \
        for (size_t j = 0; j < m; j++) {                                                \
            MK_PREFETCH(p + MK_PREFETCH_DIST);                                          \
            STEPX;                                                                      \
            p += MK_STRIPE;                                                             \
            ADVANCE_DST;                                                                \
        }                                                                               \
        n -= m;                                                                         \
        k += m;                                                                         \
        if (k == MK_STRIPES_PER_BLOCK) {                                                \
            SCRAMBLE(secret + MK_SECRET_LEN - MK_STRIPE);                               \
            k = 0;                                                                      \
        }                                                                               \
    }

#define MK_DEFINE_CONSUME(NAME, ATTR, STATE_DECL, LOAD_ACC, STORE_ACC, STEP, STEPC, STEPNT,    \
                          NT_ALIGN, FENCE, SCRAMBLE)                                            \
    ATTR static void NAME(uint64_t *acc, size_t *nb, const uint8_t *secret, const uint8_t *p,   \
                          uint8_t *dst, size_t n, int nt) {                                     \
        STATE_DECL;                                                                             \
        LOAD_ACC;                                                                               \
        size_t k = *nb;                                                                         \
        if (dst == NULL) {                                                                      \
            MK_BLOCK_LOOP(STEP(p, secret + 8 * (k + j)), (void)0, SCRAMBLE)                     \
        } else if (nt && ((uintptr_t)dst & ((NT_ALIGN) - 1)) == 0) {                            \
            MK_BLOCK_LOOP(STEPNT(dst, p, secret + 8 * (k + j)), dst += MK_STRIPE, SCRAMBLE)     \
            FENCE;                                                                              \
        } else {                                                                                \
            MK_BLOCK_LOOP(STEPC(dst, p, secret + 8 * (k + j)), dst += MK_STRIPE, SCRAMBLE)      \
        }                                                                                       \
        *nb = k;                                                                                \
        STORE_ACC;                                                                              \
    }

/* Six stripes ahead: far enough to hide L2/L3 latency on streaming input. */
#define MK_PREFETCH_DIST 384
#if defined(__GNUC__) || defined(__clang__)
#define MK_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define MK_PREFETCH(p) ((void)0)
#endif

/* STORE argument of the hash-only steps: expands to nothing, arguments unevaluated. */
#define MK_NOSTORE(addr, v) ((void)0)

typedef void (*mk_consume_fn)(uint64_t *, size_t *, const uint8_t *, const uint8_t *, uint8_t *,
                              size_t, int);

/* scalar */
#define MK_S_DECL uint64_t a[8]
#define MK_S_LOAD memcpy(a, acc, sizeof a)
#define MK_S_STORE memcpy(acc, a, sizeof a)
#define MK_S_STEP(p, s) mk_accumulate_scalar(a, (p), (s))
#define MK_S_SCRAMBLE(s) mk_scramble_scalar(a, (s))
#define MK_S_STEPC(d, p, s) \
    do { memcpy((d), (p), MK_STRIPE); mk_accumulate_scalar(a, (d), (s)); } while (0)
MK_DEFINE_CONSUME(mk_consume_scalar, , MK_S_DECL, MK_S_LOAD, MK_S_STORE, MK_S_STEP, MK_S_STEPC,
                  MK_S_STEPC, 1, (void)0, MK_S_SCRAMBLE)

#ifdef MK_X86
/* SSE2 (always present on x86-64): 4 registers of 2 lanes. _mm_mul_epu32 multiplies the low
 * 32 bits of each 64-bit lane, so k * (k >> 32) is lo32 * hi32 (a shift, not a shuffle: the
 * shuffle port is the bottleneck); shuffle(d, 0x4E) swaps the two 64-bit lanes, which is the
 * acc[i ^ 1] += d[i] term. */
#define MK_SSE_DECL __m128i a0, a1, a2, a3; const __m128i prime = _mm_set1_epi32((int)MK_P32_1)
#define MK_SSE_LOAD                                  \
    a0 = _mm_loadu_si128((const __m128i *)acc + 0); \
    a1 = _mm_loadu_si128((const __m128i *)acc + 1); \
    a2 = _mm_loadu_si128((const __m128i *)acc + 2); \
    a3 = _mm_loadu_si128((const __m128i *)acc + 3)
#define MK_SSE_STORE                             \
    _mm_storeu_si128((__m128i *)acc + 0, a0); \
    _mm_storeu_si128((__m128i *)acc + 1, a1); \
    _mm_storeu_si128((__m128i *)acc + 2, a2); \
    _mm_storeu_si128((__m128i *)acc + 3, a3)
#define MK_SSE_ACC(A, D, s, i)                                                      \
    do {                                                                            \
        __m128i k_ = _mm_xor_si128(D, _mm_loadu_si128((const __m128i *)(s) + (i))); \
        __m128i m_ = _mm_mul_epu32(k_, _mm_srli_epi64(k_, 32));                \
        A = _mm_add_epi64(A, _mm_add_epi64(_mm_shuffle_epi32(D, 0x4E), m_));        \
    } while (0)
#define MK_SSE_STEP4(dst, p, s, STORE)                                           \
    do {                                                                         \
        __m128i d0 = _mm_loadu_si128((const __m128i *)(p) + 0);                  \
        __m128i d1 = _mm_loadu_si128((const __m128i *)(p) + 1);                  \
        __m128i d2 = _mm_loadu_si128((const __m128i *)(p) + 2);                  \
        __m128i d3 = _mm_loadu_si128((const __m128i *)(p) + 3);                  \
        STORE((__m128i *)(dst) + 0, d0);                                         \
        STORE((__m128i *)(dst) + 1, d1);                                         \
        STORE((__m128i *)(dst) + 2, d2);                                         \
        STORE((__m128i *)(dst) + 3, d3);                                         \
        MK_SSE_ACC(a0, d0, s, 0);                                                \
        MK_SSE_ACC(a1, d1, s, 1);                                                \
        MK_SSE_ACC(a2, d2, s, 2);                                                \
        MK_SSE_ACC(a3, d3, s, 3);                                                \
    } while (0)
#define MK_SSE_STEP(p, s) MK_SSE_STEP4(_, p, s, MK_NOSTORE)
#define MK_SSE_STEPC(d, p, s) MK_SSE_STEP4(d, p, s, _mm_storeu_si128)
#define MK_SSE_STEPNT(d, p, s) MK_SSE_STEP4(d, p, s, _mm_stream_si128)
#define MK_SSE_SCR(A, s, i)                                                    \
    do {                                                                       \
        __m128i x_ = _mm_xor_si128(A, _mm_srli_epi64(A, 47));                  \
        x_ = _mm_xor_si128(x_, _mm_loadu_si128((const __m128i *)(s) + (i)));   \
        __m128i lo_ = _mm_mul_epu32(x_, prime);                                \
        __m128i hi_ = _mm_mul_epu32(_mm_srli_epi64(x_, 32), prime);            \
        A = _mm_add_epi64(lo_, _mm_slli_epi64(hi_, 32));                       \
    } while (0)
#define MK_SSE_SCRAMBLE(s)    \
    do {                      \
        MK_SSE_SCR(a0, s, 0); \
        MK_SSE_SCR(a1, s, 1); \
        MK_SSE_SCR(a2, s, 2); \
        MK_SSE_SCR(a3, s, 3); \
    } while (0)
MK_DEFINE_CONSUME(mk_consume_sse2, , MK_SSE_DECL, MK_SSE_LOAD, MK_SSE_STORE, MK_SSE_STEP,
                  MK_SSE_STEPC, MK_SSE_STEPNT, 16, _mm_sfence(), MK_SSE_SCRAMBLE)

/* AVX2: 2 registers of 4 lanes; the shuffles act within 128-bit halves, exactly as needed. */
#define MK_AVX2_DECL __m256i a0, a1; const __m256i prime = _mm256_set1_epi32((int)MK_P32_1)
#define MK_AVX2_LOAD                                     \
    a0 = _mm256_loadu_si256((const __m256i *)acc + 0); \
    a1 = _mm256_loadu_si256((const __m256i *)acc + 1)
#define MK_AVX2_STORE                               \
    _mm256_storeu_si256((__m256i *)acc + 0, a0); \
    _mm256_storeu_si256((__m256i *)acc + 1, a1)
#define MK_AVX2_ACC(A, D, s, i)                                                          \
    do {                                                                                 \
        __m256i k_ = _mm256_xor_si256(D, _mm256_loadu_si256((const __m256i *)(s) + (i))); \
        __m256i m_ = _mm256_mul_epu32(k_, _mm256_srli_epi64(k_, 32));              \
        A = _mm256_add_epi64(A, _mm256_add_epi64(_mm256_shuffle_epi32(D, 0x4E), m_));   \
    } while (0)
#define MK_AVX2_STEP2(dst, p, s, STORE)                              \
    do {                                                             \
        __m256i d0 = _mm256_loadu_si256((const __m256i *)(p) + 0);   \
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(p) + 1);   \
        STORE((__m256i *)(dst) + 0, d0);                             \
        STORE((__m256i *)(dst) + 1, d1);                             \
        MK_AVX2_ACC(a0, d0, s, 0);                                   \
        MK_AVX2_ACC(a1, d1, s, 1);                                   \
    } while (0)
#define MK_AVX2_STEP(p, s) MK_AVX2_STEP2(_, p, s, MK_NOSTORE)
#define MK_AVX2_STEPC(d, p, s) MK_AVX2_STEP2(d, p, s, _mm256_storeu_si256)
#define MK_AVX2_STEPNT(d, p, s) MK_AVX2_STEP2(d, p, s, _mm256_stream_si256)
#define MK_AVX2_SCR(A, s, i)                                                       \
    do {                                                                           \
        __m256i x_ = _mm256_xor_si256(A, _mm256_srli_epi64(A, 47));                \
        x_ = _mm256_xor_si256(x_, _mm256_loadu_si256((const __m256i *)(s) + (i))); \
        __m256i lo_ = _mm256_mul_epu32(x_, prime);                                 \
        __m256i hi_ = _mm256_mul_epu32(_mm256_srli_epi64(x_, 32), prime);          \
        A = _mm256_add_epi64(lo_, _mm256_slli_epi64(hi_, 32));                     \
    } while (0)
#define MK_AVX2_SCRAMBLE(s)    \
    do {                       \
        MK_AVX2_SCR(a0, s, 0); \
        MK_AVX2_SCR(a1, s, 1); \
    } while (0)
MK_DEFINE_CONSUME(mk_consume_avx2, __attribute__((target("avx2"))), MK_AVX2_DECL, MK_AVX2_LOAD,
                  MK_AVX2_STORE, MK_AVX2_STEP, MK_AVX2_STEPC, MK_AVX2_STEPNT, 32, _mm_sfence(),
                  MK_AVX2_SCRAMBLE)

/* AVX-512F: the whole accumulator in one register. */
#define MK_AVX512_DECL __m512i a0; const __m512i prime = _mm512_set1_epi32((int)MK_P32_1)
#define MK_AVX512_LOAD a0 = _mm512_loadu_si512((const void *)acc)
#define MK_AVX512_STORE _mm512_storeu_si512((void *)acc, a0)
#define MK_AVX512_STEP1(dst, p, s, STORE)                                                    \
    do {                                                                                     \
        __m512i d_ = _mm512_loadu_si512((const void *)(p));                                  \
        STORE((void *)(dst), d_);                                                            \
        __m512i k_ = _mm512_xor_si512(d_, _mm512_loadu_si512((const void *)(s)));            \
        __m512i m_ = _mm512_mul_epu32(k_, _mm512_srli_epi64(k_, 32));    \
        a0 = _mm512_add_epi64(                                                               \
            a0, _mm512_add_epi64(_mm512_shuffle_epi32(d_, (_MM_PERM_ENUM)0x4E), m_));        \
    } while (0)
#define MK_AVX512_STEP(p, s) MK_AVX512_STEP1(_, p, s, MK_NOSTORE)
#define MK_AVX512_STEPC(d, p, s) MK_AVX512_STEP1(d, p, s, _mm512_storeu_si512)
#define MK_AVX512_STEPNT(d, p, s) MK_AVX512_STEP1(d, p, s, _mm512_stream_si512)
#define MK_AVX512_SCRAMBLE(s)                                             \
    do {                                                                  \
        __m512i x_ = _mm512_xor_si512(a0, _mm512_srli_epi64(a0, 47));     \
        x_ = _mm512_xor_si512(x_, _mm512_loadu_si512((const void *)(s))); \
        __m512i lo_ = _mm512_mul_epu32(x_, prime);                        \
        __m512i hi_ = _mm512_mul_epu32(_mm512_srli_epi64(x_, 32), prime); \
        a0 = _mm512_add_epi64(lo_, _mm512_slli_epi64(hi_, 32));           \
    } while (0)
MK_DEFINE_CONSUME(mk_consume_avx512, __attribute__((target("avx512f"))), MK_AVX512_DECL,
                  MK_AVX512_LOAD, MK_AVX512_STORE, MK_AVX512_STEP, MK_AVX512_STEPC,
                  MK_AVX512_STEPNT, 64, _mm_sfence(), MK_AVX512_SCRAMBLE)
#endif /* MK_X86 */

#ifdef MK_NEON
/* NEON: 4 registers of 2 lanes. vmull_u32(low halves, high halves) = lo32 * hi32 per lane;
 * vextq_u64(d, d, 1) swaps the two lanes (acc[i ^ 1] += d[i]). */
#define MK_NEON_DECL uint64x2_t a0, a1, a2, a3
#define MK_NEON_LOAD \
    a0 = vld1q_u64(acc); a1 = vld1q_u64(acc + 2); a2 = vld1q_u64(acc + 4); a3 = vld1q_u64(acc + 6)
#define MK_NEON_STORE_TO(t) \
    vst1q_u64((t), a0); vst1q_u64((t) + 2, a1); vst1q_u64((t) + 4, a2); vst1q_u64((t) + 6, a3)
#define MK_NEON_STORE MK_NEON_STORE_TO(acc)
#define MK_NEON_ACC(A, D, s, i)                                                       \
    do {                                                                              \
        uint64x2_t k_ = veorq_u64(D, vreinterpretq_u64_u8(vld1q_u8((s) + 16 * (i)))); \
        uint64x2_t m_ = vmull_u32(vmovn_u64(k_), vshrn_n_u64(k_, 32));                \
        A = vaddq_u64(A, vaddq_u64(vextq_u64(D, D, 1), m_));                          \
    } while (0)
#define MK_NEON_STEP4(dst, p, s, STORE)                                          \
    do {                                                                    \
        uint64x2_t d0 = vreinterpretq_u64_u8(vld1q_u8((p) + 0));            \
        uint64x2_t d1 = vreinterpretq_u64_u8(vld1q_u8((p) + 16));           \
        uint64x2_t d2 = vreinterpretq_u64_u8(vld1q_u8((p) + 32));           \
        uint64x2_t d3 = vreinterpretq_u64_u8(vld1q_u8((p) + 48));           \
        STORE((uint8_t *)(dst) + 0, vreinterpretq_u8_u64(d0));              \
        STORE((uint8_t *)(dst) + 16, vreinterpretq_u8_u64(d1));             \
        STORE((uint8_t *)(dst) + 32, vreinterpretq_u8_u64(d2));             \
        STORE((uint8_t *)(dst) + 48, vreinterpretq_u8_u64(d3));             \
        MK_NEON_ACC(a0, d0, s, 0);                                          \
        MK_NEON_ACC(a1, d1, s, 1);                                          \
        MK_NEON_ACC(a2, d2, s, 2);                                          \
        MK_NEON_ACC(a3, d3, s, 3);                                          \
    } while (0)
#define MK_NEON_STEP(p, s) MK_NEON_STEP4(_, p, s, MK_NOSTORE)
#define MK_NEON_STEPC(d, p, s) MK_NEON_STEP4(d, p, s, vst1q_u8)
/* Once per KiB: scalar is fine. */
#define MK_NEON_SCRAMBLE(s)                                    \
    do {                                                       \
        uint64_t t_[8];                                        \
        MK_NEON_STORE_TO(t_);                                  \
        mk_scramble_scalar(t_, (s));                           \
        a0 = vld1q_u64(t_); a1 = vld1q_u64(t_ + 2);            \
        a2 = vld1q_u64(t_ + 4); a3 = vld1q_u64(t_ + 6);        \
    } while (0)
MK_DEFINE_CONSUME(mk_consume_neon, , MK_NEON_DECL, MK_NEON_LOAD, MK_NEON_STORE, MK_NEON_STEP,
                  MK_NEON_STEPC, MK_NEON_STEPC, 1, (void)0, MK_NEON_SCRAMBLE)
#endif


/* ------------------------------------------------------------- dispatch */

enum { MK_ISA_SCALAR = 0, MK_ISA_SSE2 = 1, MK_ISA_AVX2 = 2, MK_ISA_AVX512 = 3, MK_ISA_NEON = 4 };

/*
 * The selected loop is one int, read and written atomically. Every hash picks its loop ONCE
 * (one-shot: at the call; streaming: at init, kept in the state), so a switch by another
 * thread never mixes two loops inside one hash, and never races a plain pointer store.
 */
static int mk_isa = MK_ISA_SCALAR;
#if defined(__GNUC__) || defined(__clang__)
#define MK_LOAD_ACQUIRE(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define MK_STORE_RELEASE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)
#else /* an aligned int is read and written whole on every target we build for */
#define MK_LOAD_ACQUIRE(x) (*(volatile int *)&(x))
#define MK_STORE_RELEASE(x, v) (*(volatile int *)&(x) = (v))
#endif

/* Is `isa` usable on this CPU? */
MK_API int mk_isa_supported(int isa) {
    switch (isa) {
    case MK_ISA_SCALAR:
        return 1;
#ifdef MK_X86
    case MK_ISA_SSE2:
        return 1;
#if defined(__GNUC__) || defined(__clang__)
    case MK_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") ? 1 : 0;
    case MK_ISA_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") ? 1 : 0;
#endif
#endif
#ifdef MK_NEON
    case MK_ISA_NEON:
        return 1;
#endif
    default:
        return 0;
    }
}

/* The stripe loop of `isa` (scalar for anything not compiled in). */
static mk_consume_fn mk_consume_for(int isa) {
    switch (isa) {
#ifdef MK_X86
    case MK_ISA_SSE2: return mk_consume_sse2;
    case MK_ISA_AVX2: return mk_consume_avx2;
    case MK_ISA_AVX512: return mk_consume_avx512;
#endif
#ifdef MK_NEON
    case MK_ISA_NEON: return mk_consume_neon;
#endif
    default: return mk_consume_scalar;
    }
}

MK_API int mk_get_isa(void) { return MK_LOAD_ACQUIRE(mk_isa); }

/* Select the stripe loop; returns 0 if `isa` is not usable here. */
MK_API int mk_set_isa(int isa) {
    if (!mk_isa_supported(isa)) return 0;
    MK_STORE_RELEASE(mk_isa, isa);
    return 1;
}

/* Best loop for this CPU: the widest vectors. (AVX-512 costs some CPUs a little clock
 * speed, but hashing here is bound by memory bandwidth, and it wins on current ones.) */
MK_API int mk_best_isa(void) {
    if (mk_isa_supported(MK_ISA_AVX512)) return MK_ISA_AVX512;
    if (mk_isa_supported(MK_ISA_AVX2)) return MK_ISA_AVX2;
    if (mk_isa_supported(MK_ISA_SSE2)) return MK_ISA_SSE2;
    if (mk_isa_supported(MK_ISA_NEON)) return MK_ISA_NEON;
    return MK_ISA_SCALAR;
}

/* ------------------------------------------- non-temporal copy, any dst */

/*
 * Copy n bytes with streaming stores to whatever dst alignment: loads are unaligned, stores
 * go to 64-byte-aligned lines, the partial lines at both ends use memcpy. SSE2 is enough:
 * write-combining merges 16-byte streaming stores into full lines. Elsewhere: memcpy.
 */
static void mk_copy_nt(uint8_t *dst, const uint8_t *src, size_t n) {
#ifdef MK_X86
    size_t head = (size_t)(-(uintptr_t)dst) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src + 0);
        __m128i b = _mm_loadu_si128((const __m128i *)src + 1);
        __m128i c = _mm_loadu_si128((const __m128i *)src + 2);
        __m128i d = _mm_loadu_si128((const __m128i *)src + 3);
        _mm_stream_si128((__m128i *)dst + 0, a);
        _mm_stream_si128((__m128i *)dst + 1, b);
        _mm_stream_si128((__m128i *)dst + 2, c);
        _mm_stream_si128((__m128i *)dst + 3, d);
    }
    memcpy(dst, src, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

/* Streaming stores cannot follow the stripes when dst is not line-aligned (arrays from
 * numpy or mlx usually are not): hash a few KiB from src, then stream-copy that same span
 * while it is still in L1. */
#define MK_SPLIT_STRIPES 256 /* 16 KiB */

/* ----------------------------------------------------- long: finalization */

static uint64_t mk_long_finish(mk_consume_fn consume, uint64_t *acc, size_t *nb,
                               const uint8_t *secret,
                               const uint8_t *tail, size_t tail_len, const uint8_t *last_stripe,
                               uint64_t total_len) {
    /* tail: the bytes after the last consumed stripe (1..), minus its final stripe. */
    consume(acc, nb, secret, tail, NULL, (tail_len - 1) / MK_STRIPE, 0);
    mk_accumulate_scalar(acc, last_stripe, secret + MK_SECRET_LEN - MK_STRIPE - 7);
    uint64_t r = total_len * MK_P64_1;
    for (int i = 0; i < 4; i++)
        r += mk_mul128_fold64(acc[2 * i] ^ mk_read64(secret + 11 + 16 * i),
                              acc[2 * i + 1] ^ mk_read64(secret + 11 + 16 * i + 8));
    return mk_avalanche(r);
}

/* One-shot XXH3-64 of len bytes with the stripe loop of `isa`. Reentrant; no GIL needed. */
MK_API uint64_t mk_xxh3_64_isa(int isa, const void *data, size_t len, uint64_t seed) {
    const uint8_t *p = (const uint8_t *)data;
    if (len <= MK_MIDSIZE_MAX) return mk_xxh3_short(p, len, seed);
    uint8_t derived[MK_SECRET_LEN] MK_ALIGN64;
    const uint8_t *secret = mk_default_secret;
    if (seed) {
        mk_derive_secret(derived, seed);
        secret = derived;
    }
    uint64_t acc[8] MK_ALIGN64;
    size_t nb = 0;
    mk_acc_init(acc);
    return mk_long_finish(mk_consume_for(isa), acc, &nb, secret, p, len, p + len - MK_STRIPE,
                          (uint64_t)len);
}

/* One-shot XXH3-64 with the selected loop. */
MK_API uint64_t mk_xxh3_64(const void *data, size_t len, uint64_t seed) {
    return mk_xxh3_64_isa(mk_get_isa(), data, len, seed);
}

/* --------------------------------------------------------------- streaming */

typedef struct {
    uint64_t acc[8] MK_ALIGN64;
    uint8_t secret[MK_SECRET_LEN] MK_ALIGN64;
    /* buf[0:64] holds the last 64 consumed bytes (the final stripe may reach back into
     * them); buf[64:64+buf_len] holds bytes not consumed yet. */
    uint8_t buf[MK_STRIPE + MK_BUF_LEN] MK_ALIGN64;
    uint64_t seed;
    uint64_t total_len;
    size_t buf_len;
    size_t nb_stripes; /* stripes consumed in the current block */
    int nt_stores;     /* update_copy: stream dst with non-temporal stores (large blocks) */
    mk_consume_fn consume; /* the stripe loop, fixed at init for the whole hash */
} mk_xxh3_state;

static void mk_consume_copy_unaligned_nt(mk_xxh3_state *st, uint8_t *dst, const uint8_t *p,
                                         size_t n) {
    while (n) {
        size_t k = n < MK_SPLIT_STRIPES ? n : MK_SPLIT_STRIPES;
        st->consume(st->acc, &st->nb_stripes, st->secret, p, NULL, k, 0);
        mk_copy_nt(dst, p, k * MK_STRIPE);
        p += k * MK_STRIPE;
        dst += k * MK_STRIPE;
        n -= k;
    }
}

/* Start a hash with the stripe loop of `isa`. */
MK_API void mk_xxh3_init_isa(mk_xxh3_state *st, uint64_t seed, int isa) {
    mk_acc_init(st->acc);
    st->consume = mk_consume_for(isa);
    mk_derive_secret(st->secret, seed);
    st->seed = seed;
    st->total_len = 0;
    st->buf_len = 0;
    st->nb_stripes = 0;
    st->nt_stores = 0;
}

/*
 * Feed len bytes. With dst non-NULL the bytes are also copied to dst (fused copy + hash:
 * stripes consumed straight from p are loaded once, stored and accumulated).
 * Invariant: at least one byte always stays unconsumed, because the input's last stripe
 * is treated differently and we cannot know yet which stripe is last.
 */
MK_API void mk_xxh3_update_copy(mk_xxh3_state *st, uint8_t *dst, const uint8_t *p, size_t len) {
    if (len == 0) return;
    st->total_len += len;
    uint8_t *data = st->buf + MK_STRIPE;
    if (len <= MK_BUF_LEN - st->buf_len) {
        memcpy(data + st->buf_len, p, len);
        if (dst) memcpy(dst, p, len);
        st->buf_len += len;
        return;
    }
    if (st->buf_len) {
        size_t fill = MK_BUF_LEN - st->buf_len;
        memcpy(data + st->buf_len, p, fill);
        if (dst) {
            memcpy(dst, p, fill);
            dst += fill;
        }
        p += fill;
        len -= fill; /* > 0: more input follows the full buffer */
        st->consume(st->acc, &st->nb_stripes, st->secret, data, NULL, MK_BUF_LEN / MK_STRIPE, 0);
        memcpy(st->buf, data + MK_BUF_LEN - MK_STRIPE, MK_STRIPE);
        st->buf_len = 0;
    }
    if (len > MK_BUF_LEN) {
        size_t n = (len - 1) / MK_STRIPE; /* leaves 1..64 bytes */
        if (dst && st->nt_stores && ((uintptr_t)dst & (MK_STRIPE - 1)))
            mk_consume_copy_unaligned_nt(st, dst, p, n);
        else
            st->consume(st->acc, &st->nb_stripes, st->secret, p, dst, n, st->nt_stores);
        p += n * MK_STRIPE;
        len -= n * MK_STRIPE;
        if (dst) dst += n * MK_STRIPE;
        memcpy(st->buf, p - MK_STRIPE, MK_STRIPE);
    }
    memcpy(data, p, len);
    if (dst) memcpy(dst, p, len);
    st->buf_len = len;
}

/* Start a hash with the selected loop. */
MK_API void mk_xxh3_init(mk_xxh3_state *st, uint64_t seed) { mk_xxh3_init_isa(st, seed, mk_get_isa()); }

/*
 * Copy len bytes from p to dst and hash them as they landed: the same steps as
 * mk_xxh3_update_copy, but every byte is hashed from dst, each piece right after the copy
 * put it there (still in L1). The copy and the hash share no code, so a faulty copy
 * changes the hash instead of hiding behind it. (This gives up the non-temporal stores of
 * update_copy: reading a streamed line back would go to DRAM.)
 */
#define MK_VERIFY_STRIPES 16 /* 1 KiB pieces: the copy's lines are still in L1 when hashed */

/* Copy k stripes with plain vector moves. Not memcpy: glibc turns copies of 2 KiB and up
 * into `rep movsb`, which the core cannot overlap with the hashing that follows (measured:
 * unpack_hash at 0.72x of unpack with memcpy, 0.86x with this). */
static inline void mk_copy_stripes(uint8_t *d, const uint8_t *p, size_t k) {
#ifdef MK_X86
    for (size_t i = 0; i < k; i++, d += MK_STRIPE, p += MK_STRIPE) {
        __m128i a = _mm_loadu_si128((const __m128i *)p + 0);
        __m128i b = _mm_loadu_si128((const __m128i *)p + 1);
        __m128i c = _mm_loadu_si128((const __m128i *)p + 2);
        __m128i e = _mm_loadu_si128((const __m128i *)p + 3);
        _mm_storeu_si128((__m128i *)d + 0, a);
        _mm_storeu_si128((__m128i *)d + 1, b);
        _mm_storeu_si128((__m128i *)d + 2, c);
        _mm_storeu_si128((__m128i *)d + 3, e);
    }
#else
    memcpy(d, p, k * MK_STRIPE);
#endif
}

MK_API void mk_xxh3_copy_verify(mk_xxh3_state *st, uint8_t *dst, const uint8_t *p, size_t len) {
    if (len == 0) return;
    st->total_len += len;
    uint8_t *data = st->buf + MK_STRIPE;
    if (len <= MK_BUF_LEN - st->buf_len) {
        memcpy(dst, p, len);
        memcpy(data + st->buf_len, dst, len);
        st->buf_len += len;
        return;
    }
    if (st->buf_len) {
        size_t fill = MK_BUF_LEN - st->buf_len;
        memcpy(dst, p, fill);
        memcpy(data + st->buf_len, dst, fill);
        dst += fill;
        p += fill;
        len -= fill; /* > 0: more input follows the full buffer */
        st->consume(st->acc, &st->nb_stripes, st->secret, data, NULL, MK_BUF_LEN / MK_STRIPE, 0);
        memcpy(st->buf, data + MK_BUF_LEN - MK_STRIPE, MK_STRIPE);
        st->buf_len = 0;
    }
    if (len > MK_BUF_LEN) {
        size_t n = (len - 1) / MK_STRIPE; /* leaves 1..64 bytes */
        len -= n * MK_STRIPE;
        while (n) {
            size_t k = n < MK_VERIFY_STRIPES ? n : MK_VERIFY_STRIPES;
            mk_copy_stripes(dst, p, k);
            st->consume(st->acc, &st->nb_stripes, st->secret, dst, NULL, k, 0);
            dst += k * MK_STRIPE;
            p += k * MK_STRIPE;
            n -= k;
        }
        memcpy(st->buf, dst - MK_STRIPE, MK_STRIPE);
    }
    memcpy(dst, p, len);
    memcpy(data, dst, len);
    st->buf_len = len;
}

MK_API void mk_xxh3_update(mk_xxh3_state *st, const uint8_t *p, size_t len) {
    mk_xxh3_update_copy(st, NULL, p, len);
}

/* Digest of everything fed so far; the state stays usable. */
MK_API uint64_t mk_xxh3_digest(const mk_xxh3_state *st) {
    const uint8_t *data = st->buf + MK_STRIPE;
    if (st->total_len <= MK_MIDSIZE_MAX) return mk_xxh3_short(data, (size_t)st->total_len, st->seed);
    uint64_t acc[8] MK_ALIGN64;
    size_t nb = st->nb_stripes;
    memcpy(acc, st->acc, sizeof acc);
    return mk_long_finish(st->consume, acc, &nb, st->secret, data, st->buf_len,
                          data + st->buf_len - MK_STRIPE, st->total_len);
}

#endif /* MLXKV_XXH3_H */
