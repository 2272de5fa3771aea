// An AVX2/FMA host's own ceilings for the GEMMs and the decode step: float32 FMAs (vfmadd231ps ymm) and int8
// multiply-adds (vpmaddubsw + vpmaddwd + vpaddd, AVX2 having no VNNI) one core retires per second in registers,
// and the memory bandwidth every core together gets reading (a decode step's weight stream) and copying.
// Not part of the build:
//
//     g++ -O2 -mavx2 -mfma -fopenmp -o /tmp/isa_peak_avx2 benchmarks/isa_peak_avx2.cpp && /tmp/isa_peak_avx2
//
// bfloat16 has no math on AVX2: a bf16 GEMM widens each weight (one shift) and runs float32 FMAs, so its
// compute ceiling is the float32 one and only its bytes halve. benchmarks/isa_peak.cpp is the AVX-512 version.
// Why: the roofline of a decode step (docs/benchmarks.md) needs this host's measured ceilings, not a datasheet's.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// 12 independent accumulators: more than FMA latency x throughput (4 x 2), so only the issue rate limits.
__attribute__((noinline)) __m256 fma_ymm(int64_t n) {
  __m256 c[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) c[i] = _mm256_set1_ps(float(i));
  __m256 a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(0.9999999f);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) c[i] = _mm256_fmadd_ps(a, c[i], b);
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  for (int i = 1; i < 12; ++i) c[0] = _mm256_add_ps(c[0], c[i]);
  return c[0];
}

// One int8 dot-product step: 32 u8 x s8 products summed in pairs (vpmaddubsw), the pairs summed to int32
// (vpmaddwd with ones), added to the accumulator: 32 multiply-adds per three instructions.
__attribute__((noinline)) __m256i int8_ymm(int64_t n) {
  // Four accumulators, each with its own weight vector (else the compiler computes one product for all).
  __m256i c0 = _mm256_set1_epi32(0), c1 = c0, c2 = c0, c3 = c0;
  __m256i a = _mm256_set1_epi8(3), b0 = _mm256_set1_epi8(5), b1 = _mm256_set1_epi8(6), b2 = _mm256_set1_epi8(7),
          b3 = _mm256_set1_epi8(9), ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < n; ++k) {
    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
    c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
    c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b2), ones));
    c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b3), ones));
    __asm__ volatile("" : "+x"(a), "+x"(b0), "+x"(b1), "+x"(b2), "+x"(b3));
  }
  return _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3));
}

}  // namespace

int main() {
  // Many short runs, the best kept: on a shared host a short run is likelier to hold its core throughout.
  const int64_t n = 2000000;
  const int reps = 200;
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    volatile __m256 sink = fma_ymm(n);
    (void)sink;
    best = std::min(best, seconds_since(t0));
  }
  std::printf("fp32 FMA ymm: %.2f G/s per core = %.1f GFLOP/s per core\n", 12.0 * n / best / 1e9,
              12.0 * n * 16 / best / 1e9);
  best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    volatile __m256i sink = int8_ymm(n);
    (void)sink;
    best = std::min(best, seconds_since(t0));
  }
  std::printf("int8 maddubs+madd+add ymm: %.2f G/s per core = %.1f int8 GOP/s per core (2 per multiply-add)\n",
              4.0 * n / best / 1e9, 4.0 * n * 64 / best / 1e9);

  // Memory: 256 MiB (8x the L3) read (summed, as a GEMV streams its weight) and copied, all threads, best of 20.
  const size_t bytes = size_t(1) << 28, count = bytes / sizeof(float);
  std::vector<float> src(count, 1.0f), dst(count, 0.0f);
  double read_best = 1e30, copy_best = 1e30, total = 0;
  for (int r = 0; r < 20; ++r) {
    auto t0 = Clock::now();
    double s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
    for (int64_t i = 0; i < int64_t(count); i += 8) {
      __m256 v = _mm256_loadu_ps(&src[i]);
      s += v[0];
    }
    total += s;
    read_best = std::min(read_best, seconds_since(t0));
    t0 = Clock::now();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < 64; ++c) {
      const size_t chunk = count / 64;
      std::memcpy(&dst[c * chunk], &src[c * chunk], chunk * sizeof(float));
    }
    copy_best = std::min(copy_best, seconds_since(t0));
  }
  std::printf("memory, %d threads: read %.1f GB/s, copy %.1f GB/s (read + write bytes) [%g]\n", omp_get_max_threads(),
              bytes / read_best / 1e9, 2.0 * bytes / copy_best / 1e9, total + dst[count / 2]);
  return 0;
}
