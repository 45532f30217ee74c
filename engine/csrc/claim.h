// Work items handed out one at a time to whichever thread is free first. A static split gives each
// thread a fixed share, and the first to finish waits for the other at the end of the region:
// long when the items differ in cost, or when a thread starts late or loses its core for a while
// to another process on the same cores (the API process, the disk writers).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvgate {

// The shared counter: claim() returns the next unclaimed item of [0, n), or -1 once none is
// left (items go out in order); left() how many are unclaimed now.
class Claims {
 public:
  explicit Claims(int64_t n) : n_(n) {}
  int64_t operator()() {
    const int64_t item = next_.fetch_add(1, std::memory_order_relaxed);
    return item < n_ ? item : -1;
  }
  int64_t left() const { return std::max<int64_t>(0, n_ - next_.load(std::memory_order_relaxed)); }

 private:
  const int64_t n_;
  std::atomic<int64_t> next_{0};
};

// Calls worker(claims) once on each of up to min(n, threads) threads, all sharing one Claims.
template <typename Worker>
void parallel_claim(int64_t n, const Worker& worker) {
  if (n <= 0) return;
  Claims claims(n);
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) { worker(claims); });
}

}  // namespace kvgate
