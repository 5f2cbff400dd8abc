// moe-offload's CPU kernel: selected experts' matrix-vector products read straight from the stored format.
//
//   out[s, o] = sum_i  W[ids[s]][o, i] * x[s, i]        (float32 accumulation, float32 result)
//
// W is an expert stack as it lies (a resident parameter, a host view, a gathered buffer, cache pages; each expert's
// matrix contiguous, the experts stride(0) apart): float32,
// bfloat16 or float16 [E, O, K] (or transposed [E, K, O]); FP8 e4m3 [E, O, K] with float32 block scales
// [E, R, ceil(K/bk)] (`row_block[o]` is the scale row of output row o); MXFP4 e2m1 blocks [E, O, K/32, 16] with
// e8m0 scales [E, O, K/32]. Nothing is dequantized into memory: each 16 values are decoded in registers and
// multiplied into the accumulators, so a call reads the selected experts' stored bytes once.
//
// One arithmetic, three instruction sets. The result is defined lane by lane, and the AVX-512, AVX2 and portable
// paths compute exactly that definition (fused multiply-adds only, a fixed reduction tree), so they agree bit for
// bit on every CPU, whatever the thread count, alignment or which stack the rows come from:
//   - rows (not transposed): 16 lanes, each with CHAINS (2) accumulators; chunk n of a row (the 16 values at
//     i = 16n + j, zero padded past K) goes to chain h = n % CHAINS: acc_hj = fma(w, x, acc_hj) in order of n.
//     FP8: per block of bk columns, chunk n of the block (counted from the block's start) goes to block chain
//     n % CHAINS, every block chain starting at 0; the block is folded in as acc_j = fma(combine(block_hj),
//     scale * 256, acc_j) with one accumulator per lane (the e4m3 decode below yields value / 256 exactly);
//     MXFP4: group g of 32 goes to chain g % CHAINS, lane j holds byte j (values 2j and 2j+1):
//     b = fma(lo, x[2j], 0), b = fma(hi, x[2j+1], b), acc_hj = fma(b, 2^(e-127), acc_hj). The chains are
//     combined pairwise (a_j = acc_0j + acc_1j), then the lanes are summed as a tree:
//     s8_j = a_j + a_{j+8}, s4_j = s8_j + s8_{j+4}, s2_j = s4_j + s4_{j+2}, out = s2_0 + s2_1.
//     (Two chains keep two multiply-adds of a row in flight: one chain waits on its own latency and ran the bf16
//     layer 15% slower here; interleaving four rows instead ran 1.7x slower.)
//   - transposed (float formats only): out[o] = fma(w[i, o], x[i], out[o]) in order of i.
// Work is split over output rows (torch's intra-op threads, at::parallel_for): each output value is computed by
// one thread in the order above, so the thread count never changes a bit. Pairs that pick the same expert are
// computed together, each row read from memory once for all of them. A call may read float experts lying in
// several stacks (`more`, with `which` naming each pair's): a layer whose experts lie in its parameter and in a
// cache's arena is one call per projection, not one per stack.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

enum Wtype : int64_t { F32 = 0, BF16 = 1, F16 = 2, FP8 = 3, MXFP4 = 4 };
enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

constexpr int64_t ROW_TILE = 16;   // output rows per work item (rows layout)
#ifndef COLT
#define COLT 4096
#endif
constexpr int64_t COL_TILE = COLT;   // output columns per work item (transposed): rows read 8 KiB at a time
constexpr int64_t LANES = 16;
// Rows layout: the line `l1` bytes past the read position is asked into L1, and the one `l2` bytes past it into
// L2, at least once per 64 bytes read (per 32 in the FP8 and MXFP4 loops). A row of a released layer is one 4 KiB
// page (2048 bf16), and the hardware's stream prefetcher starts afresh on each page: fetched ahead, the next row's
// lines are on their way before it begins, and the L2 request ahead keeps more misses in flight than one core's
// stream prefetcher does. The distances that pay follow the core (Qwen3-30B-A3B's lm_head shape, bf16, 2 MiB pages,
// one thread): Xeon SPR: no prefetch 12.2 GB/s; L1 at 1024 15.2; + L2 at 4096 18.2 (36 GB/s at two threads); 4 KiB
// pages 10.3 -> 12.1; L1 512..8192 and L2 2048..16384 tried, beyond 6144 the L2 gain goes; interleaving 2, 4 or 8
// rows was slower than either. EPYC (Zen 4), every distance in one process in turn (benchmarks/prefetch_bench.py):
// 1024 / 4096 17.4 GB/s, 512 / 2048 24.1, no prefetch 21.1, 512 / 4096 and 1024 / 2048 17.9-18.9; at two threads
// 27.1 against 30.5 (in a faster hour of the VM: 23.0 against 32.3, two threads 48.1 against 67.1; every other
// distance between): AMD's default is 512 / 2048 (one row); elsewhere rows in flight changed it (ROWS_IN_FLIGHT
// below). A call may name its own (expert_gemv's pf_l1, pf_l2, pf_rows). A prefetch changes no arithmetic.
struct Prefetch {
  int64_t l1, l2;   // bytes ahead of the read position; 0: no request at that level
  int64_t rows;     // rows of one expert read together (1, 2, 4 or 8): ROWS_IN_FLIGHT below
};

inline void prefetch_ahead(const uint8_t* p, Prefetch pf) {   // p: the bytes being read (a call at least every 64)
  if (pf.l1 > 0) _mm_prefetch(reinterpret_cast<const char*>(p + pf.l1), _MM_HINT_T0);
  if (pf.l2 > 0) _mm_prefetch(reinterpret_cast<const char*>(p + pf.l2), _MM_HINT_T1);
}

constexpr int64_t MAX_PREFETCH = 65536;

