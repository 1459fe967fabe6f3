// x @ w.T for a few rows of x on MLX's CPU backend, as one MLX primitive (RowProduct).
//
// A decode step multiplies one to a few rows by every weight matrix once, so it is bound
// by how fast the weights stream from memory. BLAS's sgemm runs such a product on the
// stream's thread alone (and for two or more rows first packs the matrix), which reads at
// most what one core can read. This kernel reads each [out, in] weight row straight from
// memory, once, whatever the number of rows, and splits the output columns over a small
// pool of threads that stay awake between the products of one step (they spin briefly,
// then sleep), so every core streams its share of the matrix.
//
// Each output is one dot product over `in`, summed the same way for every row of x, so a
// row's result does not depend on how many rows share the product (a batched row computes
// what it computes alone).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RP_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define RP_PAUSE() asm volatile("yield")
#else
#define RP_PAUSE() ((void)0)
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int kMaxRows = 64;   // rows of x one product takes (more: the caller's matmul)
// A tile: weight rows by rows of x, one accumulator each in registers, plus a vector per
// weight row and one of x. With 32 vector registers (AVX-512, NEON) 4 weight rows by up
// to 6 rows of x (29 registers); with 16 (AVX2, SSE2) 2 by up to 6 (15).
#if defined(__aarch64__)
constexpr int kWeightTile = 4;
#else
constexpr int kWeightTile = 2;
#endif
constexpr int kRowTile = 6;
constexpr int kMaxThreads = 16;
// How far ahead of its read a kernel fetches each weight row's run into L2, in floats
// (8 KB). Fetched into L1 instead, the fetches hold the line-fill buffers the loads need:
// the real model's 121 products on 2 cores went at 8 rows of x from 36 to 22 ms, at 4
// rows from 28 to 18 ms, and at 1 row stayed at 16-19 ms.
constexpr int64_t kAhead = 2048;

// ---- each kernel built once per instruction set, the CPU's own picked at load ---------------

#if defined(__x86_64__)
#define FOR_EACH_ISA(DEFINE)                                 \
  DEFINE(base, , 16)                                         \
  DEFINE(avx2, __attribute__((target("avx2,fma"))), 32)      \
  DEFINE(avx512, __attribute__((target("avx512f"))), 64)
// 2: AVX-512F, 1: AVX2 and FMA, 0: the baseline (SSE2). MLXKV_NATIVE_ISA=avx2 or base
// caps it (read at load), so one machine can run and test every kernel family.
int find_isa_level() {
  __builtin_cpu_init();
  int level = __builtin_cpu_supports("avx512f")                                    ? 2
              : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                  : 0;
  if (const char* cap = std::getenv("MLXKV_NATIVE_ISA")) {
    if (std::strcmp(cap, "avx2") == 0) level = std::min(level, 1);
    if (std::strcmp(cap, "base") == 0) level = 0;
  }
  return level;
}
int isa_level() {
  static const int level = find_isa_level();  // once, for every kernel's pick
  return level;
}
#define PICK_ISA(name) \
  (isa_level() == 2 ? name##_avx512 : isa_level() == 1 ? name##_avx2 : name##_base)
const char* const kIsaNames[] = {"base", "avx2", "avx512"};
#define ISA_NAME() kIsaNames[isa_level()]
#else
#define FOR_EACH_ISA(DEFINE) DEFINE(base, , 16)
#define PICK_ISA(name) name##_base
#define ISA_NAME() "base"
#endif

// ---- the kernel: y[r, o0:o1] for every row r, a tile of weight rows at a time -----------

#define RP_DEFINE(sfx, attr, bytes)                                                         \
  typedef float vf_##sfx __attribute__((vector_size(bytes)));                              \
  constexpr int W_##sfx = (bytes) / 4;                                                     \
  constexpr int WT_##sfx = (bytes) == 64 ? 4 : kWeightTile;                               \
  attr static inline vf_##sfx ld_##sfx(const float* p) {                                   \
    vf_##sfx v;                                                                            \
    std::memcpy(&v, p, sizeof v);                                                          \
    return v;                                                                              \
  }                                                                                        \
  attr static inline float hsum_##sfx(vf_##sfx v) {                                        \
    float s = 0.0f;                                                                        \
    for (int k = 0; k < W_##sfx; k++) s += v[k];                                           \
    return s;                                                                              \
  }                                                                                        \
  /* a depth's last few products, out of line: the compiler contracts s + x * w into */ \
  /* one rounding in some kernels and not in others, and every kernel must sum alike */ \
  attr __attribute__((noinline)) static float tail_##sfx(float s, float x, float w) {      \
    return s + x * w;                                                                      \
  }                                                                                        \
  template <int WR, int R>                                                                 \
  attr static void tile_##sfx(const float* x, const float* w, float* y, int64_t depth,     \
                              int64_t out, int64_t o, bool fetch) {                        \
    /* weight rows o .. o + WR - 1 against R rows of x: WR x R accumulators in registers */ \
    const float* w0 = w + o * depth;                                                       \
    vf_##sfx a[WR][R];                                                                     \
    for (int j = 0; j < WR; j++)                                                           \
      for (int r = 0; r < R; r++) a[j][r] = (vf_##sfx){};                                  \
    int64_t i = 0;                                                                         \
    for (; i + W_##sfx <= depth; i += W_##sfx) {                                           \
      /* each weight row fetched kAhead floats ahead into L2; the rows are contiguous, */ \
      /* so the tile's WR fetches cover the memory the next tiles read                 */ \
      if (fetch)                                                                           \
        for (int j = 0; j < WR; j++) __builtin_prefetch(w0 + j * depth + kAhead + i, 0, 2);\
      vf_##sfx v[WR];                                                                      \
      for (int j = 0; j < WR; j++) v[j] = ld_##sfx(w0 + j * depth + i);                    \
      for (int r = 0; r < R; r++) {                                                        \
        vf_##sfx xv = ld_##sfx(x + r * depth + i);                                         \
        for (int j = 0; j < WR; j++) a[j][r] += xv * v[j];                                 \
      }                                                                                    \
    }                                                                                      \
    for (int j = 0; j < WR; j++)                                                           \
      for (int r = 0; r < R; r++) {                                                        \
        float s = hsum_##sfx(a[j][r]);                                                     \
        for (int64_t k = i; k < depth; k++)                                                \
          s = tail_##sfx(s, x[r * depth + k], w0[j * depth + k]);                          \
        y[r * out + o + j] = s;                                                            \
      }                                                                                    \
  }                                                                                        \
  template <int WR, int R>                                                                 \
  attr static void tiles_##sfx(const float* x, const float* w, float* y, int64_t depth,    \
                               int64_t out, int64_t o0, int64_t o1, bool fetch) {          \
    int64_t o = o0;                                                                        \
    for (; o + WR <= o1; o += WR) tile_##sfx<WR, R>(x, w, y, depth, out, o, fetch);        \
    for (; o < o1; o++) tile_##sfx<1, R>(x, w, y, depth, out, o, fetch);                   \
  }                                                                                        \
  attr static void span_##sfx(const float* x, const float* w, float* y, int64_t rows,      \
                              int64_t depth, int64_t out, int64_t o0, int64_t o1) {        \
    /* up to 4 rows of x: one weight row at a time, so the weights stream as one run of */ \
    /* memory (a decode step's case, and a short verify's)                              */ \
    switch (rows) {                                                                        \
      case 1: tiles_##sfx<1, 1>(x, w, y, depth, out, o0, o1, true); return;                \
      case 2: tiles_##sfx<1, 2>(x, w, y, depth, out, o0, o1, true); return;                \
      case 3: tiles_##sfx<1, 3>(x, w, y, depth, out, o0, o1, true); return;                \
      case 4: tiles_##sfx<1, 4>(x, w, y, depth, out, o0, o1, true); return;                \
    }                                                                                      \
    /* more: weight rows in blocks that stay in L1 while every tile of x's rows passes  */ \
    /* (the first tile fetches ahead); x's rows in tiles as even as kRowTile allows     */ \
    const int64_t block =                                                                  \
        std::max<int64_t>(WT_##sfx, (16384 / (depth * 4)) / WT_##sfx * WT_##sfx);          \
    const int64_t tiles = (rows + kRowTile - 1) / kRowTile;                                \
    for (int64_t b = o0; b < o1; b += block) {                                             \
      const int64_t e = std::min(o1, b + block);                                           \
      for (int64_t t = 0, r = 0; t < tiles; t++) {                                         \
        const int64_t n = (rows - r + tiles - t - 1) / (tiles - t);                        \
        const float* xr = x + r * depth;                                                   \
        float* yr = y + r * out;                                                           \
        switch (n) {                                                                       \
          case 1: tiles_##sfx<WT_##sfx, 1>(xr, w, yr, depth, out, b, e, t == 0); break;    \
          case 2: tiles_##sfx<WT_##sfx, 2>(xr, w, yr, depth, out, b, e, t == 0); break;    \
          case 3: tiles_##sfx<WT_##sfx, 3>(xr, w, yr, depth, out, b, e, t == 0); break;    \
          case 4: tiles_##sfx<WT_##sfx, 4>(xr, w, yr, depth, out, b, e, t == 0); break;    \
          case 5: tiles_##sfx<WT_##sfx, 5>(xr, w, yr, depth, out, b, e, t == 0); break;    \
          default: tiles_##sfx<WT_##sfx, kRowTile>(xr, w, yr, depth, out, b, e, t == 0); break; \
        }                                                                                  \
        r += n;                                                                            \
      }                                                                                    \
    }                                                                                      \
  }

FOR_EACH_ISA(RP_DEFINE)

using SpanFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                        int64_t);

const SpanFn kSpan = PICK_ISA(span);


// ---- attention of a few queries over a KV cache's filled slots -----------------------------
//
// One work unit: the queries of one KV head's group (rows R = rep x L, each sees slots
// [0, offset + l]) over one span of slots. Slots go in blocks of kBlock: the scores of a
// block, its maximum, exp, and the weighted values, merged into the unit's running
// (maximum, sum, accumulator) as in flash decoding; units of one head are merged after.

constexpr int kBlock = 256;
constexpr int kMaxQueryRows = 64;

struct Attend {
  const float* q;  // [R, D] the group's rows, pre-scaled
  const float* k;  // [S, D]
  const float* v;  // [S, D]
  int64_t rows, depth, span0, span1;
  const int64_t* visible;  // [R] slots row r sees (a prefix)
  float* m;                // [R] running maximum
  float* l;                // [R] running sum
  float* acc;              // [R, D]
};

