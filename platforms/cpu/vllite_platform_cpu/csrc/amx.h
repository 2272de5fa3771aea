// AMX tiles (Intel Sapphire Rapids and later) for the bf16 GEMM (gemm.cpp) and the int8 GEMM (quant.cpp), in the
// avx512_bf16 variant on CPUs that have AMX-TILE, AMX-BF16 and AMX-INT8 and an OS that lets the process use them.
//
// Why: on such a CPU (2 vCPUs of a Xeon, family 6 model 207) one core ran vdpbf16ps at 51 GFLOP/s and
// tdpbf16ps at 567 (a loop of four 16 x 16 x 32 products per two A and two B tiles); over SmolLM2's layers the
// bf16 GEMM on vdpbf16ps did 106-134 GFLOP/s at 2,048 rows against oneDNN's 611 (docs/benchmarks.md, 2026-12-05).
//
// The tiles read the GEMMs' own packed panels: both store, per step of k, 32 columns x 4 bytes of k (bf16: 2
// values, int8: 4) in rows of 128 bytes, so a B tile is 16 such rows' first or second 64 bytes (16 columns) and a
// step of 16 rows is 2 KiB of panel; an A tile is 16 rows of x by 64 bytes of k (32 bf16 or 64 int8 values), read
// in place. One tile computes up to 32 rows x one 32-column panel: C tiles 0-3 (rows 0-15 / 16-31 x columns 0-15 /
// 16-31), A tiles 4-5, B tiles 6-7, each A and B tile used twice per step. bf16 (tdpbf16ps): float32 sums, round to
// nearest even, denormals as zero, as vdpbf16ps, in another order of additions. int8 (tdpbusd: unsigned x by
// signed w, as vpdpbusd): exact int32 sums, so the int8 GEMM's results are the same bit for bit on either path.
//
// The instructions are inline assembly (as GCC's own AMX intrinsics are), so nothing needs -mamx-* flags and the
// variant keeps running on CPUs without AMX: amx_on() gates every use. Linux hands the 8 KiB of tile state to a
// process only on request (arch_prctl ARCH_REQ_XCOMP_PERM), made once by the probe (amx.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "team.h"

#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define VLLITE_AMX 1
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

bool amx_on();  // AMX available here and not turned off (set_amx)

#ifdef VLLITE_AMX
namespace amx {
constexpr int64_t NB = 32;            // output columns per panel
constexpr int64_t MR = 32;            // rows per tile: two A tiles of 16
constexpr int64_t kStepBytes = 2048;  // panel bytes per step of k: 16 rows of 128 bytes
constexpr int64_t MC = 256;           // rows per task: a 256-row block of x stays in L2 (K = 1536 bf16: 768 KiB)

// Rows per task for rows of x of `row_bytes` each: MC, fewer (a multiple of MR) where MC rows pass 1 MiB, so a
// task's rows stay in L2 while it runs over the panels. The int8 GEMM's down_proj at Llama-1B's shape (K = 8,192
// quantized bytes a row) at 2,048 rows on an AMX Xeon: 3,198 -> 3,646-3,905 GOP/s at 128 rows a task
// (benchmarks/gemm_shapes.py); each tile still sums over the whole of K, so the results do not change. (The bf16
// GEMM measured 1,451-1,497 -> 1,698-1,760 GFLOP/s at 64 rows; it now blocks K instead: gemm.cpp, kAmxKBlock.)
inline int64_t rows_per_task(int64_t row_bytes) {
  return std::clamp<int64_t>((int64_t{1} << 20) / std::max<int64_t>(row_bytes, 1) / MR * MR, MR, MC);
}

enum class Dot { bf16, int8 };

// This thread's tile configuration for tiles of `rows` rows (1-32), loaded when it changes, and released (the tile
// registers back to their init state, nothing for the OS to save) when the thread's part of a call is done.
// Loaded per part, never cached across calls: oneDNN's AMX kernels load their own on the same threads.
class Tiles {
 public:
  void configure(int64_t rows) {
    if (rows == rows_) return;
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } cfg;
    const uint8_t r0 = static_cast<uint8_t>(std::min<int64_t>(rows, 16)), r1 = static_cast<uint8_t>(rows - r0);
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = r0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = r1;
    cfg.rows[6] = cfg.rows[7] = 16;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
    asm volatile("ldtilecfg %0" ::"m"(cfg));
    rows_ = rows;
  }
  ~Tiles() {
    if (rows_ > 0) asm volatile("tilerelease" ::);
  }

 private:
  int64_t rows_ = 0;
};

// sums[0:rows][0:32] (float32 for bf16, int32 for int8) = A[0:rows] (rows lda bytes apart) times one panel's
// `steps` steps of k, the configuration loaded for `rows`. stream: the panel comes from memory (a task's first
// tile), so each step prefetches the panel two steps ahead into L1; later tiles find it in L2.
void sums(Dot dot, const uint8_t* A, int64_t lda, int64_t rows, const uint8_t* B, int64_t steps, void* sums,
          bool stream);

// f(m, rows, p, n0, ncols, stream) over an M x N GEMM's (row block, panel) tiles of up to 32 rows, split
// over the threads (or the decode step's team) as for_panel_tiles does, each part with its own tile configuration.
template <typename F>
inline void for_tiles(int64_t M, int64_t N, const F& f, int64_t mc = MC) {
  const PanelTasks tasks(M, N, NB, mc);
  split_for(tasks.count, 1, [&](int64_t b, int64_t e) {
    Tiles tiles;
    for (int64_t t = b; t < e; ++t)
      tasks.tiles(t, MR, [&](int64_t m, int64_t rows, int64_t p, int64_t n0, int64_t ncols) {
        tiles.configure(rows);
        f(m, rows, p, n0, ncols, m == tasks.first_row(t));
      });
  });
}
}  // namespace amx
#endif

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