// ROWS_IN_FLIGHT: the float formats' rows layout reads `rows` rows of one expert together, chunk by chunk (each
// row's arithmetic exactly as above: its own chains, its own order, its own reduction), so `rows` streams of
// misses are in flight at once where one row's stream alone leaves the core waiting on memory. Qwen3-30B-A3B's
// lm_head, bf16, 2 MiB pages, Ice Lake server (2-core VM), a standalone loop, best of 8: one row with L1 1024 / L2
// 4096 11.7 GB/s at one thread, 22.2 at two; 8 rows with L1 256 / no L2 15.6-16.2 and 28.9-30.1; 8 rows with
// 1024 / 4096 13.2-13.9; 2 and 4 rows between.
// FP8 and MXFP4 rows go one at a time: their decode, not memory, bounds them, and 8 rows together ran slower here
// (4 of 32 experts, one thread: Qwen3's FP8 gate_up 1.24 -> 1.49 ms, gpt-oss's MXFP4 gate_up 4.15 -> 6.00 ms).
// Not yet measured on SPR or Zen 4 (the remarks above on interleaving rows predate this loop): AMD's default stays
// one row with the distances measured there; benchmarks/prefetch_bench.py compares the shapes on any CPU.
Prefetch default_prefetch() {   // asked of the CPU once, not on every call
  static const Prefetch vendor = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? Prefetch{512, 2048, 1} : Prefetch{256, 0, 8};
  }();
  return vendor;
}

// Calls f(std::integral_constant<int, R>{}) for rows in flight R (1, 2, 4 or 8).
template <class F>
inline void by_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}
#ifndef CHAINS
#define CHAINS 2   // accumulator chains per lane (1, 2 or 4): part of the arithmetic's definition, see above
#endif

struct Job {
  int64_t wtype;
  int64_t O, K;              // output rows, input length
  bool transposed;
  const float* x;            // [S, Kp] float32 (zero padded to Kp; MXFP4: each group of 32 as 16 even, 16 odd)
  int64_t Kp;
  const float* scales;       // FP8: [E, R, C]
  int64_t sc_expert, sc_row; // FP8 strides (elements)
  const int32_t* row_block;  // FP8: [O] scale row of each output row
  int64_t bk;                // FP8 block columns
  const uint8_t* mx_scales;  // MXFP4: [E, O, G]
  float* out;                // [S, O]
  const int64_t* order;      // pair indices sorted by expert
  const int64_t* group_start;    // [G + 1] into order
  const int64_t* group_expert;   // [G] the expert's index in its stack (FP8 and MXFP4 scales are indexed so)
  const uint8_t* const* group_matrix;   // [G] where that expert's matrix lies
  int64_t tiles;                 // work items per group
  Prefetch pf;                   // distances ahead of the read position
};

// ---- the definition's pieces shared by every path ---------------------------------------------------------------

inline uint16_t fp8_half_bits(uint8_t b) {   // e4m3 -> the fp16 whose value is the e4m3 value / 256, exactly
  return static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8));
}

inline float e8m0(uint8_t s) {   // 2^(s - 127); s = 0 is the subnormal 2^-127
  uint32_t bits = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

const float FP4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                       -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float reduce16(const float* a) {
  float s8[8], s4[4], s2[2];
  for (int j = 0; j < 8; ++j) s8[j] = a[j] + a[j + 8];
  for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
  for (int j = 0; j < 2; ++j) s2[j] = s4[j] + s4[j + 2];
  return s2[0] + s2[1];
}

// Calls f(std::integral_constant<int64_t, WT>{}) for the job's weight type: the one place the run-time type becomes
// the template argument of an ISA path's row kernel (each path's dispatcher is then one line).
template <class F>
inline void by_wtype(int64_t wtype, F&& f) {
  switch (wtype) {
    case F32: f(std::integral_constant<int64_t, F32>{}); break;
    case BF16: f(std::integral_constant<int64_t, BF16>{}); break;
    case F16: f(std::integral_constant<int64_t, F16>{}); break;
    case FP8: f(std::integral_constant<int64_t, FP8>{}); break;
    default: f(std::integral_constant<int64_t, MXFP4>{});
  }
}

inline int64_t elem_bytes(int64_t wtype) { return wtype == F32 ? 4 : (wtype == FP8 ? 1 : 2); }

// ---- portable path ----------------------------------------------------------------------------------------------

inline float decode(int64_t wtype, const uint8_t* p, int64_t i) {
  switch (wtype) {
    case F32: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
    case BF16: { uint16_t b; std::memcpy(&b, p + 2 * i, 2); return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits())); }
    case F16: { uint16_t b; std::memcpy(&b, p + 2 * i, 2); return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }
    default: return static_cast<float>(c10::Half(fp8_half_bits(p[i]), c10::Half::from_bits()));
  }
}

// CHAINS independent accumulators per lane: chunk (or MXFP4 group) number n goes to chain n % CHAINS, so the
// fused multiply-adds of one row do not wait on each other; the chains are summed pairwise at the end.
template <typename T>
inline T combine_chains(const T* a) {
  if constexpr (CHAINS == 1) return a[0];
  else if constexpr (CHAINS == 2) return a[0] + a[1];
  else return (a[0] + a[1]) + (a[2] + a[3]);
}

// chunks [c0, c1) of one row into chains acc[CHAINS][LANES] (chunk n = (c - c0) / 16 goes to chain n % CHAINS)
inline void chunks_portable(int64_t wtype, const uint8_t* row, const float* x, int64_t K, int64_t c0, int64_t c1,
                            float acc[CHAINS][LANES]) {
  for (int64_t c = c0, n = 0; c < c1; c += LANES, ++n)
    for (int l = 0; l < LANES; ++l) {
      const float w = c + l < K ? decode(wtype, row, c + l) : 0.0f;
      acc[n % CHAINS][l] = std::fma(w, x[c + l], acc[n % CHAINS][l]);
    }
}

inline float finish_portable(float acc[CHAINS][LANES]) {
  float a[LANES];
  for (int l = 0; l < LANES; ++l) {
    float v[CHAINS];
    for (int h = 0; h < CHAINS; ++h) v[h] = acc[h][l];
    a[l] = combine_chains(v);
  }
  return reduce16(a);
}