#define AT_DEFINE(sfx, attr, bytes)                                                         \
  attr static inline vf_##sfx exp_##sfx(vf_##sfx x) {                                      \
    /* exp(x) for x <= 0 as 2**n * 2**f: a degree-7 polynomial for 2**f in [0, 1), */     \
    /* every step on whole vectors; -inf gives 0 */                                        \
    typedef int32_t vi_t __attribute__((vector_size(sizeof(vf_##sfx))));                   \
    const vf_##sfx lo = (vf_##sfx){} - 127.0f;                                             \
    vf_##sfx y = x * 1.4426950408889634f;                                                  \
    y = y < lo ? lo : y;                                                                   \
    vi_t ni = __builtin_convertvector(y, vi_t);                                            \
    vf_##sfx n = __builtin_convertvector(ni, vf_##sfx);                                    \
    vi_t above = n > y;                                                                    \
    ni = ni + above;                                                                       \
    n = n + __builtin_convertvector(above, vf_##sfx);                                      \
    vf_##sfx f = y - n;                                                                    \
    vf_##sfx p = f * 1.525273380405984e-05f + 0.00015403530393381609f;                     \
    p = p * f + 0.0013333558146428443f;                                                    \
    p = p * f + 0.009618129107628477f;                                                     \
    p = p * f + 0.05550410866482158f;                                                      \
    p = p * f + 0.2402265069591007f;                                                       \
    p = p * f + 0.6931471805599453f;                                                       \
    p = p * f + 1.0f;                                                                      \
    vi_t bits = (ni + 127) << 23;                                                          \
    vf_##sfx scale;                                                                        \
    std::memcpy(&scale, &bits, sizeof scale);                                              \
    return p * scale;                                                                      \
  }                                                                                        \
  attr static void attend_##sfx(const Attend& a) {                                         \
    const int64_t D = a.depth, R = a.rows;                                                 \
    float scores[kMaxQueryRows][kBlock];                                                   \
    for (int64_t b0 = a.span0; b0 < a.span1; b0 += kBlock) {                               \
      const int64_t b1 = std::min(a.span1, b0 + kBlock);                                   \
      for (int64_t j = b0; j < b1; j++) {                                                  \
        const float* kj = a.k + j * D;                                                     \
        for (int64_t r = 0; r < R; r++) {                                                  \
          const float* qr = a.q + r * D;                                                   \
          vf_##sfx s = {};                                                                 \
          int64_t i = 0;                                                                   \
          for (; i + W_##sfx <= D; i += W_##sfx) s += ld_##sfx(qr + i) * ld_##sfx(kj + i); \
          float t = hsum_##sfx(s);                                                         \
          for (; i < D; i++) t += qr[i] * kj[i];                                           \
          scores[r][j - b0] = j < a.visible[r] ? t : -INFINITY;                            \
        }                                                                                  \
      }                                                                                    \
      const int64_t n = b1 - b0;                                                           \
      for (int64_t r = 0; r < R; r++) {                                                    \
        float* sr = scores[r];                                                             \
        float mx = a.m[r];                                                                 \
        for (int64_t j = 0; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;                      \
        if (mx == -INFINITY) {                                                             \
          for (int64_t j = 0; j < n; j++) sr[j] = 0.0f;                                    \
          continue;                                                                        \
        }                                                                                  \
        const float rescale = a.m[r] == -INFINITY ? 0.0f : std::exp(a.m[r] - mx);          \
        a.m[r] = mx;                                                                       \
        a.l[r] *= rescale;                                                                 \
        for (int64_t i = 0; i < D; i++) a.acc[r * D + i] *= rescale;                       \
        vf_##sfx sum = {};                                                                 \
        int64_t j = 0;                                                                     \
        for (; j + W_##sfx <= n; j += W_##sfx) {                                           \
          vf_##sfx e = exp_##sfx(ld_##sfx(sr + j) - mx);                                   \
          std::memcpy(sr + j, &e, sizeof e);                                               \
          sum += e;                                                                        \
        }                                                                                  \
        float total = hsum_##sfx(sum);                                                     \
        for (; j < n; j++) {                                                               \
          sr[j] = sr[j] == -INFINITY ? 0.0f : std::exp(sr[j] - mx);                        \
          total += sr[j];                                                                  \
        }                                                                                  \
        a.l[r] += total;                                                                   \
      }                                                                                    \
      /* the weighted values: three rows at a time, their accumulators over up to four    */ \
      /* vectors of D held in registers across the block's keys (read and written once a  */ \
      /* block, not once a key: that load and store per key and row cost more than the    */ \
      /* arithmetic); a masked key's weight is 0 and its value a filled slot's             */ \
      int64_t r0 = 0;                                                                      \
      for (; r0 + 3 <= R; r0 += 3) {                                                       \
        const float *p0 = scores[r0], *p1 = scores[r0 + 1], *p2 = scores[r0 + 2];          \
        float *c0 = a.acc + r0 * D, *c1 = c0 + D, *c2 = c1 + D;                            \
        int64_t i0 = 0;                                                                    \
        for (; i0 + 4 * W_##sfx <= D; i0 += 4 * W_##sfx) {                                 \
          vf_##sfx t[3][4];                                                                \
          for (int u = 0; u < 4; u++) {                                                    \
            t[0][u] = ld_##sfx(c0 + i0 + u * W_##sfx);                                     \
            t[1][u] = ld_##sfx(c1 + i0 + u * W_##sfx);                                     \
            t[2][u] = ld_##sfx(c2 + i0 + u * W_##sfx);                                     \
          }                                                                                \
          for (int64_t j = b0; j < b1; j++) {                                              \
            const float* vj = a.v + j * D + i0;                                            \
            const float w0 = p0[j - b0], w1 = p1[j - b0], w2 = p2[j - b0];                 \
            for (int u = 0; u < 4; u++) {                                                  \
              const vf_##sfx v = ld_##sfx(vj + u * W_##sfx);                               \
              t[0][u] += w0 * v;                                                           \
              t[1][u] += w1 * v;                                                           \
              t[2][u] += w2 * v;                                                           \
            }                                                                              \
          }                                                                                \
          for (int u = 0; u < 4; u++) {                                                    \
            std::memcpy(c0 + i0 + u * W_##sfx, &t[0][u], sizeof t[0][u]);                 \
            std::memcpy(c1 + i0 + u * W_##sfx, &t[1][u], sizeof t[1][u]);                  \
            std::memcpy(c2 + i0 + u * W_##sfx, &t[2][u], sizeof t[2][u]);                  \
          }                                                                                \
        }                                                                                  \
        for (; i0 + W_##sfx <= D; i0 += W_##sfx) {                                        \
          vf_##sfx t0 = ld_##sfx(c0 + i0), t1 = ld_##sfx(c1 + i0), t2 = ld_##sfx(c2 + i0); \
          for (int64_t j = b0; j < b1; j++) {                                              \
            const vf_##sfx v = ld_##sfx(a.v + j * D + i0);                                 \
            t0 += p0[j - b0] * v;                                                          \
            t1 += p1[j - b0] * v;                                                          \
            t2 += p2[j - b0] * v;                                                          \
          }                                                                                \
          std::memcpy(c0 + i0, &t0, sizeof t0);                                            \
          std::memcpy(c1 + i0, &t1, sizeof t1);                                            \
          std::memcpy(c2 + i0, &t2, sizeof t2);                                            \
        }                                                                                  \
        for (; i0 < D; i0++)                                                               \
          for (int64_t j = b0; j < b1; j++) {                                              \
            const float v = a.v[j * D + i0];                                               \
            c0[i0] += p0[j - b0] * v;                                                      \
            c1[i0] += p1[j - b0] * v;                                                      \
            c2[i0] += p2[j - b0] * v;                                                      \
          }                                                                                \
      }                                                                                    \
      for (int64_t j = b0; j < b1; j++) { /* the rows past the last three, key by key */    \
        const float* vj = a.v + j * D;                                                     \
        for (int64_t r = r0; r < R; r++) {                                                 \
          const float p = scores[r][j - b0];                                               \
          if (p == 0.0f) continue;                                                         \
          float* ar = a.acc + r * D;                                                       \
          int64_t i = 0;                                                                   \
          for (; i + W_##sfx <= D; i += W_##sfx) {                                         \
            vf_##sfx o = ld_##sfx(ar + i) + p * ld_##sfx(vj + i);                          \
            std::memcpy(ar + i, &o, sizeof o);                                             \
          }                                                                                \
          for (; i < D; i++) ar[i] += p * vj[i];                                           \
        }                                                                                  \
      }                                                                                    \
    }                                                                                      \
  }

FOR_EACH_ISA(AT_DEFINE)

using AttendFn = void (*)(const Attend&);

const AttendFn kAttend = PICK_ISA(attend);

// ---- silu(gate) * up ------------------------------------------------------------------------
// (g * sigmoid(g)) * u, sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|):
// the exponential above only ever sees x <= 0.

#define SW_DEFINE(sfx, attr, bytes)                                                         \
  attr static void swiglu_##sfx(const float* g, const float* u, float* o, int64_t n) {     \
    const vf_##sfx zero = (vf_##sfx){}, one = zero + 1.0f;                                 \
    int64_t i = 0;                                                                         \
    for (; i + W_##sfx <= n; i += W_##sfx) {                                               \
      const vf_##sfx gv = ld_##sfx(g + i);                                                 \
      const vf_##sfx e = exp_##sfx(gv < zero ? gv : zero - gv);                            \
      const vf_##sfx r = (gv * ((gv < zero ? e : one) / (one + e))) * ld_##sfx(u + i);     \
      std::memcpy(o + i, &r, sizeof r);                                                    \
    }                                                                                      \
    for (; i < n; i++) {                                                                   \
      const float x = g[i], e = std::exp(-std::fabs(x));                                   \
      o[i] = (x * ((x < 0.0f ? e : 1.0f) / (1.0f + e))) * u[i];                            \
    }                                                                                      \
  }

FOR_EACH_ISA(SW_DEFINE)

using SwigluFn = void (*)(const float*, const float*, float*, int64_t);

const SwigluFn kSwiglu = PICK_ISA(swiglu);

// ---- attention of a prompt chunk: many queries, flash style ----------------------------
//
// One work unit: a tile of one KV head's query rows (its query group's heads at up to
// kTileRows / rep positions) over one span of keys. The tile's rows are the lanes of the
// vectors: q is transposed to [D, RP] (RP: the rows padded to whole vectors) and a block of
// scores is [kKeyBlock, RP], so the scores are outer products of a q column and a key's
// element, the softmax's maximum, exp and sum run down the lanes with no horizontal step,
// and the weighted values are a row's score times a value row. Keys go in blocks of
// kKeyBlock whose scores stay in L1/L2, merged into the unit's running (maximum, sum,
// accumulator), as in flash attention: no score matrix is ever written to memory.

constexpr int kTileRows = 64;
constexpr int kKeyBlock = 128;

struct ChunkUnit {
  const float* qt;       // [D, RP] the tile's rows, pre-scaled
  const float* k;        // [S, D]
  const float* v;        // [S, D]
  int64_t rp, rows, depth, key0, key1;
  const float* visible;  // [RP] keys row r sees end here (exclusive), as floats
  float min_visible;     // the least of them: blocks below it need no mask
  const float* from;     // [RP] and start here (0 but for a mask's rows)
  float max_from;        // the largest of them: blocks from it on need no mask
  float* m;              // [RP] running maximum
  float* l;              // [RP] running sum
  float* acc;            // [D, RP]: transposed, the rows are the lanes
};

#define CA_DEFINE(sfx, attr, bytes)                                                                      \
  attr static inline vf_##sfx bc_##sfx(const float* p) {                                                 \
    /* *p in every lane (x - 0 is x for every x, so the compiler loads it broadcast) */                  \
    return *p - (vf_##sfx){};                                                                            \
  }                                                                                                      \
  template <int NV, int KJ>                                                                              \
  attr static inline void outer_##sfx(const float* a, int64_t a_step, const float* b,                    \
                                      int64_t b_step, int64_t steps, float* c, int64_t c_step,           \
                                      bool add) {                                                        \
    /* c[j, lanes of NV vectors] (+)= sum over t of a[t, those lanes] * b[t * b_step + j]                \
       for j < KJ: a's rows are the lanes, b's elements are broadcast (the tile's                        \
       q @ k.T with a = q.T, b = k.T; and its p @ v, transposed, with a = p, b = v) */                   \
    vf_##sfx acc[NV][KJ];                                                                                \
    for (int u = 0; u < NV; u++)                                                                         \
      for (int j = 0; j < KJ; j++)                                                                       \
        acc[u][j] = add ? ld_##sfx(c + j * c_step + u * W_##sfx) : (vf_##sfx){};                         \
    for (int64_t t = 0; t < steps; t++) {                                                                \
      vf_##sfx av[NV];                                                                                   \
      for (int u = 0; u < NV; u++) av[u] = ld_##sfx(a + t * a_step + u * W_##sfx);                       \
      for (int j = 0; j < KJ; j++) {                                                                     \
        const vf_##sfx bj = bc_##sfx(b + t * b_step + j);                                                \
        for (int u = 0; u < NV; u++) acc[u][j] += av[u] * bj;                                            \
      }                                                                                                  \
    }                                                                                                    \
    for (int j = 0; j < KJ; j++)                                                                         \
      for (int u = 0; u < NV; u++)                                                                       \
        std::memcpy(c + j * c_step + u * W_##sfx, &acc[u][j], sizeof(vf_##sfx));                         \
  }                                                                                                      \
  template <int NV>                                                                                      \
  attr static void outer_cols_##sfx(const float* a, int64_t a_step, const float* b,                      \
                                    int64_t b_step, int64_t cols, int64_t steps, float* c,               \
                                    int64_t c_step) {                                                    \
    /* c += outer_ over `cols` adjacent broadcast columns (b[t * b_step + j]), four at a time */         \
    int64_t j = 0;                                                                                       \
    for (; j + 4 <= cols; j += 4)                                                                        \
      outer_##sfx<NV, 4>(a, a_step, b + j, b_step, steps, c + j * c_step, c_step, true);                 \
    for (; j < cols; j++)                                                                                \
      outer_##sfx<NV, 1>(a, a_step, b + j, b_step, steps, c + j * c_step, c_step, true);                 \
  }                                                                                                      \
  template <int NV>                                                                                      \
  attr static void outer_rows_##sfx(const float* a, int64_t a_step, const float* b,                      \
                                    int64_t b_next, int64_t cols, int64_t steps, float* c,               \
                                    int64_t c_step) {                                                    \
    /* c = outer_ with each column contiguous: element t of column j at b[j * b_next + t]                \
       (the keys of a block, four at once) */                                                            \
    int64_t j = 0;                                                                                       \
    for (; j + 4 <= cols; j += 4) {                                                                      \
      vf_##sfx acc[NV][4];                                                                               \
      for (int u = 0; u < NV; u++)                                                                       \
        for (int q = 0; q < 4; q++) acc[u][q] = (vf_##sfx){};                                            \
      const float* bj = b + j * b_next;                                                                  \
      for (int64_t t = 0; t < steps; t++) {                                                              \
        vf_##sfx av[NV];                                                                                 \
        for (int u = 0; u < NV; u++) av[u] = ld_##sfx(a + t * a_step + u * W_##sfx);                     \
        for (int q = 0; q < 4; q++) {                                                                    \
          const vf_##sfx bq = bc_##sfx(bj + q * b_next + t);                                             \
          for (int u = 0; u < NV; u++) acc[u][q] += av[u] * bq;                                          \
        }                                                                                                \
      }                                                                                                  \
      for (int q = 0; q < 4; q++)                                                                        \
        for (int u = 0; u < NV; u++)                                                                     \
          std::memcpy(c + (j + q) * c_step + u * W_##sfx, &acc[u][q], sizeof(vf_##sfx));                 \
    }                                                                                                    \
    for (; j < cols; j++)                                                                                \
      outer_##sfx<NV, 1>(a, a_step, b + j * b_next, 1, steps, c + j * c_step, c_step, false);            \
  }                                                                                                      \
  attr static void chunk_##sfx(const ChunkUnit& a) {                                                     \
    constexpr int W = W_##sfx;                                                                           \
    const int64_t D = a.depth, RP = a.rp, NVt = RP / W;                                                  \
    alignas(64) float s[kKeyBlock * kTileRows];  /* [n, RP] a block's scores, then weights */            \
    for (int64_t b0 = a.key0; b0 < a.key1; b0 += kKeyBlock) {                                            \
      const int64_t b1 = std::min(a.key1, b0 + kKeyBlock), n = b1 - b0;                                  \
      const float* kb = a.k + b0 * D;                                                                    \
      /* s[j, r] = q[r] . k[b0 + j]: rows as lanes, the key's elements broadcast */                      \
      for (int64_t v0 = 0; v0 < NVt; v0 += 3) {                                                          \
        switch (std::min<int64_t>(3, NVt - v0)) {                                                        \
          case 1: outer_rows_##sfx<1>(a.qt + v0 * W, RP, kb, D, n, D, s + v0 * W, RP); break;            \
          case 2: outer_rows_##sfx<2>(a.qt + v0 * W, RP, kb, D, n, D, s + v0 * W, RP); break;            \
          default: outer_rows_##sfx<3>(a.qt + v0 * W, RP, kb, D, n, D, s + v0 * W, RP); break;           \
        }                                                                                                \
      }                                                                                                  \
      for (int64_t v0 = 0; v0 < NVt; v0++) {                                                             \
        const int64_t r0 = v0 * W;                                                                       \
        const vf_##sfx old = ld_##sfx(a.m + r0);                                                         \
        const vf_##sfx ninf = (vf_##sfx){} - INFINITY;                                                   \
        vf_##sfx top = old;                                                                              \
        if (static_cast<float>(b1) > a.min_visible ||                                                    \
            static_cast<float>(b0) < a.max_from) { /* some row sees part of the block */                 \
          const vf_##sfx seen = ld_##sfx(a.visible + r0), start = ld_##sfx(a.from + r0);                 \
          for (int64_t j = 0; j < n; j++) {                                                              \
            vf_##sfx x = ld_##sfx(s + j * RP + r0);                                                      \
            const float key = static_cast<float>(b0 + j);                                                \
            x = (key < seen) & (key >= start) ? x : ninf;                                                \
            std::memcpy(s + j * RP + r0, &x, sizeof x);                                                  \
            top = top > x ? top : x;                                                                     \
          }                                                                                              \
        } else {                                                                                         \
          for (int64_t j = 0; j < n; j++) {                                                              \
            const vf_##sfx x = ld_##sfx(s + j * RP + r0);                                                \
            top = top > x ? top : x;                                                                     \
          }                                                                                              \
        }                                                                                                \
        const vf_##sfx base = top == ninf ? (vf_##sfx){} : top; /* nothing seen yet */                   \
        const vf_##sfx rescale = exp_##sfx(old - base);        /* old -inf: 0 */                        \
        std::memcpy(a.m + r0, &top, sizeof top);                                                         \
        vf_##sfx sum = ld_##sfx(a.l + r0) * rescale;                                                     \
        for (int64_t j = 0; j < n; j++) {                                                                \
          const vf_##sfx e = exp_##sfx(ld_##sfx(s + j * RP + r0) - base);                               \
          std::memcpy(s + j * RP + r0, &e, sizeof e);                                                    \
          sum += e;                                                                                      \
        }                                                                                                \
        std::memcpy(a.l + r0, &sum, sizeof sum);                                                         \
        for (int64_t i = 0; i < D; i++) {                                                                \
          const vf_##sfx x = ld_##sfx(a.acc + i * RP + r0) * rescale;                                    \
          std::memcpy(a.acc + i * RP + r0, &x, sizeof x);                                                \
        }                                                                                                \
      }                                                                                                  \
      /* acc[i, r] += sum_j s[j, r] * v[b0 + j, i]: rows as lanes, the values broadcast */               \
      const float* vb = a.v + b0 * D;                                                                    \
      for (int64_t v0 = 0; v0 < NVt; v0 += 3) {                                                          \
        switch (std::min<int64_t>(3, NVt - v0)) {                                                        \
          case 1: outer_cols_##sfx<1>(s + v0 * W, RP, vb, D, D, n, a.acc + v0 * W, RP); break;           \
          case 2: outer_cols_##sfx<2>(s + v0 * W, RP, vb, D, D, n, a.acc + v0 * W, RP); break;           \
          default: outer_cols_##sfx<3>(s + v0 * W, RP, vb, D, D, n, a.acc + v0 * W, RP); break;          \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
  }

FOR_EACH_ISA(CA_DEFINE)

struct ChunkKernel {
  void (*run)(const ChunkUnit&);
  int width;  // floats in a vector: a tile's rows are padded to a multiple of it
};

const ChunkKernel kChunk = {PICK_ISA(chunk), PICK_ISA(W)};

// ---- the pool: workers that take a share of each product ----------------------------------

// Where each row of x's last dimension starts (in floats from x's data), for any strides.
std::vector<int64_t> row_starts(const mx::array& x) {
  const int nd = static_cast<int>(x.ndim());
  const int64_t rows = x.shape(-1) ? static_cast<int64_t>(x.size()) / x.shape(-1) : 0;
  std::vector<int64_t> starts(rows);
  std::vector<int64_t> at(std::max(nd - 1, 0), 0);
  for (int64_t r = 0; r < rows; r++) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; d++) off += at[d] * x.strides()[d];
    starts[r] = off;
    for (int d = nd - 2; d >= 0 && ++at[d] == x.shape(d); d--) at[d] = 0;
  }
  return starts;
}

// An array's rows of its last dimension as one block of rows: its own data where it is
// row-contiguous (the usual case: no copy, and no copy operation in the graph), else a copy
// made on the stream's thread once the data is there.
struct RowsOf {
  const float* data;
  std::vector<int64_t> starts;  // where each row starts; empty when row-contiguous
  int64_t step, D;

  static RowsOf of(const mx::array& a) {
    if (a.flags().row_contiguous) return {a.data<float>(), {}, 1, a.shape(-1)};
    return {a.data<float>(), row_starts(a), a.strides().back(), a.shape(-1)};
  }
  const float* get(std::vector<float>& copy) const {
    if (starts.empty()) return data;
    copy.resize(starts.size() * D);
    for (size_t r = 0; r < starts.size(); r++)
      for (int64_t i = 0; i < D; i++) copy[r * D + i] = data[starts[r] + i * step];
    return copy.data();
  }
};

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t rows, depth, out;
  int parts;
};

// One share of a pool's task: run(part, parts) for part in [0, parts).
constexpr int kSharesPerThread = 8;  // a product's columns in this many shares per pool thread
constexpr int64_t kShareTile = 4;    // a share's columns: whole weight tiles of every ISA
using Task = std::function<void(int, int)>;

void run_part(const Job& j, int part) {
  // output columns in even-sized shares of whole weight tiles
  int64_t tiles = (j.out + kShareTile - 1) / kShareTile;
  int64_t o0 = std::min(j.out, kShareTile * (tiles * part / j.parts));
  int64_t o1 = std::min(j.out, kShareTile * (tiles * (part + 1) / j.parts));
  if (o0 < o1) kSpan(j.x, j.w, j.y, j.rows, j.depth, j.out, o0, o1);
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(std::clamp(threads, 1, kMaxThreads)) {
    for (int t = 1; t < threads_; t++) workers_.emplace_back([this, t] { work(t); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return threads_; }

  // Runs `job` on every thread (this one included); returns once every share is done.
  // Products of several MLX streams (each has its thread) may arrive at once: the pool
  // takes one at a time and a product that finds it busy runs alone on its own thread
  // (how the columns are shared out does not change any output).
  void run(const Task& task, int min_parts = 1) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || threads_ == 1 || min_parts < threads_) {
      task(0, 1);
      return;
    }
    task_ = &task;
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    task(0, threads_);
    for (int spin = 0; pending_.load(std::memory_order_acquire) > 0; spin++) relax(spin);
  }

 private:
  // One turn of a wait: a few pauses first (the other side is microseconds away), then the
  // core is offered to the OS at each turn, so that when more threads want the cores than
  // there are (two models decoding at once, each with its stream's thread) a waiting thread
  // does not hold a core the thread it waits for needs.
  static constexpr int kSpins = 64 + 4096;  // a few ms awake after a product, then asleep

  static void relax(int spin) {
    if (spin < 64)
      RP_PAUSE();
    else
      std::this_thread::yield();
  }

  void work(int t) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = generation_.load(std::memory_order_acquire);
      // spin a while (the next product of a step follows within microseconds), then sleep
      for (int spin = 0; g == seen && spin < kSpins; spin++) {
        relax(spin);
        g = generation_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_) return;
      (*task_)(t, threads_);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the thread whose product the pool is running
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  bool stop_ = false;
  const Task* task_ = nullptr;
};

// Every core unless MLXKV_ROW_THREADS names a number (read once, at the first product).
int default_threads() {
  if (const char* env = std::getenv("MLXKV_ROW_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return std::min(n, kMaxThreads);
  }
  unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(n ? n : 1, 1, kMaxThreads));
}

std::mutex pool_mutex;
Pool* pool = nullptr;  // created at the first product, kept for the process's life

Pool& the_pool() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (!pool) pool = new Pool(default_threads());
  return *pool;
}

// ---- the primitive ---------------------------------------------------------------------

// Every primitive of this module: the CPU only, its output shaped as its first input unless
// it says otherwise.
class CpuPrimitive : public mx::Primitive {
 public:
  explicit CpuPrimitive(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// y [rows, out] = x [rows, depth] @ w.T for w [out, depth], all row-contiguous, over the pool.
void product(const float* x, const float* w, float* y, int64_t rows, int64_t depth, int64_t out) {
  // shares smaller than one per thread, taken in turn: a thread that is descheduled (more
  // threads want the cores than there are: two models decoding at once) leaves its shares
  // to the others instead of holding up the product
  Job share{x, w, y, rows, depth, out, 1};
  const int64_t tiles = (out + kShareTile - 1) / kShareTile;
  share.parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tiles, kSharesPerThread * the_pool().threads())));
  std::atomic<int> next{0};
  Task task = [&share, &next](int, int) {
    for (int p; (p = next.fetch_add(1, std::memory_order_relaxed)) < share.parts;) run_part(share, p);
  };
  the_pool().run(task, static_cast<int>(tiles));
}

class RowProduct : public CpuPrimitive {
 public:
  explicit RowProduct(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    mx::array& y = outputs[0];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(y);
    const int64_t depth = w.shape(1), rows = static_cast<int64_t>(x.size()) / depth;
    encoder.dispatch([xs = RowsOf::of(x), ws = RowsOf::of(w), y = y.data<float>(), rows, depth,
                      out = w.shape(0)]() {
      std::vector<float> xcopy, wcopy;  // (only for a strided x or w: row-contiguous is read in place)
      product(xs.get(xcopy), ws.get(wcopy), y, rows, depth, out);
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
  const char* name() const override { return "RowProduct"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const RowProduct*>(&other) != nullptr;
  }
};

// x [..., in] @ w.T for w [out, in]: [..., out]. float32, at most kMaxRows rows, CPU stream.
mx::array row_product(const mx::array& x_in, const mx::array& w, mx::StreamOrDevice s) {
  if (x_in.dtype() != mx::float32 || w.dtype() != mx::float32)
    throw std::invalid_argument("row_product takes float32 arrays");
  if (w.ndim() != 2 || x_in.ndim() < 1 || x_in.shape(-1) != w.shape(1))
    throw std::invalid_argument("row_product takes x [..., in] and w [out, in]");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("row_product runs on the CPU stream only");
  mx::Shape lead(x_in.shape().begin(), x_in.shape().end() - 1);
  int rows = 1;
  for (auto d : lead) rows *= d;
  if (rows < 1 || rows > kMaxRows)
    throw std::invalid_argument("row_product takes 1 to 64 rows");
  // one operation: x and w are read where they lie when row-contiguous (eval_cpu)
  lead.push_back(w.shape(0));
  return mx::array(lead, mx::float32, std::make_shared<RowProduct>(stream), {x_in, w});
}


// One row's output from the partial softmaxes of its spans of keys (flash-decoding's merge):
// span s holds its running maximum m[s * stride], its sum l[s * stride] and its weighted
// values acc[s * acc_span + i * acc_step] for i < D; a span that saw no key (maximum -inf)
// adds nothing, and a row that saw none is 0.
void merge_spans(float* out, int64_t D, int64_t spans, const float* m, const float* l,
                 int64_t stride, const float* acc, int64_t acc_span, int64_t acc_step) {
  float top = -INFINITY;
  for (int64_t s = 0; s < spans; s++) top = std::max(top, m[s * stride]);
  std::fill(out, out + D, 0.0f);
  float total = 0.0f;
  for (int64_t s = 0; s < spans; s++) {
    if (m[s * stride] == -INFINITY) continue;
    const float w = std::exp(m[s * stride] - top);
    total += w * l[s * stride];
    for (int64_t i = 0; i < D; i++) out[i] += w * acc[s * acc_span + i * acc_step];
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t i = 0; i < D; i++) out[i] *= inv;
}

// A [B, Hk, S, D] float32 input as each head's S rows of D floats, D apart: the strides of a
// view whose rows are contiguous (a KV cache's filled slots: the heads a buffer's capacity
// apart), read where it lies; any other layout is copied into rows first.
struct Heads {
  const float* base;
  int64_t per_batch, per_head;  // strides in floats
  mx::Strides strides;  // the input's own, for the copy
  bool rows_ok;

  static Heads of(const mx::array& a) {
    const auto& st = a.strides();
    const bool ok = (a.shape(3) == 1 || st[3] == 1) && (a.shape(2) == 1 || st[2] == a.shape(3));
    return {a.data<float>(), st[0], st[1], st, ok};
  }
  // these rows as they are, or copied into `copy` (on the worker, when the data is there)
  Heads rows(int64_t B, int64_t Hk, int64_t S, int64_t D, std::vector<float>& copy) const {
    if (rows_ok) return *this;
    copy.resize(B * Hk * S * D);
    for (int64_t b = 0; b < B; b++)
      for (int64_t h = 0; h < Hk; h++)
        for (int64_t s = 0; s < S; s++) {
          const float* src = base + b * strides[0] + h * strides[1] + s * strides[2];
          float* dst = copy.data() + ((b * Hk + h) * S + s) * D;
          for (int64_t i = 0; i < D; i++) dst[i] = src[i * strides[3]];
        }
    return {copy.data(), Hk * S * D, S * D, {}, true};
  }
  const float* head(int64_t h, int64_t Hk) const {
    return base + (h / Hk) * per_batch + (h % Hk) * per_head;
  }
};

// The slot attention's work (see SlotAttention below) on row-laid-out q, k and v: query l of
// batch row b sees slots [from[b], offset + l]; out [B, H, L, D]. Batch row b's queries
// [H, L, D] start at qp + b * q_step.
void attend_slots(const float* qp, int64_t q_step, const Heads& kh, const Heads& vh, float* op,
                  int64_t offset, const int32_t* from, int64_t from_step, int64_t B, int64_t H,
                  int64_t L, int64_t D, int64_t Hk, int64_t S, float scale) {
  const int64_t rep = H / Hk, R = rep * L, per_row = H * L * D;
  std::vector<int64_t> visible(R);
  for (int64_t r = 0; r < R; r++) visible[r] = std::min<int64_t>(S, offset + r % L + 1);
  const int64_t reach = std::min<int64_t>(S, offset + L);
  // each batch row's queries end to end (a group's rows [rep, L, D] contiguous), scaled once
  std::vector<float> qs(B * per_row);
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < per_row; i++) qs[b * per_row + i] = qp[b * q_step + i] * scale;
  const int threads = the_pool().threads();
  const int64_t spans = std::max<int64_t>(1, std::min<int64_t>(threads, reach / kBlock));
  const int64_t units = B * Hk * spans;
  std::vector<float> m(units * R, -INFINITY), l(units * R, 0.0f), acc(units * R * D, 0.0f);
  Task task = [&](int part, int parts) {
    for (int64_t u = part; u < units; u += parts) {
      const int64_t head = u / spans, span = u % spans;  // head: b * Hk + kv head
      // a batch row's first slot: its left padding is never seen
      const int64_t lo = from ? std::clamp<int64_t>(from[(head / Hk) * from_step], 0, reach) : 0;
      Attend a{qs.data() + head * R * D, kh.head(head, Hk), vh.head(head, Hk), R, D,
               lo + (reach - lo) * span / spans, lo + (reach - lo) * (span + 1) / spans,
               visible.data(),
               m.data() + u * R, l.data() + u * R, acc.data() + u * R * D};
      kAttend(a);
    }
  };
  the_pool().run(task, static_cast<int>(units));
  for (int64_t head = 0; head < B * Hk; head++)
    for (int64_t r = 0; r < R; r++)  // [B, Hk, rep, L, D] is [B, H, L, D]
      merge_spans(op + (head * R + r) * D, D, spans, m.data() + head * spans * R + r,
                  l.data() + head * spans * R + r, R, acc.data() + (head * spans * R + r) * D,
                  R * D, 1);
}

// softmax(q @ k.T * scale, over the slots each query sees) @ v for q [B, H, L, D] and the
// cache's full buffers k, v [B, Hk, S, D]: query l sees slots [0, offset + l] (a decode
// step's or a verify's queries after `offset` filled slots), H a multiple of Hk; with a
// start per batch row (a batch's left padding), row b's from slot start[b] on.
class SlotAttention : public CpuPrimitive {
 public:
  SlotAttention(mx::Stream stream, float scale) : CpuPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &offset = inputs[3];
    const int32_t* from = inputs.size() > 4 ? inputs[4].data<int32_t>() : nullptr;
    const int64_t from_step = inputs.size() > 4 && inputs[4].ndim() ? inputs[4].strides().back() : 0;
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int64_t B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
    const int64_t Hk = k.shape(1), S = k.shape(2);
    encoder.dispatch([qs_in = RowsOf::of(q), kin = Heads::of(k), vin = Heads::of(v),
                      op = out.data<float>(), off = offset.data<int32_t>(), from, from_step, B, H,
                      L, D, Hk, S, scale = scale_]() {
      // q, k and v read where they lie when laid out as rows (the usual case), else copied
      std::vector<float> qcopy, kcopy, vcopy;
      const float* qp = qs_in.get(qcopy);
      const Heads kh = kin.rows(B, Hk, S, D, kcopy), vh = vin.rows(B, Hk, S, D, vcopy);
      attend_slots(qp, H * L * D, kh, vh, op, off[0], from, from_step, B, H, L, D, Hk, S, scale);
    });
  }
  const char* name() const override { return "SlotAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const SlotAttention*>(&other);
    return o != nullptr && o->scale_ == scale_;
  }

 private:
  float scale_;
};

mx::array slot_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                         const mx::array& offset, float scale, std::optional<mx::array> start,
                         mx::StreamOrDevice s) {
  for (auto* a : {&q, &k, &v})
    if (a->dtype() != mx::float32 || a->ndim() != 4)
      throw std::invalid_argument("slot_attention takes float32 q, k, v of 4 dimensions");
  if (k.shape() != v.shape() || q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3) ||
      q.shape(1) % k.shape(1))
    throw std::invalid_argument("slot_attention takes q [B, H, L, D] and k, v [B, Hk, S, D]");
  if ((q.shape(1) / k.shape(1)) * q.shape(2) > kMaxQueryRows)
    throw std::invalid_argument("slot_attention takes at most 64 queries per KV head");
  if (offset.size() != 1 || offset.dtype() != mx::int32)
    throw std::invalid_argument("slot_attention takes one int32 offset");
  if (start && (start->size() != static_cast<size_t>(q.shape(0)) || start->dtype() != mx::int32))
    throw std::invalid_argument("slot_attention takes an int32 start per batch row");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("slot_attention runs on the CPU stream only");
  // one operation: q, k and v are read where they lie when laid out as rows (eval_cpu)
  std::vector<mx::array> in = {q, k, v, offset};
  if (start) in.push_back(*start);
  return mx::array(q.shape(), mx::float32, std::make_shared<SlotAttention>(stream, scale), in);
}


// A boolean mask [Bm, 1, L, S] or [L, S] (read as [1, 1, L, S]) as the keys [lo, hi) each
// of its Bm x L rows sees: true where every row's keys are one run (a causal mask, a batch's
// left padding, a sliding window: one interval each); a row that sees nothing gets [0, 0).
bool mask_runs(const mx::array& mask, int64_t L, int64_t S, std::vector<int64_t>& lo,
               std::vector<int64_t>& hi) {
  const bool* p = mask.data<bool>();
  const auto& st = mask.strides();
  const int64_t Bm = mask.ndim() == 4 ? mask.shape(0) : 1;
  const int64_t sb = mask.ndim() == 4 ? st[0] : 0, sl = st[mask.ndim() - 2], ss = st.back();
  lo.assign(Bm * L, 0);
  hi.assign(Bm * L, 0);
  for (int64_t b = 0; b < Bm; b++)
    for (int64_t l = 0; l < L; l++) {
      const bool* row = p + b * sb + l * sl;
      int64_t first = 0;
      while (first < S && !row[first * ss]) first++;
      if (first == S) continue;
      int64_t last = S;
      while (!row[(last - 1) * ss]) last--;
      for (int64_t k = first; k < last; k++)
        if (!row[k * ss]) return false;
      lo[b * L + l] = first;
      hi[b * L + l] = last;
    }
  return true;
}

// The same attention one score at a time, for a mask whose rows are not runs of keys (no
// model of mlx-lm's makes one; kept so that any boolean mask is computed right).
void attend_masked(const float* qp, const Heads& kh, const Heads& vh, const mx::array& mask,
                   float* op, int64_t B, int64_t H, int64_t L, int64_t D, int64_t Hk, int64_t S,
                   float scale) {
  const bool* p = mask.data<bool>();
  const auto& st = mask.strides();
  const bool full = mask.ndim() == 4 && mask.shape(0) > 1;
  const int64_t sl = st[mask.ndim() - 2], ss = st.back();
  std::vector<float> w(S);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t head = b * Hk + h / (H / Hk);
      const float *k = kh.head(head, Hk), *v = vh.head(head, Hk);
      for (int64_t l = 0; l < L; l++) {
        const float* q = qp + ((b * H + h) * L + l) * D;
        const bool* row = p + (full ? b * st[0] : 0) + l * sl;
        float top = -INFINITY;
        for (int64_t j = 0; j < S; j++) {
          float t = -INFINITY;
          if (row[j * ss]) {
            t = 0.0f;
            for (int64_t i = 0; i < D; i++) t += q[i] * k[j * D + i];
            t *= scale;
          }
          w[j] = t;
          top = std::max(top, t);
        }
        float* o = op + ((b * H + h) * L + l) * D;
        std::fill(o, o + D, 0.0f);
        if (top == -INFINITY) continue;  // sees nothing: 0
        float total = 0.0f;
        for (int64_t j = 0; j < S; j++) total += (w[j] = w[j] == -INFINITY ? 0.0f : std::exp(w[j] - top));
        for (int64_t j = 0; j < S; j++)
          if (w[j] != 0.0f)
            for (int64_t i = 0; i < D; i++) o[i] += w[j] * v[j * D + i];
        for (int64_t i = 0; i < D; i++) o[i] /= total;
      }
    }
}

// softmax(q @ k.T * scale, over the keys each query sees) @ v for q [B, H, L, D] and keys,
// values [B, Hk, S, D]: query l sees keys [0, first + l) (a causal prompt chunk: first =
// S - L + 1; no mask: first = S), or with a boolean mask [B or 1, 1, L, S] the keys it
// marks (a padded batch, a sliding window: each row's keys [lo, hi), blocks outside every
// row's run skipped); H a multiple of Hk. Work units are (KV head, tile of query rows, span
// of keys); the spans split the keys only when the tiles are too few to keep every thread
// busy (a short chunk over a long context), their partial softmaxes merged after.
class ChunkAttention : public CpuPrimitive {
 public:
  ChunkAttention(mx::Stream stream, float scale, int64_t first)
      : CpuPrimitive(stream), scale_(scale), first_(first) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int64_t B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
    const int64_t Hk = k.shape(1), S = k.shape(2);
    std::optional<mx::array> mask;
    if (inputs.size() > 3) mask = inputs[3];
    encoder.dispatch([qp = q.data<float>(), kin = Heads::of(k), vin = Heads::of(v), mask,
                      op = out.data<float>(), B, H, L, D, Hk, S, scale = scale_,
                      first = first_]() {
      // keys and values as rows of D floats per head: a cache's view (the filled slots of a
      // larger buffer) as it is, any other layout copied first
      std::vector<float> kcopy, vcopy;
      const Heads kh = kin.rows(B, Hk, S, D, kcopy), vh = vin.rows(B, Hk, S, D, vcopy);
      // the keys [lo, hi) of each (mask row, position): mask rows Bm (1: shared by the batch)
      std::vector<int64_t> lo, hi;
      int64_t Bm = 1;
      if (mask) {
        Bm = mask->ndim() == 4 ? mask->shape(0) : 1;
        if (!mask_runs(*mask, L, S, lo, hi)) {
          attend_masked(qp, kh, vh, *mask, op, B, H, L, D, Hk, S, scale);
          return;
        }
      } else {
        lo.assign(L, 0);
        hi.resize(L);
        for (int64_t l = 0; l < L; l++) hi[l] = std::clamp<int64_t>(first + l, 0, S);
      }
      const int64_t rep = H / Hk, W = kChunk.width;
      // tiles of at most kTileRows rows, as even as the positions allow
      const int64_t most = std::max<int64_t>(1, std::min<int64_t>(L, kTileRows / rep));
      const int64_t tiles = (L + most - 1) / most, heads = B * Hk;
      const int64_t per = (L + tiles - 1) / tiles;
      const int64_t RP = (rep * per + W - 1) / W * W;
      auto positions = [&](int64_t t) { return std::min(L, (t + 1) * per) - t * per; };
      // each (mask row, tile)'s rows (e, l): row e * positions + (l - t * per); padded rows
      // see nothing. Its keys span [key0, reach): the blocks some row sees.
      const int64_t cells = Bm * tiles;
      std::vector<float> visible(cells * RP, 0.0f), from(cells * RP, 0.0f), least(cells),
          most_from(cells);
      std::vector<int64_t> key0(cells), reach(cells);
      for (int64_t c = 0; c < cells; c++) {
        const int64_t bm = c / tiles, t = c % tiles, pt = positions(t);
        int64_t k0 = S, k1 = 0, fewest = S, latest = 0;
        for (int64_t p = 0; p < pt; p++) {
          const int64_t a = lo[bm * L + t * per + p], z = hi[bm * L + t * per + p];
          fewest = std::min(fewest, z);
          latest = std::max(latest, a);
          if (a < z) k0 = std::min(k0, a), k1 = std::max(k1, z);
        }
        for (int64_t r = 0; r < rep * pt; r++) {
          visible[c * RP + r] = static_cast<float>(hi[bm * L + t * per + r % pt]);
          from[c * RP + r] = static_cast<float>(lo[bm * L + t * per + r % pt]);
        }
        least[c] = static_cast<float>(fewest);  // (padded rows' lanes are never read)
        most_from[c] = static_cast<float>(latest);
        key0[c] = k0 < k1 ? k0 : 0;
        reach[c] = k0 < k1 ? k1 : 0;
      }
      std::vector<float> qt(heads * tiles * D * RP, 0.0f);
      for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < tiles; t++) {
          const int64_t pt = positions(t);
          float* dst = qt.data() + (h * tiles + t) * D * RP;
          for (int64_t e = 0; e < rep; e++)
            for (int64_t p = 0; p < pt; p++) {
              const float* src = qp + (((h / Hk) * H + (h % Hk) * rep + e) * L + t * per + p) * D;
              for (int64_t i = 0; i < D; i++) dst[i * RP + e * pt + p] = src[i] * scale;
            }
        }
      const int threads = the_pool().threads();
      const int64_t longest = *std::max_element(reach.begin(), reach.end());
      int64_t spans = 1;
      if (heads * tiles < 2 * threads)
        spans = std::clamp<int64_t>((2 * threads + heads * tiles - 1) / (heads * tiles), 1,
                                    std::max<int64_t>(1, longest / (4 * kKeyBlock)));
      const int64_t units = heads * tiles * spans;
      std::vector<float> m(units * RP, -INFINITY), l(units * RP, 0.0f), acc(units * RP * D, 0.0f);
      std::atomic<int64_t> next{0};
      Task task = [&](int, int) {
        // the last tiles (the longest reach) first, so that the shares even out
        for (int64_t n; (n = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
          const int64_t u = units - 1 - n;
          const int64_t span = u % spans, ht = u / spans, t = ht % tiles, h = ht / tiles;
          const int64_t c = (Bm == 1 ? 0 : h / Hk) * tiles + t, k0 = key0[c];
          const int64_t width = reach[c] - k0;
          ChunkUnit a{qt.data() + ht * D * RP, kh.head(h, Hk), vh.head(h, Hk), RP,
                      rep * positions(t), D, k0 + width * span / spans,
                      k0 + width * (span + 1) / spans, visible.data() + c * RP, least[c],
                      from.data() + c * RP, most_from[c], m.data() + u * RP, l.data() + u * RP,
                      acc.data() + u * RP * D};
          kChunk.run(a);
        }
      };
      the_pool().run(task, static_cast<int>(units));
      for (int64_t ht = 0; ht < heads * tiles; ht++) {
        const int64_t t = ht % tiles, h = ht / tiles, pt = positions(t);
        for (int64_t r = 0; r < rep * pt; r++) {
          const int64_t e = r / pt, pos = t * per + r % pt;
          merge_spans(op + (((h / Hk) * H + (h % Hk) * rep + e) * L + pos) * D, D, spans,
                      m.data() + ht * spans * RP + r, l.data() + ht * spans * RP + r, RP,
                      acc.data() + ht * spans * D * RP + r, D * RP, RP);
        }
      }
    });
  }
  const char* name() const override { return "ChunkAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const ChunkAttention*>(&other);
    return o != nullptr && o->scale_ == scale_ && o->first_ == first_;
  }

 private:
  float scale_;
  int64_t first_;
};

mx::array chunk_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                          float scale, int64_t first, std::optional<mx::array> mask,
                          mx::StreamOrDevice s) {
  for (auto* a : {&q, &k, &v})
    if (a->dtype() != mx::float32 || a->ndim() != 4)
      throw std::invalid_argument("chunk_attention takes float32 q, k, v of 4 dimensions");
  if (k.shape() != v.shape() || q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3) ||
      q.shape(1) % k.shape(1))
    throw std::invalid_argument("chunk_attention takes q [B, H, L, D] and k, v [B, Hk, S, D]");
  if (q.shape(1) / k.shape(1) > kTileRows)
    throw std::invalid_argument("chunk_attention takes at most 64 query heads per KV head");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("chunk_attention runs on the CPU stream only");
  if (mask) {
    const int64_t L = q.shape(2), S = k.shape(2);
    const bool shaped = (mask->ndim() == 2 && mask->shape(0) == L && mask->shape(1) == S) ||
                        (mask->ndim() == 4 && (mask->shape(0) == 1 || mask->shape(0) == q.shape(0)) &&
                         mask->shape(1) == 1 && mask->shape(2) == L && mask->shape(3) == S);
    if (mask->dtype() != mx::bool_ || !shaped)
      throw std::invalid_argument("chunk_attention takes a bool mask [L, S] or [B or 1, 1, L, S]");
  }
  // keys and values stay as they are (a cache's view is read in place: eval_cpu)
  std::vector<mx::array> in = {mx::contiguous(q, false, stream), k, v};
  if (mask) in.push_back(*mask);
  return mx::array(q.shape(), mx::float32, std::make_shared<ChunkAttention>(stream, scale, first),
                   in);
}


