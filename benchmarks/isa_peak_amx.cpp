// The AMX tiles' own ceiling: how many bf16 (tdpbf16ps) and int8 (tdpbusd) products the cores retire with every
// operand already in the tile registers (four 16 x 16 accumulators, two A and two B tiles: the register blocking of
// csrc/amx.cpp's sums), on one thread and on every core at once. A GEMM's rate read against this says how far its
// loads, not the tiles, limit it (docs/benchmarks.md, the AMX hosts' rooflines). Not part of the build:
//
//     g++ -O2 -mamx-tile -mamx-bf16 -mamx-int8 -pthread -o /tmp/isa_peak_amx benchmarks/isa_peak_amx.cpp
//     /tmp/isa_peak_amx [threads]
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {  // Linux: leave to use the tile data (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// Seconds for n rounds of four tile products (bf16 or int8) on this thread.
double run(bool int8, int64_t n) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local uint8_t zeros[1024] = {};
  _tile_loadd(4, zeros, 64);
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto t0 = std::chrono::steady_clock::now();
  if (int8) {
    for (int64_t i = 0; i < n; ++i) {
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  if (!request_amx()) {
    std::printf("no AMX here (or the OS refused the tile data)\n");
    return 1;
  }
  const int64_t n = 20000000;
  for (const bool int8 : {false, true}) {
    // bf16: 16 x 16 outputs x 32 products a tile op; int8: 16 x 16 x 64. Two operations (multiply, add) each.
    const double ops = 4.0 * n * 16 * 16 * (int8 ? 64 : 32) * 2;
    const double one = ops / run(int8, n) / 1e9;
    std::vector<double> secs(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        request_amx();
        secs[t] = run(int8, n);
      });
    for (auto& t : pool) t.join();
    double all = 0;
    for (double s : secs) all += ops / s / 1e9;
    std::printf("%s: one thread %.0f G%s/s, %d threads %.0f G%s/s in all\n", int8 ? "int8 tdpbusd" : "bf16 tdpbf16ps",
                one, int8 ? "OP" : "FLOP", threads, all, int8 ? "OP" : "FLOP");
  }
  return 0;
}