float row_portable(const Job& j, const uint8_t* row, const float* x, int64_t e, int64_t o) {
  float acc[CHAINS][LANES] = {};
  if (j.wtype == MXFP4) {
    const int64_t G = j.K / 32;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = row + 16 * g;
      const float* xg = x + 32 * g;
      const float sc = e8m0(j.mx_scales[(e * j.O + o) * G + g]);
      for (int l = 0; l < LANES; ++l) {
        float blk = std::fma(FP4[b[l] & 15], xg[l], 0.0f);
        blk = std::fma(FP4[b[l] >> 4], xg[16 + l], blk);
        acc[g % CHAINS][l] = std::fma(blk, sc, acc[g % CHAINS][l]);
      }
    }
    return finish_portable(acc);
  }
  if (j.wtype == FP8) {
    const float* sc = j.scales + e * j.sc_expert + static_cast<int64_t>(j.row_block[o]) * j.sc_row;
    for (int64_t b0 = 0, nb = 0; b0 < j.K; b0 += j.bk, ++nb) {
      float blk[CHAINS][LANES] = {};
      chunks_portable(FP8, row, x, j.K, b0, std::min(b0 + j.bk, j.Kp), blk);
      const float s = sc[nb] * 256.0f;
      for (int l = 0; l < LANES; ++l) {
        float v[CHAINS];
        for (int h = 0; h < CHAINS; ++h) v[h] = blk[h][l];
        acc[0][l] = std::fma(combine_chains(v), s, acc[0][l]);
      }
    }
    return reduce16(acc[0]);
  }
  chunks_portable(j.wtype, row, x, j.K, 0, j.Kp, acc);
  return finish_portable(acc);
}

void cols_portable(const Job& j, const uint8_t* m, const float* x, int64_t o0, int64_t o1, float* out) {
  const int64_t eb = elem_bytes(j.wtype);
  for (int64_t o = o0; o < o1; ++o) {
    float acc = 0.0f;
    for (int64_t i = 0; i < j.K; ++i) acc = std::fma(decode(j.wtype, m + i * j.O * eb, o), x[i], acc);
    out[o] = acc;
  }
}

// A float format's rows [o0, o1) of the expert whose matrix is at m, j.pf.rows at a time while that many are left:
// each block of R rows for each pair by `together(R, rows, row_bytes, x, out)` (an ISA path's rows_together);
// returns the first row not yet computed (the rest go one at a time).
template <int64_t WT, class F>
inline int64_t rows_in_flight(const Job& j, const uint8_t* m, int64_t o0, int64_t o1, const int64_t* toks,
                              int64_t nt, F&& together) {
  int64_t o = o0;
  by_rows(j.pf.rows, [&](auto rows) {
    if constexpr (decltype(rows)::value > 1) {
      constexpr int R = decltype(rows)::value;
      const int64_t row_bytes = j.K * elem_bytes(WT);
      for (; o + R <= o1; o += R)
        for (int64_t t = 0; t < nt; ++t)
          together(rows, m + o * row_bytes, row_bytes, j.x + toks[t] * j.Kp, j.out + toks[t] * j.O + o);
    }
  });
  return o;
}

// ---- AVX2 (+FMA, F16C): the 16 lanes as two 8-lane registers ----------------------------------------------------

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET inline void load16_avx2(int64_t wtype, const uint8_t* p, __m256& lo, __m256& hi) {
  switch (wtype) {
    case F32: lo = _mm256_loadu_ps(reinterpret_cast<const float*>(p)); hi = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8); break;
    case BF16: {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
      hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
      break;
    }
    case F16: {
      lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1));
      break;
    }
    default: {   // FP8
      __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                  _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
      lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
  }
}

AVX2_TARGET inline void load16_tail_avx2(int64_t wtype, const uint8_t* p, int64_t n, __m256& lo, __m256& hi) {
  alignas(64) uint8_t tmp[64] = {0};
  std::memcpy(tmp, p, n * elem_bytes(wtype));
  load16_avx2(wtype, tmp, lo, hi);
}

AVX2_TARGET inline float reduce_avx2(__m256 lo, __m256 hi) {
  alignas(32) float a[16];
  _mm256_store_ps(a, lo);
  _mm256_store_ps(a + 8, hi);
  return reduce16(a);
}

AVX2_TARGET inline __m256 fp4_avx2(__m128i codes8) {   // 8 codes (low 8 bytes, epi32 after cvt) -> values
  const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  __m256i c = _mm256_cvtepu8_epi32(codes8);
  __m256 v = _mm256_permutevar8x32_ps(mag, _mm256_and_si256(c, _mm256_set1_epi32(7)));
  __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
}

AVX2_TARGET inline __m256 combine_avx2(const __m256* a) {   // combine_chains, in registers
  if constexpr (CHAINS == 1) return a[0];
  else if constexpr (CHAINS == 2) return _mm256_add_ps(a[0], a[1]);
  else return _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
}

// Chunks [c0, c1) of one row (c1 <= K rounded up to 16) into the chains: chunk n = (c - c0) / 16 to chain n % CHAINS.
template <int64_t WT>
AVX2_TARGET inline void chunks_avx2(const uint8_t* row, const float* x, int64_t K, int64_t c0, int64_t c1,
                                    __m256* lo, __m256* hi, Prefetch pf) {
  constexpr int64_t eb = WT == F32 ? 4 : (WT == FP8 ? 1 : 2);
  __m256 wlo, whi;
  int64_t c = c0;
  for (; c + CHAINS * LANES <= c1 && c + CHAINS * LANES <= K; c += CHAINS * LANES)
    for (int h = 0; h < CHAINS; ++h) {
      if (h == 0) prefetch_ahead(row + c * eb, pf);
      load16_avx2(WT, row + (c + h * LANES) * eb, wlo, whi);
      lo[h] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(x + c + h * LANES), lo[h]);
      hi[h] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(x + c + h * LANES + 8), hi[h]);
    }
  for (int h = 0; h < CHAINS; ++h) {
    const int64_t cc = c + h * LANES;
    if (cc >= c1) break;
    if (cc + LANES <= K) load16_avx2(WT, row + cc * eb, wlo, whi);
    else load16_tail_avx2(WT, row + cc * eb, K - cc, wlo, whi);
    lo[h] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(x + cc), lo[h]);
    hi[h] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(x + cc + 8), hi[h]);
  }
}