// ---- a norm and a rotation, each one primitive ------------------------------------------------
// On the CPU, MLX's fast rms_norm and rope run as their decomposed graphs (about 8 and 25
// operations each). A decode step of one token runs two norms and two rotations per layer,
// and every operation costs its dispatch whatever its size: on the real model those
// graphs were a sixth of a step's time. Here each is one operation, on the stream's thread.

// One row of D floats (`step` apart) normalized: src * rsqrt(mean(src * src) + eps) * w.
void rms_row(const float* src, int64_t step, const float* w, int64_t wstep, float* dst,
             int64_t D, float eps) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  if (step == 1)
    for (; i + 8 <= D; i += 8)
      for (int j = 0; j < 8; j++) part[j] += src[i + j] * src[i + j];
  for (; i < D; i++) part[0] += src[i * step] * src[i * step];
  const float sum = ((part[0] + part[4]) + (part[1] + part[5])) +
                    ((part[2] + part[6]) + (part[3] + part[7]));
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  for (int64_t k = 0; k < D; k++) dst[k] = (src[k * step] * inv) * w[k * wstep];
}

// One row of D floats (`step` apart) rotated by the angles whose cosines and sines are c, s
// [half]: pairs (i, i + half), or (2i, 2i + 1) when traditional; features past 2 * half copied.
void rotate_row(const float* src, int64_t step, float* dst, const float* c, const float* s,
                int64_t half, int64_t D, bool traditional) {
  const int64_t a = traditional ? 2 : 1, bo = traditional ? 1 : half;
  for (int64_t i = 0; i < half; i++) {
    const float x1 = src[(a * i) * step], x2 = src[(a * i + bo) * step];
    dst[a * i] = x1 * c[i] - x2 * s[i];
    dst[a * i + bo] = x1 * s[i] + x2 * c[i];
  }
  for (int64_t i = 2 * half; i < D; i++) dst[i] = src[i * step];
}

