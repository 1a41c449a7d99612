// Parallel loops of the CPU handlers on XLA's intra-op thread pool (the pool that runs XLA's own
// CPU kernels), reached through the FFI context (`.Ctx<ffi::ThreadPool>()`): no thread is
// started per call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxdet {

// The calling thread's floating-point control state (x86 MXCSR: flush-to-zero,
// denormals-are-zero, rounding; aarch64 FPCR). A task puts the caller's state in place for its
// duration, so an element's arithmetic does not depend on which thread computes it.
class FloatControl {
 public:
  static FloatControl current() {
    FloatControl c;
#if defined(__x86_64__) || defined(_M_X64)
    c.bits_ = _mm_getcsr();
#elif defined(__aarch64__)
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(c.bits_));
#endif
    return c;
  }
  void apply() const {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(static_cast<unsigned>(bits_));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(bits_));
#endif
  }

 private:
  uint64_t bits_ = 0;
};

namespace detail {

// Shared by the caller and its tasks. A task may start after the call has returned (the pool is
// busy, or runs tasks late): it then finds no index left and touches nothing but this state,
// which it co-owns.
struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n = 0;
  const void* body = nullptr;  // dereferenced only while indices remain
  void (*call)(const void* body, int64_t i) = nullptr;
  FloatControl float_control;
  std::mutex mu;
  std::condition_variable finished;

  void work() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      call(body, i);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

}  // namespace detail

// Calls body(i) exactly once for every i in [0, n), on the calling thread and on up to
// `workers - 1` tasks of `pool`. Indices are claimed from one shared counter, so which thread
// runs an index never matters to a body whose indices write disjoint outputs. Returns when every
// index has finished. The caller works too and never waits for a task that has not started, so a
// pool that is busy, of size 1, or runs tasks in the caller cannot deadlock it.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t workers, const Body& body) {
  if (n <= 0) return;
  if (workers <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto state = std::make_shared<detail::ParallelState>();
  state->n = n;
  state->body = &body;
  state->call = [](const void* b, int64_t i) { (*static_cast<const Body*>(b))(i); };
  state->float_control = FloatControl::current();
  for (int64_t t = 1; t < workers; ++t) {
    pool.Schedule([state]() {
      const FloatControl saved = FloatControl::current();
      state->float_control.apply();
      state->work();
      saved.apply();
    });
  }
  state->work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->finished.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace jaxdet