// R rows of one expert for one pair, as rows_together_avx512 (ROWS_IN_FLIGHT), in two 8-lane halves.
template <int64_t WT, int R>
AVX2_TARGET inline void rows_together_avx2(const uint8_t* m, int64_t row_bytes, const float* x, int64_t K,
                                           int64_t Kr, float* out, Prefetch pf) {
  constexpr int64_t eb = WT == F32 ? 4 : 2;
  __m256 lo[R][CHAINS], hi[R][CHAINS], wlo, whi;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < CHAINS; ++h) lo[r][h] = hi[r][h] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + CHAINS * LANES <= K; c += CHAINS * LANES)
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = m + r * row_bytes + c * eb;
      prefetch_ahead(p, pf);
      for (int h = 0; h < CHAINS; ++h) {
        load16_avx2(WT, p + h * LANES * eb, wlo, whi);
        lo[r][h] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(x + c + h * LANES), lo[r][h]);
        hi[r][h] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(x + c + h * LANES + 8), hi[r][h]);
      }
    }
  for (int h = 0; h < CHAINS; ++h) {
    const int64_t cc = c + h * LANES;
    if (cc >= Kr) break;
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = m + r * row_bytes + cc * eb;
      if (cc + LANES <= K) load16_avx2(WT, p, wlo, whi);
      else load16_tail_avx2(WT, p, K - cc, wlo, whi);
      lo[r][h] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(x + cc), lo[r][h]);
      hi[r][h] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(x + cc + 8), hi[r][h]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce_avx2(combine_avx2(lo[r]), combine_avx2(hi[r]));
}

// Rows [o0, o1) of expert e (its matrix at m) for the pairs `toks` (each row read once for all of them).
template <int64_t WT>
AVX2_TARGET void rows_avx2_t(const Job& j, int64_t e, const uint8_t* m, int64_t o0, int64_t o1, const int64_t* toks,
                             int64_t nt) {
  const int64_t row_bytes = WT == MXFP4 ? j.K / 2 : j.K * elem_bytes(WT);
  const int64_t Kr = (j.K + LANES - 1) / LANES * LANES;
  int64_t first = o0;
  if constexpr (WT != MXFP4 && WT != FP8)
    first = rows_in_flight<WT>(j, m, o0, o1, toks, nt, [&](auto rows, const uint8_t* at, int64_t rb, const float* xs,
                                                           float* out) {
      rows_together_avx2<WT, decltype(rows)::value>(at, rb, xs, j.K, Kr, out, j.pf);
    });
  for (int64_t o = first; o < o1; ++o) {
    const uint8_t* row = m + o * row_bytes;
    for (int64_t t = 0; t < nt; ++t) {
      const float* x = j.x + toks[t] * j.Kp;
      __m256 lo[CHAINS], hi[CHAINS];
      for (int h = 0; h < CHAINS; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
      if constexpr (WT == MXFP4) {
        const int64_t G = j.K / 32;
        const uint8_t* sc = j.mx_scales + (e * j.O + o) * G;
        for (int64_t g0 = 0; g0 < G; g0 += CHAINS)
          for (int h = 0; h < CHAINS; ++h) {
            const int64_t g = g0 + h;
            if (g >= G) break;
            if (h == 0) prefetch_ahead(row + 16 * g, j.pf);
            __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g));
            __m128i blo = _mm_and_si128(b, _mm_set1_epi8(15));
            __m128i bhi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
            const float* xg = x + 32 * g;
            const __m256 s = _mm256_set1_ps(e8m0(sc[g]));
            __m256 k0 = _mm256_fmadd_ps(fp4_avx2(blo), _mm256_loadu_ps(xg), _mm256_setzero_ps());
            __m256 k1 = _mm256_fmadd_ps(fp4_avx2(_mm_srli_si128(blo, 8)), _mm256_loadu_ps(xg + 8), _mm256_setzero_ps());
            k0 = _mm256_fmadd_ps(fp4_avx2(bhi), _mm256_loadu_ps(xg + 16), k0);
            k1 = _mm256_fmadd_ps(fp4_avx2(_mm_srli_si128(bhi, 8)), _mm256_loadu_ps(xg + 24), k1);
            lo[h] = _mm256_fmadd_ps(k0, s, lo[h]);
            hi[h] = _mm256_fmadd_ps(k1, s, hi[h]);
          }
      } else if constexpr (WT == FP8) {
        const float* sc = j.scales + e * j.sc_expert + static_cast<int64_t>(j.row_block[o]) * j.sc_row;
        for (int64_t b0 = 0, nb = 0; b0 < j.K; b0 += j.bk, ++nb) {
          __m256 klo[CHAINS], khi[CHAINS];
          for (int h = 0; h < CHAINS; ++h) klo[h] = khi[h] = _mm256_setzero_ps();
          chunks_avx2<FP8>(row, x, j.K, b0, std::min(b0 + j.bk, Kr), klo, khi, j.pf);
          const __m256 s = _mm256_set1_ps(sc[nb] * 256.0f);
          lo[0] = _mm256_fmadd_ps(combine_avx2(klo), s, lo[0]);
          hi[0] = _mm256_fmadd_ps(combine_avx2(khi), s, hi[0]);
        }
        j.out[toks[t] * j.O + o] = reduce_avx2(lo[0], hi[0]);
        continue;
      } else {
        chunks_avx2<WT>(row, x, j.K, 0, Kr, lo, hi, j.pf);
      }
      j.out[toks[t] * j.O + o] = reduce_avx2(combine_avx2(lo), combine_avx2(hi));
    }
  }
}

void rows_avx2(const Job& j, int64_t e, const uint8_t* m, int64_t o0, int64_t o1, const int64_t* toks, int64_t nt) {
  by_wtype(j.wtype, [&](auto wt) { rows_avx2_t<decltype(wt)::value>(j, e, m, o0, o1, toks, nt); });
}