// The rotation's frequencies: 1 / freqs[i] where given, else base^(-i / half), as MLX's.
std::vector<float> inverse_frequencies(const float* freqs, int64_t fstep, float base, int64_t half) {
  std::vector<float> inv(half);
  const float at = static_cast<float>(std::log(base) / half);
  for (int64_t i = 0; i < half; i++)
    inv[i] = freqs ? 1.0f / freqs[i * fstep] : std::exp(static_cast<float>(-i) * at);
  return inv;
}

// The cosines and sines of one position's angles: pos * inv[i] for i < half.
void angles(float pos, const std::vector<float>& inv, float* c, float* s) {
  for (size_t i = 0; i < inv.size(); i++) {
    c[i] = std::cos(pos * inv[i]);
    s[i] = std::sin(pos * inv[i]);
  }
}

// x * rsqrt(mean(x * x) + eps) * w over the last dimension, as MLX's rms_norm computes it.
class RmsNorm : public CpuPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &x = inputs[0], &w = inputs[1];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), op = out.data<float>(),
                      starts = row_starts(x), D = x.shape(-1), step = x.strides().back(),
                      wstep = w.strides().back(), eps = eps_]() {
      for (size_t r = 0; r < starts.size(); r++) {
        const float* src = xp + starts[r];
        float* dst = op + static_cast<int64_t>(r) * D;
        rms_row(src, step, wp, wstep, dst, D, eps);
      }
    });
  }
  const char* name() const override { return "RmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const RmsNorm*>(&other);
    return o != nullptr && o->eps_ == eps_;
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32)
    throw std::invalid_argument("rms_norm takes float32 arrays");
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm takes x [..., D] and w [D]");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("rms_norm runs on the CPU stream only");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps), {x, w});
}

