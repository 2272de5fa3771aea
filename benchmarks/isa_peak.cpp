// The CPU's own ceilings for the GEMMs: how many vpdpbusd (int8) and vdpbf16ps (bf16) one core retires per
// second, in registers, and what the int8 GEMM's 12 x 32 tile loop (csrc/quant.cpp's tile_sums, restated here)
// reaches with its operands in L1. Not part of the build; one core, no threads:
//
//     g++ -O2 -march=cooperlake -o /tmp/isa_peak benchmarks/isa_peak.cpp && /tmp/isa_peak
//
// (-march=cooperlake: AVX-512 with VNNI and BF16, which GCC 12 knows; any AVX512-BF16 CPU runs it.)
// Why: the ceilings (bf16 850-945 GFLOP/s on 2 Zen 4 cores) assumed two vdpbf16ps per cycle; this prints
// what the host does, so a GEMM's rate can be read as a fraction of it (docs/benchmarks.md, seventh Zen 4 session).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// 16 independent accumulators: more than latency x throughput, so only the issue rate limits.
__attribute__((noinline)) __m512i dpbusd_zmm(int64_t n) {
  __m512i c[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) c[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x01020304);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) c[i] = _mm512_dpbusd_epi32(c[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));  // keeps the loop from being folded
  }
  for (int i = 1; i < 16; ++i) c[0] = _mm512_add_epi32(c[0], c[i]);
  return c[0];
}

__attribute__((noinline)) __m512 dpbf16_zmm(int64_t n) {
  __m512 c[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) c[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  for (int i = 1; i < 16; ++i) c[0] = _mm512_add_ps(c[0], c[i]);
  return c[0];
}

// The int8 GEMM's micro-tile: 12 rows x 32 columns, 24 int32 sums in registers, 4 k per step.
__attribute__((noinline)) void tile12(const uint8_t* __restrict A, int64_t lda, const int8_t* __restrict B, int64_t K4,
                                       int32_t* __restrict acc) {
  __m512i c0[12], c1[12];  // every loop over them unrolled, or they live on the stack
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) c0[r] = c1[r] = _mm512_setzero_si512();
  for (int64_t kk = 0; kk < K4; ++kk) {
    const __m512i b0 = _mm512_loadu_si512(B + kk * 128), b1 = _mm512_loadu_si512(B + kk * 128 + 64);
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) {
      int32_t quad;
      std::memcpy(&quad, A + r * lda + 4 * kk, 4);
      const __m512i a = _mm512_set1_epi32(quad);
      c0[r] = _mm512_dpbusd_epi32(c0[r], a, b0);
      c1[r] = _mm512_dpbusd_epi32(c1[r], a, b1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) {
    _mm512_storeu_si512(acc + 32 * r, c0[r]);
    _mm512_storeu_si512(acc + 32 * r + 16, c1[r]);
  }
}

}  // namespace

int main() {
  const int64_t n = 50'000'000;
  auto t0 = Clock::now();
  volatile __m512i vi = dpbusd_zmm(n);
  double s = seconds_since(t0);
  std::printf("vpdpbusd zmm: %.2f G/s per core = %.0f int8 GOP/s per core\n", 16.0 * n / s / 1e9,
              16.0 * n * 128 / s / 1e9);
  t0 = Clock::now();
  volatile __m512 vf = dpbf16_zmm(n);
  s = seconds_since(t0);
  std::printf("vdpbf16ps zmm: %.2f G/s per core = %.0f bf16 GFLOP/s per core\n", 16.0 * n / s / 1e9,
              16.0 * n * 64 / s / 1e9);
  (void)vi;
  (void)vf;
  // SmolLM2's hidden size: the tile's A and B stay in L1. Read through a volatile: with K a constant GCC 12 makes
  // a copy of tile12 for it and spills the 24 sums in that copy (a third of the rate).
  volatile int64_t hidden = 576;
  const int64_t K = hidden, reps = 200'000;
  std::vector<uint8_t> A(12 * K, 3);
  std::vector<int8_t> B(32 * K, 1);
  alignas(64) int32_t acc[12 * 32];
  t0 = Clock::now();
  for (int64_t i = 0; i < reps; ++i) {
    tile12(A.data(), K, B.data(), K / 4, acc);
    __asm__ volatile("" : : "r"(acc) : "memory");
  }
  s = seconds_since(t0);
  std::printf("int8 tile 12 x 32, K = %lld, in L1: %.0f GOP/s per core\n", static_cast<long long>(K),
              2.0 * 12 * 32 * K * reps / s / 1e9);
  return 0;
}