// Transposed: the tile's columns [o0, o1) of every row i in turn, each row's span read contiguously, the
// accumulators in an L1-resident array updated in order of i as the definition says (gpt-oss's [E, H, 2I] bf16
// layer: 12.8 ms at one thread with 64-column tiles, 11.3 ms with 4096; AVX-512 applies four rows per pass).
template <int64_t WT>
AVX2_TARGET void cols_avx2_t(const Job& j, const uint8_t* m, const float* x, int64_t o0, int64_t o1, float* out) {
  constexpr int64_t eb = WT == F32 ? 4 : 2;
  const int64_t n = (o1 - o0) / LANES;
  alignas(64) float acc[COL_TILE];
  std::memset(acc, 0, sizeof(float) * n * LANES);
  __m256 wlo, whi;
  for (int64_t i = 0; i < j.K; ++i) {
    const __m256 xi = _mm256_set1_ps(x[i]);
    const uint8_t* p = m + (i * j.O + o0) * eb;
    for (int64_t v = 0; v < n; ++v) {
      load16_avx2(WT, p + v * LANES * eb, wlo, whi);
      _mm256_store_ps(acc + v * LANES, _mm256_fmadd_ps(wlo, xi, _mm256_load_ps(acc + v * LANES)));
      _mm256_store_ps(acc + v * LANES + 8, _mm256_fmadd_ps(whi, xi, _mm256_load_ps(acc + v * LANES + 8)));
    }
  }
  std::memcpy(out + o0, acc, sizeof(float) * n * LANES);
  if (o0 + n * LANES < o1) cols_portable(j, m, x, o0 + n * LANES, o1, out);
}

void cols_avx2(const Job& j, const uint8_t* m, const float* x, int64_t o0, int64_t o1, float* out) {
  switch (j.wtype) {
    case F32: cols_avx2_t<F32>(j, m, x, o0, o1, out); break;
    case BF16: cols_avx2_t<BF16>(j, m, x, o0, o1, out); break;
    default: cols_avx2_t<F16>(j, m, x, o0, o1, out);
  }
}

// ---- AVX-512 (F, BW, VL) -----------------------------------------------------------------------------------------

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

AVX512_TARGET inline __m512 load16_avx512(int64_t wtype, const uint8_t* p) {
  switch (wtype) {
    case F32: return _mm512_loadu_ps(p);
    case BF16: return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    case F16: return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    default: {
      __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                  _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
      return _mm512_cvtph_ps(h);
    }
  }
}

AVX512_TARGET inline __m512 load16_tail_avx512(int64_t wtype, const uint8_t* p, int64_t n) {
  alignas(64) uint8_t tmp[64] = {0};
  std::memcpy(tmp, p, n * elem_bytes(wtype));
  return load16_avx512(wtype, tmp);
}

AVX512_TARGET inline float reduce_avx512(__m512 a) {
  alignas(64) float v[16];
  _mm512_store_ps(v, a);
  return reduce16(v);
}

AVX512_TARGET inline __m512 combine_avx512(const __m512* a) {   // combine_chains, in registers
  if constexpr (CHAINS == 1) return a[0];
  else if constexpr (CHAINS == 2) return _mm512_add_ps(a[0], a[1]);
  else return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
}

// Chunks [c0, c1) of one row into the chains, as chunks_avx2. One row at a time: interleaving rows (four chains of
// four rows) measured 1.7x slower here than one row's chains.
template <int64_t WT>
AVX512_TARGET inline void chunks_avx512(const uint8_t* row, const float* x, int64_t K, int64_t c0, int64_t c1,
                                        __m512* acc, Prefetch pf) {
  constexpr int64_t eb = WT == F32 ? 4 : (WT == FP8 ? 1 : 2);
  int64_t c = c0;
  if constexpr (WT == FP8 && CHAINS == 2) {
    // 32 e4m3 values decoded at once (chunks n, n + 1 -> chains 0, 1): half the instructions of two load16s
    const __m512i m = _mm512_set1_epi16(0x4000);
    for (; c + 2 * LANES <= c1 && c + 2 * LANES <= K; c += 2 * LANES) {
      prefetch_ahead(row + c, pf);
      __m512i v = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c))), 7);
      v = _mm512_add_epi16(v, _mm512_and_si512(v, m));   // the sign, shifted to bit 14, carried on to bit 15
      acc[0] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(v)), _mm512_loadu_ps(x + c), acc[0]);
      acc[1] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)), _mm512_loadu_ps(x + c + LANES), acc[1]);
    }
  }
  for (; c + CHAINS * LANES <= c1 && c + CHAINS * LANES <= K; c += CHAINS * LANES) {
    prefetch_ahead(row + c * eb, pf);
    for (int h = 0; h < CHAINS; ++h)
      acc[h] = _mm512_fmadd_ps(load16_avx512(WT, row + (c + h * LANES) * eb), _mm512_loadu_ps(x + c + h * LANES), acc[h]);
  }
  for (int h = 0; h < CHAINS; ++h) {
    const int64_t cc = c + h * LANES;
    if (cc >= c1) break;
    const __m512 w = cc + LANES <= K ? load16_avx512(WT, row + cc * eb) : load16_tail_avx512(WT, row + cc * eb, K - cc);
    acc[h] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + cc), acc[h]);
  }
}

