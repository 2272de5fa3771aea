// A team of threads held for one whole call (llama_decoder_stack at a few rows), and the split loop the linear
// kernels run their output columns through.
//
// Why: a batch-1 decode step of a small model is ~120 linears of 0.2-1 MB each, a few tens of microseconds
// apiece. Each at::parallel_for is an OpenMP fork/join, and a futex wake of the other thread where it sleeps
// (OMP_WAIT_POLICY=PASSIVE, or past libgomp's spin), which costs about what splitting saves on a small layer:
// so the kernels kept such calls on one thread (their grains), and a second thread bought 7% of a decode step
// (docs/benchmarks.md). Inside a team the other threads wait for the next split by spinning on one atomic
// counter for the length of the call; a split then costs a store and a few hundred nanoseconds, and every
// linear uses every thread. Spinning is bounded: after kSpinsBeforeYield pauses a waiting thread yields its
// core on each turn, so a descheduled master (an oversubscribed host) does not leave a core burning.
//
// Only the linears split (split_for); every other kernel the master calls inside the team runs on the
// master alone (at::parallel_for runs its range inline inside an OpenMP region). A split gives each thread one
// contiguous run of the units, as at::parallel_for would: each unit's arithmetic is the same whoever computes
// it, so results are bit for bit those of the per-call path.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Team {
 public:
  // Pauses before a waiting thread starts yielding: ~50-200 us, longer than the master's work between two
  // linears (attention, norms: ~20 us per layer at one row).
  static constexpr int kSpinsBeforeYield = 4096;

  // Called by the master before the first split: the number of threads serving (the master included).
  void set_size(int n) { n_ = n; }
  int size() const { return n_; }

  // Master: f(begin, end) over [0, units) in size() contiguous parts, the master taking part 0; returns once
  // every part is done. An exception in a worker's part is rethrown here.
  template <typename F>
  void split(int64_t units, const F& f) {
    if (n_ <= 1 || units <= 1) {
      if (units > 0) f(0, units);
      return;
    }
    fn_ = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    ctx_ = &f;
    units_ = units;
    done_.store(0, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
    run_part(0);
    wait_until([&] { return done_.load(std::memory_order_acquire) == n_ - 1; });
    if (failed_.exchange(false)) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  // Worker threads (1 .. size() - 1): serve splits until the master calls stop().
  void serve(int tid) {
    int64_t seen = 0;
    for (;;) {
      int64_t now = 0;
      wait_until([&] { return (now = epoch_.load(std::memory_order_acquire)) != seen || stop_.load(std::memory_order_acquire); });
      if (now == seen) return;  // stopped, no split pending
      seen = now;
      if (tid < n_) {
        try {
          run_part(tid);
        } catch (...) {
          if (!failed_.exchange(true)) error_ = std::current_exception();  // the first: the master rethrows it
        }
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  // Master: after its last split.
  void stop() { stop_.store(true, std::memory_order_release); }

 private:
  template <typename P>
  static void wait_until(const P& ready) {
    for (int spins = 0; !ready(); ++spins) {
      if (spins < kSpinsBeforeYield)
        cpu_relax();
      else
        std::this_thread::yield();
    }
  }

  void run_part(int tid) const {
    const int64_t b = units_ * tid / n_, e = units_ * (tid + 1) / n_;
    if (b < e) fn_(ctx_, b, e);
  }

  using Fn = void (*)(const void*, int64_t, int64_t);
  Fn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t units_ = 0;
  int n_ = 1;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> epoch_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
};

// The team the calling thread leads, if any (set by llama_decoder_stack for the length of its call).
inline thread_local Team* current_team = nullptr;

// f(begin, end) over [0, units): split over the calling thread's team when it leads one (every unit count,
// no grain: a split costs little there), else at::parallel_for with `grain`.
template <typename F>
inline void split_for(int64_t units, int64_t grain, const F& f) {
  if (Team* team = current_team)
    team->split(units, f);
  else
    at::parallel_for(0, units, grain, f);
}

// An M x N GEMM's (row block, panel) tasks, in panels of nb output columns. Row blocks have equal sizes of at most
// mc rows: 128 rows as 120 + 8 left one thread with 15/16 of the bf16 GEMM's work (149 against oneDNN's 95 ms
// over SmolLM2's layers); as 64 + 64 the threads' shares are equal.
struct PanelTasks {
  int64_t M, N, nb, panels, rows_per_block, count;
  PanelTasks(int64_t M, int64_t N, int64_t nb, int64_t mc) : M(M), N(N), nb(nb), panels((N + nb - 1) / nb) {
    const int64_t blocks = (M + mc - 1) / mc;
    rows_per_block = (M + blocks - 1) / blocks;
    count = blocks * panels;
  }
  // Task t's first row (that of its first tile).
  int64_t first_row(int64_t t) const { return (t / panels) * rows_per_block; }
  // Task t's rows (its block's; the last block may have fewer) and its panel.
  int64_t block_rows(int64_t t) const { return std::min(M, first_row(t) + rows_per_block) - first_row(t); }
  int64_t panel(int64_t t) const { return t % panels; }
  // Task t's tiles of at most mr rows: f(m, rows, p, n0, ncols) (first row, rows, panel, its first column, its
  // live columns).
  template <typename F>
  void tiles(int64_t t, int64_t mr, const F& f) const {
    const int64_t m0 = first_row(t), m1 = m0 + block_rows(t), p = panel(t);
    for (int64_t m = m0; m < m1; m += mr) f(m, std::min(mr, m1 - m), p, p * nb, std::min(nb, N - p * nb));
  }
  // The same rows in as few tiles of at most mr rows, of heights differing by one at most (32 rows of 6-row tiles:
  // 5, 5, 6, 5, 5, 6, not 6 x 5 + 2, whose 2-row tile reads the weights as often for a third of the products).
  template <typename F>
  void even_tiles(int64_t t, int64_t mr, const F& f) const {
    const int64_t m0 = first_row(t), n = block_rows(t), count = (n + mr - 1) / mr, p = panel(t);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t a = n * i / count, b = n * (i + 1) / count;
      f(m0 + a, b - a, p, p * nb, std::min(nb, N - p * nb));
    }
  }
};

// Every tile of those tasks through split_for: f as PanelTasks::tiles calls it.
template <typename F>
inline void for_panel_tiles(int64_t M, int64_t N, int64_t nb, int64_t mc, int64_t mr, const F& f) {
  const PanelTasks tasks(M, N, nb, mc);
  split_for(tasks.count, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) tasks.tiles(t, mr, f);
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