// silu(gate) * up elementwise (a SwiGLU MLP's activation) as one operation over the pool: MLX's
// CPU backend takes its exp an element at a time, and a prompt chunk's activation is millions
// of elements. A lazy operation like any other, so a chunk's layers still compute only when
// evaluated (a prefill evaluated layer by layer can stop between two).
class Swiglu : public CpuPrimitive {
 public:
  explicit Swiglu(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &g = inputs[0], &u = inputs[1];
    mx::array& out = outputs[0];
    // the gate's buffer where nothing else holds it (each element is read before it is written)
    if (g.is_donatable() && g.flags().row_contiguous)
      out.copy_shared_buffer(g);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(g);
    encoder.set_input_array(u);
    encoder.set_output_array(out);
    const int64_t width = g.shape(-1), rows = width ? static_cast<int64_t>(g.size()) / width : 0;
    encoder.dispatch([gs = RowsOf::of(g), us = RowsOf::of(u), op = out.data<float>(), rows, width]() {
      std::vector<float> gcopy, ucopy;  // only where a row's elements are not adjacent
      const bool flat = gs.starts.empty() && us.starts.empty();
      const float* gp = gs.step == 1 ? gs.data : gs.get(gcopy);
      const float* up = us.step == 1 ? us.data : us.get(ucopy);
      const bool g_rows = gs.step == 1 && !gs.starts.empty(), u_rows = us.step == 1 && !us.starts.empty();
      const int64_t n = rows * width;
      // a thread's share only pays for its wake-up past ~100k elements
      const int64_t parts = flat ? n >> 17 : std::min<int64_t>(rows, n >> 17);
      Task task = [&](int part, int count) {
        if (flat) {
          const int64_t i0 = n * part / count, i1 = n * (part + 1) / count;
          kSwiglu(gp + i0, up + i0, op + i0, i1 - i0);
          return;
        }
        for (int64_t r = rows * part / count; r < rows * (part + 1) / count; r++)
          kSwiglu(g_rows ? gp + gs.starts[r] : gp + r * width,
                  u_rows ? up + us.starts[r] : up + r * width, op + r * width, width);
      };
      the_pool().run(task, static_cast<int>(std::min<int64_t>(parts, kMaxThreads)));
    });
  }
  const char* name() const override { return "Swiglu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const Swiglu*>(&other) != nullptr;
  }
};