// R rows of one expert (row_bytes apart) for one pair, chunk by chunk: each row's chains, order and reduction exactly
// chunks_avx512's over [0, Kr) (ROWS_IN_FLIGHT), the R rows' loads in flight together; x's chunks loaded once.
template <int64_t WT, int R>
AVX512_TARGET inline void rows_together_avx512(const uint8_t* m, int64_t row_bytes, const float* x, int64_t K,
                                               int64_t Kr, float* out, Prefetch pf) {
  constexpr int64_t eb = WT == F32 ? 4 : 2;
  __m512 acc[R][CHAINS];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < CHAINS; ++h) acc[r][h] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + CHAINS * LANES <= K; c += CHAINS * LANES) {
    __m512 xv[CHAINS];
    for (int h = 0; h < CHAINS; ++h) xv[h] = _mm512_loadu_ps(x + c + h * LANES);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = m + r * row_bytes + c * eb;
      prefetch_ahead(p, pf);
      for (int h = 0; h < CHAINS; ++h) acc[r][h] = _mm512_fmadd_ps(load16_avx512(WT, p + h * LANES * eb), xv[h], acc[r][h]);
    }
  }
  for (int h = 0; h < CHAINS; ++h) {
    const int64_t cc = c + h * LANES;
    if (cc >= Kr) break;
    const __m512 xv = _mm512_loadu_ps(x + cc);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = m + r * row_bytes + cc * eb;
      const __m512 w = cc + LANES <= K ? load16_avx512(WT, p) : load16_tail_avx512(WT, p, K - cc);
      acc[r][h] = _mm512_fmadd_ps(w, xv, acc[r][h]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce_avx512(combine_avx512(acc[r]));
}

template <int64_t WT>
AVX512_TARGET void rows_avx512_t(const Job& j, int64_t e, const uint8_t* m, int64_t o0, int64_t o1,
                                 const int64_t* toks, int64_t nt) {
  const int64_t row_bytes = WT == MXFP4 ? j.K / 2 : j.K * elem_bytes(WT);
  const int64_t Kr = (j.K + LANES - 1) / LANES * LANES;
  const __m512 fp4 = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  int64_t first = o0;
  if constexpr (WT != MXFP4 && WT != FP8)
    first = rows_in_flight<WT>(j, m, o0, o1, toks, nt, [&](auto rows, const uint8_t* at, int64_t rb, const float* xs,
                                                           float* out) {
      rows_together_avx512<WT, decltype(rows)::value>(at, rb, xs, j.K, Kr, out, j.pf);
    });
  for (int64_t o = first; o < o1; ++o) {
    const uint8_t* row = m + o * row_bytes;
    for (int64_t t = 0; t < nt; ++t) {
      const float* x = j.x + toks[t] * j.Kp;
      __m512 acc[CHAINS];
      for (int h = 0; h < CHAINS; ++h) acc[h] = _mm512_setzero_ps();
      if constexpr (WT == MXFP4) {
        const int64_t G = j.K / 32;
        const uint8_t* sc = j.mx_scales + (e * j.O + o) * G;
        for (int64_t g0 = 0; g0 < G; g0 += CHAINS)
          for (int h = 0; h < CHAINS; ++h) {
            const int64_t g = g0 + h;
            if (g >= G) break;
            if (h == 0) prefetch_ahead(row + 16 * g, j.pf);
            const __m512 xe = _mm512_loadu_ps(x + 32 * g), xo = _mm512_loadu_ps(x + 32 * g + 16);
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));
            __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)), fp4);
            __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), fp4);
            __m512 k = _mm512_fmadd_ps(hi, xo, _mm512_fmadd_ps(lo, xe, _mm512_setzero_ps()));
            acc[h] = _mm512_fmadd_ps(k, _mm512_set1_ps(e8m0(sc[g])), acc[h]);
          }
      } else if constexpr (WT == FP8) {
        const float* sc = j.scales + e * j.sc_expert + static_cast<int64_t>(j.row_block[o]) * j.sc_row;
        for (int64_t b0 = 0, nb = 0; b0 < j.K; b0 += j.bk, ++nb) {
          __m512 k[CHAINS];
          for (int h = 0; h < CHAINS; ++h) k[h] = _mm512_setzero_ps();
          chunks_avx512<FP8>(row, x, j.K, b0, std::min(b0 + j.bk, Kr), k, j.pf);
          acc[0] = _mm512_fmadd_ps(combine_avx512(k), _mm512_set1_ps(sc[nb] * 256.0f), acc[0]);
        }
        j.out[toks[t] * j.O + o] = reduce_avx512(acc[0]);
        continue;
      } else {
        chunks_avx512<WT>(row, x, j.K, 0, Kr, acc, j.pf);
      }
      j.out[toks[t] * j.O + o] = reduce_avx512(combine_avx512(acc));
    }
  }
}

void rows_avx512(const Job& j, int64_t e, const uint8_t* m, int64_t o0, int64_t o1, const int64_t* toks, int64_t nt) {
  by_wtype(j.wtype, [&](auto wt) { rows_avx512_t<decltype(wt)::value>(j, e, m, o0, o1, toks, nt); });
}

template <int64_t WT>
AVX512_TARGET void cols_avx512_t(const Job& j, const uint8_t* m, const float* x, int64_t o0, int64_t o1, float* out) {
  constexpr int64_t eb = WT == F32 ? 4 : 2;
  const int64_t n = (o1 - o0) / LANES;
  alignas(64) float acc[COL_TILE];
  std::memset(acc, 0, sizeof(float) * n * LANES);
  int64_t i = 0;
  for (; i + 4 <= j.K; i += 4) {   // four rows per pass over the accumulators, each still added in order of i
    const __m512 x0 = _mm512_set1_ps(x[i]), x1 = _mm512_set1_ps(x[i + 1]), x2 = _mm512_set1_ps(x[i + 2]),
                 x3 = _mm512_set1_ps(x[i + 3]);
    const uint8_t* p = m + (i * j.O + o0) * eb;
    const int64_t rs = j.O * eb;
    for (int64_t v = 0; v < n; ++v) {
      const int64_t off = v * LANES * eb;
      __m512 a = _mm512_load_ps(acc + v * LANES);
      a = _mm512_fmadd_ps(load16_avx512(WT, p + off), x0, a);
      a = _mm512_fmadd_ps(load16_avx512(WT, p + rs + off), x1, a);
      a = _mm512_fmadd_ps(load16_avx512(WT, p + 2 * rs + off), x2, a);
      a = _mm512_fmadd_ps(load16_avx512(WT, p + 3 * rs + off), x3, a);
      _mm512_store_ps(acc + v * LANES, a);
    }
  }
  for (; i < j.K; ++i) {
    const __m512 xi = _mm512_set1_ps(x[i]);
    const uint8_t* p = m + (i * j.O + o0) * eb;
    for (int64_t v = 0; v < n; ++v)
      _mm512_store_ps(acc + v * LANES, _mm512_fmadd_ps(load16_avx512(WT, p + v * LANES * eb), xi,
                                                       _mm512_load_ps(acc + v * LANES)));
  }
  std::memcpy(out + o0, acc, sizeof(float) * n * LANES);
  if (o0 + n * LANES < o1) cols_portable(j, m, x, o0 + n * LANES, o1, out);
}

void cols_avx512(const Job& j, const uint8_t* m, const float* x, int64_t o0, int64_t o1, float* out) {
  switch (j.wtype) {
    case F32: cols_avx512_t<F32>(j, m, x, o0, o1, out); break;
    case BF16: cols_avx512_t<BF16>(j, m, x, o0, o1, out); break;
    default: cols_avx512_t<F16>(j, m, x, o0, o1, out);
  }
}

