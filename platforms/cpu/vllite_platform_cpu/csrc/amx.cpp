// The AMX tiles' probe, switch and inner loop (amx.h says why and how).
#include <atomic>

#include "common.h"
// after common.h
#include "amx.h"

#ifdef VLLITE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

#ifdef VLLITE_AMX
namespace amx {
// CPUID leaf 7 EDX bits 22 (AMX-BF16), 24 (AMX-TILE) and 25 (AMX-INT8), and the OS's leave to use the tile data
// (Linux 5.16 and later).
static bool probe() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  constexpr unsigned kAmx = (1u << 22) | (1u << 24) | (1u << 25);
  if ((d & kAmx) != kAmx) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

static bool available() {
  static const bool ok = probe();
  return ok;
}

static std::atomic<bool> enabled{true};

#define VLLITE_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<int64_t>(stride)))
#define VLLITE_TILE_STORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")

template <Dot D>
static void sums_of(const uint8_t* A, int64_t lda, int64_t rows, const uint8_t* B, int64_t steps, void* out,
                    bool stream) {
  constexpr int64_t row = NB * 4, ahead = 2 * kStepBytes;  // bytes per panel row; prefetch distance
  const bool two = rows > 16;
  asm volatile("tilezero %%tmm0\n\ttilezero %%tmm1" ::);
  if (two) asm volatile("tilezero %%tmm2\n\ttilezero %%tmm3" ::);
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* b = B + s * kStepBytes;
    if (stream)
      for (int64_t line = 0; line < kStepBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b) + ahead + line, _MM_HINT_T0);
    VLLITE_TILE_LOAD(6, b, row);
    VLLITE_TILE_LOAD(7, b + 64, row);
    VLLITE_TILE_LOAD(4, A + s * 64, lda);
    if constexpr (D == Dot::bf16)
      asm volatile("tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\ttdpbf16ps %%tmm7, %%tmm4, %%tmm1" ::);
    else
      asm volatile("tdpbusd %%tmm6, %%tmm4, %%tmm0\n\ttdpbusd %%tmm7, %%tmm4, %%tmm1" ::);
    if (two) {
      VLLITE_TILE_LOAD(5, A + 16 * lda + s * 64, lda);
      if constexpr (D == Dot::bf16)
        asm volatile("tdpbf16ps %%tmm6, %%tmm5, %%tmm2\n\ttdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::);
      else
        asm volatile("tdpbusd %%tmm6, %%tmm5, %%tmm2\n\ttdpbusd %%tmm7, %%tmm5, %%tmm3" ::);
    }
  }
  auto* o = static_cast<uint8_t*>(out);  // [32][32] 4-byte sums: rows 128 bytes apart
  VLLITE_TILE_STORE(0, o, row);
  VLLITE_TILE_STORE(1, o + 64, row);
  if (two) {
    VLLITE_TILE_STORE(2, o + 16 * row, row);
    VLLITE_TILE_STORE(3, o + 16 * row + 64, row);
  }
}
#undef VLLITE_TILE_LOAD
#undef VLLITE_TILE_STORE

void sums(Dot dot, const uint8_t* A, int64_t lda, int64_t rows, const uint8_t* B, int64_t steps, void* out,
          bool stream) {
  if (dot == Dot::bf16)
    sums_of<Dot::bf16>(A, lda, rows, B, steps, out, stream);
  else
    sums_of<Dot::int8>(A, lda, rows, B, steps, out, stream);
}
}  // namespace amx
#endif

bool amx_available() {
#ifdef VLLITE_AMX
  return amx::available();
#else
  return false;
#endif
}

// Whether the bf16 and int8 GEMMs (and the GGUF panels that take the bf16 GEMM's tiles) use AMX: on by default
// where available. Returns the state now (off where AMX is not available).
bool set_amx(bool on) {
#ifdef VLLITE_AMX
  amx::enabled.store(on, std::memory_order_relaxed);
#endif
  return amx_on();
}

bool amx_on() {
#ifdef VLLITE_AMX
  return amx::enabled.load(std::memory_order_relaxed) && amx::available();
#else
  return false;
#endif
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
