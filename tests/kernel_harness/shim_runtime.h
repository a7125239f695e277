// Runtime for running GPU kernel source on the CPU: one OS thread per lane,
// threadgroups one at a time, barriers with a timeout and a call-site check so
// divergent control flow fails loudly instead of hanging or silently passing.
// Used by msl_shim.h (Metal) and cuda_shim.h (CUDA); see emulator.py.
//
// This is the part kernel code sees (lane context, threadgroup arrays, SIMD
// exchange), kept to light headers because every kernel binary compiles it.
// The barriers, the threadgroup-memory registry and the driver (threads,
// input/output files) are in shim_driver.cpp, compiled once per sanitizer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>

namespace shim {

constexpr int kSimdWidth = 32;
constexpr int kExitDivergence = 86;
constexpr int kExitTimeout = 87;
constexpr int kExitUsage = 88;
constexpr int kExitMemOrder = 89;

// Print "SHIM ERROR: ..." and exit with `code`. One report: the first failing
// thread holds a lock until the process exits.
[[noreturn]] void fail(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Counting barrier with a timeout (shim_driver.cpp). Every arrival names its
// call site and the per-thread count of such calls; all arrivals of one round
// must agree, else the threads diverged.
class Barrier;
void barrier_wait(Barrier& barrier, const char* what, const std::source_location& loc,
                  uint64_t seq, int who);

// bfloat16: fp32's top 16 bits, round-to-nearest-even (as MLX and the GPUs).
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  bf16(float f) : bits(from_float(f)) {}
  bf16(_Float16 h) : bf16(float(h)) {}
  bf16(int i) : bf16(float(i)) {}
  operator float() const {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct SimdGroup {
  Barrier* barrier = nullptr;
  int size = 0;
  // Two sets, used by alternate barrier rounds (see simd_exchange).
  alignas(16) unsigned char slots[2][kSimdWidth][16];
};

// What one lane knows about itself while running the kernel body.
struct ThreadCtx {
  Dim3 grid_threads, group_threads, groups, group_pos, local_pos;
  unsigned local_index = 0, lane = 0, simdgroup = 0, num_simdgroups = 0;
  uint64_t simd_calls = 0, group_calls = 0;
  // Memory-ordering epochs: barriers that order threadgroup memory passed so far
  // in this threadgroup (threadgroup_barrier(mem_threadgroup), __syncthreads) and
  // in this simdgroup (simdgroup_barrier(mem_threadgroup), __syncwarp).
  uint64_t tg_epoch = 0, simd_epoch = 0;
  SimdGroup* simd = nullptr;
  Barrier* group_barrier = nullptr;
};

inline thread_local ThreadCtx tctx;

inline ThreadCtx& ctx() {
  return tctx;
}

// Threadgroup memory: registered so it can be poisoned between threadgroups
// and counted against the 32 KiB limit; checked arrays also forget their
// access records (see TgArray). Fills `ptr` with 0xff (NaN for floats, -1 for ints).
bool register_tg(void* ptr, size_t nbytes, void (*reset)(void*) = nullptr,
                 void* owner = nullptr);

// A threadgroup array that checks the memory model: a read must see a write
// of this threadgroup (else it reads uninitialised memory) made by the same
// thread, or ordered before it by a barrier whose flags include
// mem_threadgroup (a simdgroup_barrier orders lanes of one simdgroup only).
// Unordered writes to one element by two threads fail the same way. This is
// what Metal guarantees and the CPU does not need, so a barrier with
// mem_flags::mem_none fails here instead of passing by luck.
template <typename T, long N>
class TgArray {
 public:
  class Ref {
   public:
    Ref(TgArray* a, long i) : a_(a), i_(i) {}
    operator T() const { return a_->load(i_); }
    Ref& operator=(T v) {
      a_->store(i_, v);
      return *this;
    }
    Ref& operator=(const Ref& o) { return *this = T(o); }
    Ref& operator+=(T v) { return *this = T(*this) + v; }
    Ref& operator-=(T v) { return *this = T(*this) - v; }
    Ref& operator*=(T v) { return *this = T(*this) * v; }

   private:
    TgArray* a_;
    long i_;
  };

  explicit TgArray(const char* name) : name_(name) {
    register_tg(data_, sizeof(data_), &TgArray::reset, this);
  }
  Ref operator[](long i) { return Ref(this, i); }

 private:
  // meta: 0 = not written in this threadgroup, else writer + 1 (bits 0-15),
  // its threadgroup epoch (bits 16-39) and simdgroup epoch (bits 40-63).
  static void reset(void* self) {
    for (auto& m : static_cast<TgArray*>(self)->meta_) m.store(0, std::memory_order_relaxed);
  }
  void bounds(long i, const char* what) const {
    if (i < 0 || i >= N) fail(kExitMemOrder, "%s %s[%ld] out of bounds [0, %ld)", what, name_, i, N);
  }
  void ordered(long i, const char* what) const {
    const uint64_t m = meta_[i].load(std::memory_order_relaxed);
    const auto& c = ctx();
    const long me = long(c.local_index);
    if (m == 0) {
      if (std::strcmp(what, "read of") == 0)
        fail(kExitMemOrder, "read of %s[%ld] by thread %ld before any write in this threadgroup",
             name_, i, me);
      return;
    }
    const long writer = long(m & 0xffffu) - 1;
    const uint64_t tg_epoch = (m >> 16) & 0xffffffu, simd_epoch = m >> 40;
    if (writer == me || (c.tg_epoch & 0xffffffu) > tg_epoch) return;
    if (writer / kSimdWidth == me / kSimdWidth && c.simd_epoch > simd_epoch) return;
    fail(kExitMemOrder,
         "%s %s[%ld] by thread %ld races with the write of thread %ld: no barrier with "
         "mem_flags::mem_threadgroup between them",
         what, name_, i, me, writer);
  }
  T load(long i) const {
    bounds(i, "read of");
    ordered(i, "read of");
    return data_[i];
  }
  void store(long i, T v) {
    bounds(i, "write to");
    ordered(i, "write to");
    const auto& c = ctx();
    data_[i] = v;
    meta_[i].store(uint64_t(c.local_index + 1) | ((c.tg_epoch & 0xffffffu) << 16) |
                       (c.simd_epoch << 40),
                   std::memory_order_relaxed);
  }

  const char* name_;
  T data_[N];
  std::atomic<uint64_t> meta_[N] = {};
};

// A threadgroup barrier; `orders_tg`: its flags include mem_threadgroup.
inline void group_barrier(const char* what, const std::source_location& loc,
                          bool orders_tg = true) {
  auto& c = ctx();
  barrier_wait(*c.group_barrier, what, loc, c.group_calls++, int(c.local_index));
  if (orders_tg) ++c.tg_epoch;
}

// All lanes of the simdgroup publish `value`, then each combines the slots.
// One barrier round: round `seq` uses slot set seq % 2, and a lane writes that
// set again only at round seq + 2 or later, after passing round seq + 1, which
// no lane reaches before it has read round seq's slots (the barrier's mutex
// orders it, for TSan too).
template <typename V, typename F>
V simd_exchange(V value, const char* what, const std::source_location& loc, F combine) {
  static_assert(sizeof(V) <= 16, "simd value too large");
  auto& c = ctx();
  SimdGroup& sg = *c.simd;
  const uint64_t seq = c.simd_calls++;
  auto& slots = sg.slots[seq % 2];
  std::memcpy(slots[c.lane], &value, sizeof(V));
  barrier_wait(*sg.barrier, what, loc, seq, int(c.local_index));
  auto slot = [&slots](int lane) {
    V v;
    std::memcpy(&v, slots[lane], sizeof(V));
    return v;
  };
  return combine(slot, sg.size, int(c.lane));
}

inline void simd_sync(const char* what, const std::source_location& loc, bool orders_tg = true) {
  auto& c = ctx();
  barrier_wait(*c.simd->barrier, what, loc, c.simd_calls++, int(c.local_index));
  if (orders_tg) ++c.simd_epoch;
}

// ---- driver (shim_driver.cpp) -------------------------------------------------

using KernelThunk = void (*)(void** buffers);

void register_kernel(const char* name, KernelThunk thunk);

struct KernelRegistrar {
  KernelRegistrar(const char* name, KernelThunk thunk) { register_kernel(name, thunk); }
};

int driver_main(int argc, char** argv);

}  // namespace shim