// ---- work items -----------------------------------------------------------------------------------------------------

void run_items(const Job& j, int64_t isa, int64_t begin, int64_t end) {
  for (int64_t it = begin; it < end; ++it) {
    const int64_t grp = it / j.tiles, tile = it % j.tiles;
    const int64_t e = j.group_expert[grp];
    const uint8_t* m = j.group_matrix[grp];
    const int64_t* toks = j.order + j.group_start[grp];
    const int64_t nt = j.group_start[grp + 1] - j.group_start[grp];
    if (!j.transposed) {
      const int64_t o0 = tile * ROW_TILE, o1 = std::min(o0 + ROW_TILE, j.O);
      if (isa == AVX512) rows_avx512(j, e, m, o0, o1, toks, nt);
      else if (isa == AVX2) rows_avx2(j, e, m, o0, o1, toks, nt);
      else {
        const int64_t row_bytes = j.wtype == MXFP4 ? j.K / 2 : j.K * elem_bytes(j.wtype);
        for (int64_t o = o0; o < o1; ++o)
          for (int64_t t = 0; t < nt; ++t)
            j.out[toks[t] * j.O + o] = row_portable(j, m + o * row_bytes, j.x + toks[t] * j.Kp, e, o);
      }
    } else {
      const int64_t o0 = tile * COL_TILE, o1 = std::min(o0 + COL_TILE, j.O);
      for (int64_t t = 0; t < nt; ++t) {
        const float* x = j.x + toks[t] * j.Kp;
        float* out = j.out + toks[t] * j.O;
        if (isa == AVX512) cols_avx512(j, m, x, o0, o1, out);
        else if (isa == AVX2) cols_avx2(j, m, x, o0, o1, out);
        else cols_portable(j, m, x, o0, o1, out);
      }
    }
  }
}

int64_t wtype_of(const at::Tensor& w, int64_t fmt) {
  if (fmt == 1) return FP8;
  if (fmt == 2) return MXFP4;
  switch (w.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    default: TORCH_CHECK(false, "expert_gemv: unsupported weight dtype ", w.scalar_type());
  }
  return F32;
}

}  // namespace

