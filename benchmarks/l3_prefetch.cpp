// Can a compute-bound phase fetch the next layer's data into L3 for free? Per "layer", 2 threads run a loop of
// vpdpbusd in registers (as a GEMM's tiles would, for ~1.3 ms), optionally prefetching the next layer's buffer
// (MB MiB, split between them, one line every EVERY iterations), then read that buffer. Not part of the build:
//
//     g++ -O2 -march=cooperlake -fopenmp -o /tmp/l3_prefetch benchmarks/l3_prefetch.cpp && /tmp/l3_prefetch 9 2
//
// On Zen 4 (docs/benchmarks.md, seventh Zen 4 session) the prefetched lines stay in L3 (L2's victim cache; the
// read ran at 62-104 GB/s against 27-35 from DRAM), but the prefetches slow the compute loop by 0.06-0.27 ms per
// 9 MB: a decode step's KV fetched this way would cost about what it saves in attention.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// iters steps of 12 independent vpdpbusd; with pf, one line of it prefetched every `every` steps.
__attribute__((noinline)) __m512i compute(int64_t iters, const char* pf, int64_t pf_lines, int64_t every) {
  __m512i c[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) c[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x01020304);
  int64_t line = 0, countdown = every;
  for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) c[i] = _mm512_dpbusd_epi32(c[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
    if (pf && --countdown == 0) {
      countdown = every;
      if (line < pf_lines) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
    }
  }
#pragma GCC unroll 12
  for (int i = 1; i < 12; ++i) c[0] = _mm512_add_epi32(c[0], c[i]);
  return c[0];
}

__attribute__((noinline)) float read_sum(const float* p, int64_t n) {
  __m512 s = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(p + i));
  alignas(64) float lanes[16];  // not _mm512_reduce_add_ps: GCC 12's header warns inside it
  _mm512_store_ps(lanes, s);
  float total = 0;
  for (float v : lanes) total += v;
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mb = argc > 1 ? std::atol(argv[1]) : 9, every = argc > 2 ? std::atol(argv[2]) : 2;
  const int layers = 30;
  const int64_t bytes = mb << 20, iters = 400'000;
  std::vector<float*> bufs;
  for (int l = 0; l < layers; ++l) {
    auto* p = static_cast<float*>(std::aligned_alloc(2 << 20, bytes));
    std::memset(p, 1, bytes);
    bufs.push_back(p);
  }
  volatile float sink = 0;
  for (int prefetch = 0; prefetch < 2; ++prefetch)
    for (int rep = 0; rep < 3; ++rep) {
      double t_compute = 0, t_read = 0;
      for (int l = 0; l < layers; ++l) {
        const auto* next = reinterpret_cast<const char*>(bufs[(l + 1) % layers]);
        auto t0 = Clock::now();
#pragma omp parallel num_threads(2)
        {
          const int64_t half = bytes / 2;
          volatile __m512i r = compute(iters, prefetch ? next + omp_get_thread_num() * half : nullptr, half / 64, every);
          (void)r;
        }
        t_compute += seconds_since(t0);
        t0 = Clock::now();
        float s = 0;
#pragma omp parallel num_threads(2) reduction(+ : s)
        s += read_sum(bufs[(l + 1) % layers] + omp_get_thread_num() * (bytes / 8), bytes / 8);
        t_read += seconds_since(t0);
        sink = sink + s;
      }
      std::printf("%s: compute %.2f ms per layer, then the read %.3f ms (%.1f GB/s)\n",
                  prefetch ? "prefetched" : "plain     ", t_compute / layers * 1e3, t_read / layers * 1e3,
                  bytes / (t_read / layers) / 1e9);
    }
  for (float* p : bufs) std::free(p);
  return 0;
}