mx::array swiglu(const mx::array& g, const mx::array& u, mx::StreamOrDevice s) {
  if (g.dtype() != mx::float32 || u.dtype() != mx::float32)
    throw std::invalid_argument("swiglu takes float32 arrays");
  if (g.ndim() < 1 || g.shape() != u.shape())
    throw std::invalid_argument("swiglu takes gate and up of one shape");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("swiglu runs on the CPU stream only");
  return mx::array(g.shape(), mx::float32, std::make_shared<Swiglu>(stream), {g, u});
}

// The rotary embedding of x [B, ..., T, D] at positions offset (+ t along T), as MLX's rope
// computes it: angle (t + offset[b]) * scale * f_i with f_i = base^(-i / (dims / 2)) or
// 1 / freqs[i]; the first `dims` features rotated in pairs (i, i + dims / 2), or (2i, 2i + 1)
// when `traditional`, the rest copied. offset: one int32, or one per batch row.
class Rope : public CpuPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : CpuPrimitive(stream), dims_(dims), traditional_(traditional), base_(base),
        scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &x = inputs[0], &offset = inputs[1];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int64_t half = dims_ / 2;
    const float* freqs = inputs.size() > 2 ? inputs[2].data<float>() : nullptr;
    const int64_t fstep = inputs.size() > 2 ? inputs[2].strides()[0] : 0;
    const int64_t T = x.shape(-2), B = x.shape(0);
    const int64_t ostep = offset.ndim() ? offset.strides()[0] : 0;
    encoder.dispatch([xp = x.data<float>(), off = offset.data<int32_t>(), ostep,
                      per_row = offset.size() > 1, op = out.data<float>(), starts = row_starts(x),
                      freqs, fstep, D = x.shape(-1), step = x.strides().back(), T, B, half,
                      traditional = traditional_, base = base_, scale = scale_]() {
      // (inputs are read here, on the stream's thread, once their data is there)
      const std::vector<float> inv = inverse_frequencies(freqs, fstep, base, half);
      const int64_t rows = static_cast<int64_t>(starts.size()), per_b = rows / B;
      std::vector<float> cs(T * half), sn(T * half);
      for (int64_t b = 0; b < B; b++) {
        // this batch row's angles, one [T, half] table for all its heads
        if (b == 0 || per_row) {
          const int32_t o = off[per_row ? b * ostep : 0];
          for (int64_t t = 0; t < T; t++)
            angles(static_cast<float>(t + o) * scale, inv, cs.data() + t * half, sn.data() + t * half);
        }
        for (int64_t r = b * per_b; r < (b + 1) * per_b; r++) {
          const float* src = xp + starts[r];
          float* dst = op + r * D;
          const float* c = cs.data() + (r % T) * half;
          const float* s = sn.data() + (r % T) * half;
          rotate_row(src, step, dst, c, s, half, D, traditional);
        }
      }
    });
  }
  const char* name() const override { return "Rope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const Rope*>(&other);
    return o != nullptr && o->dims_ == dims_ && o->traditional_ == traditional_ &&
           o->base_ == base_ && o->scale_ == scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
};