// x: [S, K] float32; w: the stack; ids: [S] int64 expert of each pair; fmt: 0 float (w's dtype), 1 FP8 (w uint8
// bytes [E, O, K], scales float32 [E, R, C], row_block int32 [O], block_k), 2 MXFP4 (w uint8 [E, O, G, 16],
// scales uint8 [E, O, G]); transposed: float stacks held [E, K, O]; isa: 0 portable, 1 AVX2, 2 AVX-512;
// pf_l1, pf_l2: prefetch distances in bytes (0: none), pf_rows: rows in flight; -1: default_prefetch()'s for this CPU;
// more, which: further float stacks of w's dtype and matrix shape, and [S] int64 the stack of each pair (0: w,
// i: more[i - 1]; ids[s] is then its expert in that stack): one call reads experts lying in several stacks.
at::Tensor expert_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, int64_t fmt,
                       const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& row_block,
                       int64_t block_k, bool transposed, int64_t isa, int64_t pf_l1, int64_t pf_l2,
                       int64_t pf_rows, c10::optional<at::TensorList> more, const c10::optional<at::Tensor>& which) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && ids.device().is_cpu(), "expert_gemv: cpu tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "expert_gemv: x must be [S, K] float32");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.size(0) == x.size(0),
              "expert_gemv: ids must be [S] int64");
  TORCH_CHECK(more.has_value() == which.has_value(),
              "expert_gemv: more stacks come with `which`, the stack of each pair");
  std::vector<at::Tensor> stacks{w};
  for (const auto& m : more.value_or(at::TensorList())) {
    TORCH_CHECK(fmt == 0, "expert_gemv: only float stacks are read from several stacks in one call");
    TORCH_CHECK(m.device().is_cpu() && m.scalar_type() == w.scalar_type() && m.dim() == w.dim() &&
                m.sizes().slice(1) == w.sizes().slice(1),
                "expert_gemv: every stack of a call has the first's dtype and matrix shape");
    stacks.push_back(m);
  }
  // Each expert's matrix contiguous; the experts stride(0) elements apart (a contiguous stack, or a view whose
  // experts start at every page of a cache arena: rows may overlap, they are only read).
  for (const auto& st : stacks)
    TORCH_CHECK(st.dim() >= 1 && (st.size(0) <= 1 ? st.is_contiguous() : st.stride(0) > 0 && st[0].is_contiguous()),
                "expert_gemv: each expert of the stack must be contiguous");
  TORCH_CHECK(pf_l1 >= -1 && pf_l1 <= MAX_PREFETCH && pf_l2 >= -1 && pf_l2 <= MAX_PREFETCH,
              "expert_gemv: prefetch distances are -1 (this CPU's default) or 0..", MAX_PREFETCH, " bytes, not ",
              pf_l1, " and ", pf_l2);
  TORCH_CHECK(pf_rows == -1 || pf_rows == 1 || pf_rows == 2 || pf_rows == 4 || pf_rows == 8,
              "expert_gemv: rows in flight are -1 (this CPU's default), 1, 2, 4 or 8, not ", pf_rows);
  const int64_t wtype = wtype_of(w, fmt);
  const int64_t S = x.size(0), E = w.size(0);
  int64_t O, K;
  if (wtype == MXFP4) {
    TORCH_CHECK(w.dim() == 4 && w.size(3) == 16 && w.scalar_type() == at::kByte, "expert_gemv: MXFP4 blocks [E, O, G, 16] uint8");
    O = w.size(1);
    K = w.size(2) * 32;
    TORCH_CHECK(!transposed, "expert_gemv: MXFP4 blocks are read in their stored orientation");
  } else {
    TORCH_CHECK(w.dim() == 3, "expert_gemv: the expert stack must be [E, O, K]");
    O = transposed ? w.size(2) : w.size(1);
    K = transposed ? w.size(1) : w.size(2);
    TORCH_CHECK(wtype != FP8 || !transposed, "expert_gemv: FP8 stacks are read in their stored orientation");
  }
  TORCH_CHECK(x.size(1) == K, "expert_gemv: x has ", x.size(1), " columns, the experts take ", K);
  auto out = at::empty({S, O}, x.options());
  if (S == 0 || O == 0) return out;

  auto ids_c = ids.contiguous();
  const int64_t* idp = ids_c.data_ptr<int64_t>();
  std::vector<int64_t> stack_of(S, 0);
  if (which.has_value()) {
    TORCH_CHECK(which->dim() == 1 && which->scalar_type() == at::kLong && which->size(0) == S && which->is_cpu(),
                "expert_gemv: which must be [S] int64");
    auto wc = which->contiguous();
    std::memcpy(stack_of.data(), wc.data_ptr<int64_t>(), S * sizeof(int64_t));
  }
  const int64_t n = static_cast<int64_t>(stacks.size());
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(stack_of[s] >= 0 && stack_of[s] < n, "expert_gemv: stack ", stack_of[s], " out of range 0..", n - 1);
    const int64_t En = stacks[stack_of[s]].size(0);
    TORCH_CHECK(idp[s] >= 0 && idp[s] < En, "expert_gemv: expert id ", idp[s], " out of range 0..", En - 1);
  }

  // x zero padded to a multiple of 16 (MXFP4: each group of 32 as its 16 even then its 16 odd values)
  const int64_t Kp = (K + LANES - 1) / LANES * LANES;
  auto xc = x.contiguous();
  std::vector<float> xp(static_cast<size_t>(S * Kp), 0.0f);
  const float* xs = xc.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) {
    float* d = xp.data() + s * Kp;
    const float* r = xs + s * K;
    if (wtype == MXFP4)
      for (int64_t g = 0; g < K / 32; ++g)
        for (int l = 0; l < 16; ++l) { d[32 * g + l] = r[32 * g + 2 * l]; d[32 * g + 16 + l] = r[32 * g + 2 * l + 1]; }
    else
      std::memcpy(d, r, K * sizeof(float));
  }

  // pairs grouped by expert, in ascending stack, expert, then pair order
  std::vector<int64_t> order(S);
  for (int64_t s = 0; s < S; ++s) order[s] = s;
  auto key = [&](int64_t s) { return std::make_pair(stack_of[s], idp[s]); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
  std::vector<int64_t> gstart, gexpert;
  std::vector<const uint8_t*> gmatrix;
  for (int64_t i = 0; i < S; ++i)
    if (i == 0 || key(order[i]) != key(order[i - 1])) {
      const at::Tensor& st = stacks[stack_of[order[i]]];
      gstart.push_back(i);
      gexpert.push_back(idp[order[i]]);
      const int64_t at = idp[order[i]] * st.stride(0) * st.element_size();
      gmatrix.push_back(static_cast<const uint8_t*>(st.data_ptr()) + at);
    }
  gstart.push_back(S);
  const int64_t groups = static_cast<int64_t>(gexpert.size());

  Job j{};
  j.wtype = wtype;
  j.O = O; j.K = K; j.transposed = transposed;
  j.x = xp.data(); j.Kp = Kp;
  at::Tensor sc;
  if (wtype == FP8) {
    TORCH_CHECK(scales.has_value() && row_block.has_value(), "expert_gemv: FP8 needs scales and row_block");
    sc = scales->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 3 && sc.size(0) == E, "expert_gemv: FP8 scales [E, R, C] float32");
    TORCH_CHECK(block_k > 0 && block_k % LANES == 0, "expert_gemv: FP8 block columns must be a multiple of 16");
    TORCH_CHECK(sc.size(2) == (K + block_k - 1) / block_k, "expert_gemv: FP8 scales have ", sc.size(2), " column blocks");
    TORCH_CHECK(row_block->scalar_type() == at::kInt && row_block->numel() == O && row_block->is_contiguous(),
                "expert_gemv: row_block [O] int32");
    j.scales = sc.data_ptr<float>();
    j.sc_expert = sc.size(1) * sc.size(2);
    j.sc_row = sc.size(2);
    j.row_block = row_block->data_ptr<int32_t>();
    for (int64_t o = 0; o < O; ++o) TORCH_CHECK(j.row_block[o] >= 0 && j.row_block[o] < sc.size(1), "expert_gemv: row_block out of range");
    j.bk = block_k;
  } else if (wtype == MXFP4) {
    TORCH_CHECK(scales.has_value(), "expert_gemv: MXFP4 needs scales");
    sc = scales->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kByte && sc.dim() == 3 && sc.size(0) == E && sc.size(1) == O &&
                sc.size(2) == K / 32, "expert_gemv: MXFP4 scales [E, O, G] uint8");
    j.mx_scales = sc.data_ptr<uint8_t>();
  }
  j.out = out.data_ptr<float>();
  j.order = order.data();
  j.group_start = gstart.data();
  j.group_expert = gexpert.data();
  j.group_matrix = gmatrix.data();
  j.tiles = transposed ? (O + COL_TILE - 1) / COL_TILE : (O + ROW_TILE - 1) / ROW_TILE;
  const Prefetch cpu = default_prefetch();
  j.pf = Prefetch{pf_l1 < 0 ? cpu.l1 : pf_l1, pf_l2 < 0 ? cpu.l2 : pf_l2, pf_rows < 0 ? cpu.rows : pf_rows};

  const int64_t items = groups * j.tiles;
  at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) { run_items(j, isa, b, e); });
  return out;
}

// What this CPU can run: 2 AVX-512, 1 AVX2, 0 neither.
int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return PORTABLE;
}

// This CPU's read shape: [l1, l2] bytes ahead, rows in flight.
std::vector<int64_t> prefetch_distances() {
  const Prefetch p = default_prefetch();
  return {p.l1, p.l2, p.rows};
}

TORCH_LIBRARY(moe_offload, m) {
  m.def("expert_gemv(Tensor x, Tensor w, Tensor ids, int fmt, Tensor? scales, Tensor? row_block, int block_k, "
        "bool transposed, int isa, int pf_l1=-1, int pf_l2=-1, int pf_rows=-1, Tensor[]? more=None, "
        "Tensor? which=None) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
  m.def("prefetch_distances() -> int[]", &prefetch_distances);
}

TORCH_LIBRARY_IMPL(moe_offload, CPU, m) { m.impl("expert_gemv", expert_gemv); }