mx::array rope(const mx::array& x, const mx::array& offset, int dims, bool traditional,
               std::optional<float> base, float scale, std::optional<mx::array> freqs,
               mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || (x.ndim() != 3 && x.ndim() != 4))
    throw std::invalid_argument("rope takes a float32 x of 3 or 4 dimensions");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0))))
    throw std::invalid_argument("rope takes one int32 offset, or one per batch row");
  if (dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("rope takes an even dims of at most x's last dimension");
  if (freqs.has_value() == base.has_value())
    throw std::invalid_argument("rope takes one of base and freqs");
  if (freqs && (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != dims / 2))
    throw std::invalid_argument("rope takes float32 freqs of dims / 2");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("rope runs on the CPU stream only");
  std::vector<mx::array> in = {x, offset};
  if (freqs) in.push_back(*freqs);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(stream, dims, traditional, base.value_or(1.0f), scale),
                   in);
}


// ---- a llama-shaped layer's decode step, four operations ------------------------------------
// A decode step of one token through a llama-shaped layer is some 25 MLX operations (the
// norms, the products and their views, the heads' reshapes, the rotations, the cache writes,
// the attention, the residuals), each paying its dispatch: on the real model that was a
// third of a step. Here it is four, their products and attention still over every core:
//   LayerProject: p = [rotate(q), rotate(k), v] for q, k, v = rms(x) @ [Wq; Wk; Wv].T
//                 (+ their biases; each head of q and k by its own rms norm first, qwen3's)
//   SlotWrite (twice): the key and value buffers with p's k (v) written at slot `offset`
//   LayerRest: x1 = x + attention(q over slots [0, offset]) @ Wo.T ;
//              out = x1 + (silu(g) * u) @ Wd.T for g, u = rms(x1) @ [Wg; Wu].T
// The writes are operations of their own, with one output each, so that MLX can donate the
// buffer to them and they write in place as its slice_update does (the compiled step's
// buffers have no other owner); an operation with several outputs holds its inputs once per
// output, which no donation survives.
std::atomic<int64_t> buffer_copies{0};  // buffers a SlotWrite copied: another owner held them

struct Rotation {
  int dims;
  bool traditional;
  float base, scale;
  bool operator==(const Rotation& o) const {
    return dims == o.dims && traditional == o.traditional && base == o.base && scale == o.scale;
  }
};

// inputs: x, ln, wqkv, offset, then bqkv where biased, then q_norm, k_norm where the heads
// are normalized (qk_eps >= 0: each head's q and k by its own rms norm, before the rotation)
class LayerProject : public CpuPrimitive {
 public:
  LayerProject(mx::Stream stream, float eps, Rotation rot, int64_t heads, int64_t kv_heads,
               bool biased, float qk_eps)
      : CpuPrimitive(stream), eps_(eps), rot_(rot), heads_(heads), kv_heads_(kv_heads),
        biased_(biased), qk_eps_(qk_eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int64_t H = inputs[0].shape(-1), width = inputs[2].shape(0);
    const int nb = biased_ ? 5 : 4;
    const bool normed = qk_eps_ >= 0.0f;
    const int64_t B = out.shape(0);
    const int64_t pos_step = inputs[3].size() == 1 ? 0 : inputs[3].strides()[0];
    encoder.dispatch([x = RowsOf::of(inputs[0]), ln = RowsOf::of(inputs[1]),
                      w = RowsOf::of(inputs[2]), off = inputs[3].data<int32_t>(), B, pos_step,
                      bias = biased_ ? inputs[4].data<float>() : nullptr,
                      bstep = biased_ ? inputs[4].strides()[0] : 0,
                      qn = normed ? inputs[nb].data<float>() : nullptr,
                      qstep = normed ? inputs[nb].strides()[0] : 0,
                      kn = normed ? inputs[nb + 1].data<float>() : nullptr,
                      kstep = normed ? inputs[nb + 1].strides()[0] : 0, qk_eps = qk_eps_,
                      op = out.data<float>(), H, width, eps = eps_, rot = rot_, Nq = heads_,
                      Nk = kv_heads_]() {
      std::vector<float> c0, c1, c2, h(B * H), pb(B * width);
      const float *xs = x.get(c0), *lw = ln.get(c1);
      for (int64_t b = 0; b < B; b++) rms_row(xs + b * H, 1, lw, 1, h.data() + b * H, H, eps);
      product(h.data(), w.get(c2), pb.data(), B, H, width);  // each row as it would be alone
      const int64_t D = width / (Nq + 2 * Nk), half = rot.dims / 2;
      const std::vector<float> inv = inverse_frequencies(nullptr, 0, rot.base, half);
      std::vector<float> c(half), sn(half);
      for (int64_t b = 0; b < B; b++) {
        float* p = pb.data() + b * width;
        float* o = op + b * width;
        if (bias)
          for (int64_t i = 0; i < width; i++) p[i] += bias[i * bstep];
        if (qn) {  // each query head by q_norm, each key head by k_norm
          for (int64_t hd = 0; hd < Nq + Nk; hd++)  // in place: each value is read before it is written
            rms_row(p + hd * D, 1, hd < Nq ? qn : kn, hd < Nq ? qstep : kstep, p + hd * D, D, qk_eps);
        }
        angles(static_cast<float>(off[b * pos_step]) * rot.scale, inv, c.data(), sn.data());
        for (int64_t hd = 0; hd < Nq + Nk; hd++)  // the queries' heads and the keys'
          rotate_row(p + hd * D, 1, o + hd * D, c.data(), sn.data(), half, D, rot.traditional);
        std::memcpy(o + (Nq + Nk) * D, p + (Nq + Nk) * D, sizeof(float) * Nk * D);
      }
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[2].shape(0)}};
  }
  const char* name() const override { return "LayerProject"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerProject*>(&other);
    return o != nullptr && o->eps_ == eps_ && o->rot_ == rot_ && o->heads_ == heads_ &&
           o->kv_heads_ == kv_heads_ && o->biased_ == biased_ && o->qk_eps_ == qk_eps_;
  }

 private:
  float eps_;
  Rotation rot_;
  int64_t heads_, kv_heads_;
  bool biased_;
  float qk_eps_;
};

// buf [B, Nk, S, D] with p[b, from + h * D : from + (h + 1) * D] written at slot offset of
// row b's head h (a batch's rows write one slot: their left padding keeps them aligned).
class SlotWrite : public CpuPrimitive {
 public:
  SlotWrite(mx::Stream stream, int64_t from) : CpuPrimitive(stream), from_(from) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& buf = inputs[0];
    mx::array& out = outputs[0];
    const bool copy = !(buf.is_donatable() && buf.flags().row_contiguous);
    if (copy) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      buffer_copies.fetch_add(1, std::memory_order_relaxed);
    } else {
      out.copy_shared_buffer(buf);
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([in = RowsOf::of(buf), copy, p = inputs[1].data<float>(),
                      width = inputs[1].shape(1), off = inputs[2].data<int32_t>(),
                      op = out.data<float>(), B = buf.shape(0), Nk = buf.shape(1),
                      S = buf.shape(2), D = buf.shape(3), from = from_]() {
      if (copy) {
        std::vector<float> scratch;
        std::memcpy(op, in.get(scratch), sizeof(float) * B * Nk * S * D);
      }
      for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Nk; h++)
          std::memcpy(op + ((b * Nk + h) * S + off[0]) * D, p + b * width + from + h * D,
                      sizeof(float) * D);
    });
  }
  const char* name() const override { return "SlotWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const SlotWrite*>(&other);
    return o != nullptr && o->from_ == from_;
  }

 private:
  int64_t from_;
};

class LayerRest : public CpuPrimitive {
 public:
  LayerRest(mx::Stream stream, float eps, float scale, int64_t heads)
      : CpuPrimitive(stream), eps_(eps), scale_(scale), heads_(heads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    // inputs: x, p, keys, values, offset, wo, ln2, wgu, wd, then start where the rows have
    // left padding (row b sees slots [start[b], offset])
    const mx::array& keys = inputs[2];
    std::vector<RowsOf> in;
    for (int i : {0, 5, 6, 7, 8}) in.push_back(RowsOf::of(inputs[i]));
    const bool padded = inputs.size() > 9;
    encoder.dispatch([in = std::move(in), p = inputs[1].data<float>(), width = inputs[1].shape(1),
                      kin = Heads::of(keys), vin = Heads::of(inputs[3]),
                      off = inputs[4].data<int32_t>(),
                      from = padded ? inputs[9].data<int32_t>() : nullptr,
                      from_step = padded ? inputs[9].strides()[0] : 0,
                      op = out.data<float>(), H = inputs[0].shape(-1), I = inputs[8].shape(1),
                      B = keys.shape(0), Nk = keys.shape(1), S = keys.shape(2), D = keys.shape(3),
                      eps = eps_, scale = scale_, Nq = heads_]() {
      std::vector<float> copies[5], kcopy, vcopy;
      const float *x = in[0].get(copies[0]), *wo = in[1].get(copies[1]),
                  *ln = in[2].get(copies[2]), *wgu = in[3].get(copies[3]),
                  *wd = in[4].get(copies[4]);
      const Heads kh = kin.rows(B, Nk, S, D, kcopy), vh = vin.rows(B, Nk, S, D, vcopy);
      std::vector<float> att(B * Nq * D), x1(B * H), h(B * H), gu(B * 2 * I), act(B * I);
      // a row's queries are the first Nq * D values of its p row
      attend_slots(p, width, kh, vh, att.data(), off[0], from, from_step, B, Nq, 1, D, Nk, S, scale);
      product(att.data(), wo, x1.data(), B, Nq * D, H);
      for (int64_t i = 0; i < B * H; i++) x1[i] += x[i];
      for (int64_t b = 0; b < B; b++) rms_row(x1.data() + b * H, 1, ln, 1, h.data() + b * H, H, eps);
      product(h.data(), wgu, gu.data(), B, H, 2 * I);
      for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < I; i++) {
          const float g = gu[b * 2 * I + i];
          act[b * I + i] = g / (1.0f + std::exp(-g)) * gu[b * 2 * I + I + i];
        }
      product(act.data(), wd, op, B, I, H);
      for (int64_t i = 0; i < B * H; i++) op[i] += x1[i];
    });
  }
  const char* name() const override { return "LayerRest"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerRest*>(&other);
    return o != nullptr && o->eps_ == eps_ && o->scale_ == scale_ && o->heads_ == heads_;
  }

 private:
  float eps_, scale_;
  int64_t heads_;
};

// One token of each of B rows, x [B, 1, hidden], through a llama-shaped layer: (out, keys,
// values), the buffers [B, kv_heads, slots, head_dim] with each row's key and value at slot
// offset. One row is rotated at position offset; a batch's rows at their own `positions`
// ([B]), each seeing slots [start[b], offset] (its left padding unseen).
std::vector<mx::array> decode_layer(const mx::array& x, const mx::array& ln1, const mx::array& wqkv,
                                    const mx::array& wo, const mx::array& ln2, const mx::array& wgu,
                                    const mx::array& wd, const mx::array& keys,
                                    const mx::array& values, const mx::array& offset, float eps1,
                                    float eps2, int rope_dims, bool traditional, float base,
                                    float rope_scale, float scale,
                                    std::optional<mx::array> bqkv, std::optional<mx::array> q_norm,
                                    std::optional<mx::array> k_norm, float qk_eps,
                                    std::optional<mx::array> positions,
                                    std::optional<mx::array> start, mx::StreamOrDevice s) {
  for (auto* a : {&x, &ln1, &wqkv, &wo, &ln2, &wgu, &wd, &keys, &values})
    if (a->dtype() != mx::float32)
      throw std::invalid_argument("decode_layer takes float32 arrays");
  if (x.ndim() != 3 || x.shape(1) != 1)
    throw std::invalid_argument("decode_layer takes one token a row: x [B, 1, hidden]");
  const int64_t H = x.shape(-1), B = x.shape(0);
  if (keys.ndim() != 4 || keys.shape() != values.shape() || keys.shape(0) != B)
    throw std::invalid_argument("decode_layer takes key and value buffers [B, kv_heads, slots, head_dim]");
  if (B > kMaxRows)
    throw std::invalid_argument("decode_layer takes at most 64 rows");
  for (auto* a : {&positions, &start})
    if (a->has_value() && ((*a)->dtype() != mx::int32 || (*a)->ndim() != 1 || (*a)->shape(0) != B))
      throw std::invalid_argument("decode_layer takes int32 positions and start [B]");
  if (B > 1 && !positions)
    throw std::invalid_argument("decode_layer takes each row's position for more than one row");
  const int64_t Nk = keys.shape(1), D = keys.shape(3);
  if (wqkv.ndim() != 2 || wqkv.shape(1) != H || wqkv.shape(0) % D || wqkv.shape(0) / D <= 2 * Nk ||
      (wqkv.shape(0) / D - 2 * Nk) % Nk)
    throw std::invalid_argument("decode_layer takes wqkv [(heads + 2 * kv_heads) * head_dim, hidden]");
  const int64_t Nq = wqkv.shape(0) / D - 2 * Nk;
  if (Nq / Nk > kMaxQueryRows)
    throw std::invalid_argument("decode_layer takes at most 64 query heads per KV head");
  if (wo.ndim() != 2 || wo.shape(0) != H || wo.shape(1) != Nq * D)
    throw std::invalid_argument("decode_layer takes wo [hidden, heads * head_dim]");
  if (wgu.ndim() != 2 || wgu.shape(1) != H || wgu.shape(0) % 2 || wd.ndim() != 2 ||
      wd.shape(0) != H || wd.shape(1) != wgu.shape(0) / 2)
    throw std::invalid_argument("decode_layer takes wgu [2 * inter, hidden] and wd [hidden, inter]");
  if (ln1.ndim() != 1 || ln1.shape(0) != H || ln2.ndim() != 1 || ln2.shape(0) != H)
    throw std::invalid_argument("decode_layer takes norm weights [hidden]");
  if (offset.size() != 1 || offset.dtype() != mx::int32)
    throw std::invalid_argument("decode_layer takes one int32 offset");
  if (rope_dims <= 0 || rope_dims % 2 || rope_dims > D)
    throw std::invalid_argument("decode_layer takes an even rope_dims of at most head_dim");
  if (bqkv && (bqkv->dtype() != mx::float32 || bqkv->ndim() != 1 || bqkv->shape(0) != wqkv.shape(0)))
    throw std::invalid_argument("decode_layer takes a float32 bqkv [(heads + 2 * kv_heads) * head_dim]");
  if (q_norm.has_value() != k_norm.has_value())
    throw std::invalid_argument("decode_layer takes q_norm and k_norm together");
  if (q_norm && (q_norm->dtype() != mx::float32 || k_norm->dtype() != mx::float32 ||
                 q_norm->ndim() != 1 || k_norm->ndim() != 1 || q_norm->shape(0) != D ||
                 k_norm->shape(0) != D || qk_eps < 0.0f))
    throw std::invalid_argument("decode_layer takes float32 q_norm, k_norm [head_dim] and qk_eps >= 0");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("decode_layer runs on the CPU stream only");
  const Rotation rot{rope_dims, traditional, base, rope_scale};
  std::vector<mx::array> project_in = {x, ln1, wqkv, positions ? *positions : offset};
  if (bqkv) project_in.push_back(*bqkv);
  if (q_norm) {
    project_in.push_back(*q_norm);
    project_in.push_back(*k_norm);
  }
  auto p = mx::array({B, wqkv.shape(0)}, mx::float32,
                     std::make_shared<LayerProject>(stream, eps1, rot, Nq, Nk, bqkv.has_value(),
                                                    q_norm ? qk_eps : -1.0f),
                     project_in);
  auto k = mx::array(keys.shape(), mx::float32, std::make_shared<SlotWrite>(stream, Nq * D),
                     {keys, p, offset});
  auto v = mx::array(values.shape(), mx::float32, std::make_shared<SlotWrite>(stream, (Nq + Nk) * D),
                     {values, p, offset});
  std::vector<mx::array> rest_in = {x, p, k, v, offset, wo, ln2, wgu, wd};
  if (start) rest_in.push_back(*start);
  auto out = mx::array(x.shape(), mx::float32, std::make_shared<LayerRest>(stream, eps2, scale, Nq),
                       rest_in);
  return {out, k, v};
}

}  // namespace

NB_MODULE(_row_product, m) {
  m.doc() = "x @ w.T for a few rows on MLX's CPU backend, over all cores (RowProduct)";
  m.def("row_product", &row_product, nb::arg("x"), nb::arg("w"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "x [..., in] @ w.T for w [out, in], float32, 1 to 64 rows, on the CPU.");
  m.def("threads", [] { return the_pool().threads(); }, "Threads a product is split over.");
  m.def("slot_attention", &slot_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("offset"), nb::arg("scale"), nb::kw_only(), nb::arg("start") = nb::none(),
        nb::arg("stream") = nb::none(),
        "softmax(q @ k.T * scale) @ v, query l of q [B, H, L, D] seeing slots [0, offset + l]"
        " of k, v [B, Hk, S, D] (batch row b from slot start[b], where start is given);"
        " float32, on the CPU.");
  m.def("chunk_attention", &chunk_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("first"), nb::kw_only(), nb::arg("mask") = nb::none(),
        nb::arg("stream") = nb::none(),
        "softmax(q @ k.T * scale) @ v, query l of q [B, H, L, D] seeing keys [0, first + l)"
        " of k, v [B, Hk, S, D], or with mask (bool [L, S] or [B or 1, 1, L, S]) the keys"
        " it marks; float32, on the CPU.");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("w"), nb::arg("eps"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "x * rsqrt(mean(x * x, -1) + eps) * w for x [..., D], w [D]; float32, on the CPU.");
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "silu(gate) * up elementwise; float32, on the CPU.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("offset"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("base").none(), nb::arg("scale"), nb::arg("freqs") = nb::none(), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "mx.fast.rope of x [B, ..., T, D] with an int32 offset (one, or one per batch row);"
        " float32, on the CPU.");
  m.def("decode_layer", &decode_layer, nb::arg("x"), nb::arg("ln1"), nb::arg("wqkv"), nb::arg("wo"),
        nb::arg("ln2"), nb::arg("wgu"), nb::arg("wd"), nb::arg("keys"), nb::arg("values"),
        nb::arg("offset"), nb::kw_only(), nb::arg("eps1"), nb::arg("eps2"), nb::arg("rope_dims"),
        nb::arg("traditional"), nb::arg("base"), nb::arg("rope_scale"), nb::arg("scale"),
        nb::arg("bqkv") = nb::none(), nb::arg("q_norm") = nb::none(),
        nb::arg("k_norm") = nb::none(), nb::arg("qk_eps") = -1.0f,
        nb::arg("positions") = nb::none(), nb::arg("start") = nb::none(),
        nb::arg("stream") = nb::none(),
        "One token a row through a llama-shaped layer: (out, keys, values), the buffers written"
        " at offset; float32, on the CPU.");
  m.def("buffer_copies", [] { return buffer_copies.load(); },
        "Key and value buffers decode_layer copied because another owner held them.");
  m.attr("MAX_ROWS") = kMaxRows;
  m.attr("ISA") = ISA_NAME();  // the kernel family in use: avx512, avx2 or base
}
