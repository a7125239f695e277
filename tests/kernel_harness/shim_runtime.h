// Runtime for running GPU kernel source on the CPU: one OS thread per lane,
// threadgroups one at a time, barriers with a timeout and a call-site check so
// divergent control flow fails loudly instead of hanging or silently passing.
// Used by msl_shim.h (Metal) and cuda_shim.h (CUDA); see emulator.py.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <source_location>
#include <string>
#include <thread>
#include <vector>

namespace shim {

constexpr int kSimdWidth = 32;
constexpr int kExitDivergence = 86;
constexpr int kExitTimeout = 87;
constexpr int kExitUsage = 88;
constexpr int kExitMemOrder = 89;

[[noreturn]] inline void fail(int code, const char* fmt, ...) {
  // One report: the first failing thread holds the lock until the process exits.
  static std::mutex first;
  first.lock();
  va_list args;
  va_start(args, fmt);
  std::fputs("SHIM ERROR: ", stderr);
  std::vfprintf(stderr, fmt, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::fflush(stderr);
  std::_Exit(code);
}

inline std::chrono::milliseconds barrier_timeout() {
  const char* env = std::getenv("SHIM_BARRIER_TIMEOUT_MS");
  return std::chrono::milliseconds(env ? std::atol(env) : 30000);
}

// Counting barrier (mutex + condvar, which also gives TSan its edges). Every
// arrival names its call site and the per-thread count of such calls; all
// arrivals of one round must agree, else the threads diverged.
class Barrier {
 public:
  void reset(const char* label, int participants) {
    std::lock_guard<std::mutex> lock(mutex_);
    label_ = label;
    participants_ = participants;
    arrived_ = 0;
  }

  void wait(const char* what, const std::source_location& loc, uint64_t seq, int who) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (arrived_ == 0) {
      what_ = what;
      line_ = loc.line();
      seq_ = seq;
      first_ = who;
    } else if (line_ != loc.line() || seq_ != seq || std::strcmp(what_, what) != 0) {
      fail(kExitDivergence,
           "divergence at %s barrier: thread %d reached %s at line %u (call #%llu) "
           "while thread %d waits in %s at line %u (call #%llu)",
           label_, who, what, loc.line(), (unsigned long long)seq, first_, what_, line_,
           (unsigned long long)seq_);
    }
    if (++arrived_ == participants_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const uint64_t gen = generation_;
    if (!cv_.wait_for(lock, barrier_timeout(), [&] { return generation_ != gen; })) {
      fail(kExitTimeout,
           "timeout at %s barrier: %d of %d threads arrived, first in %s at line %u "
           "(divergent barrier or early return?)",
           label_, arrived_, participants_, what_, line_);
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const char* label_ = "";
  const char* what_ = "";
  unsigned line_ = 0;
  uint64_t seq_ = 0;
  int first_ = -1;
  int participants_ = 0;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

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
  Barrier barrier;
  int size = 0;
  alignas(16) unsigned char slots[kSimdWidth][16];
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
// access records (see TgArray).
struct TgRegistry {
  std::mutex mutex;
  std::vector<std::pair<void*, size_t>> arrays;
  std::vector<void (*)(void*)> resets;
  std::vector<void*> owners;
  size_t bytes = 0;
};

inline TgRegistry& tg_registry() {
  static TgRegistry registry;
  return registry;
}

inline bool register_tg(void* ptr, size_t nbytes, void (*reset)(void*) = nullptr,
                        void* owner = nullptr) {
  auto& reg = tg_registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  reg.arrays.emplace_back(ptr, nbytes);
  if (reset) {
    reg.resets.push_back(reset);
    reg.owners.push_back(owner);
  }
  reg.bytes += nbytes;
  std::memset(ptr, 0xff, nbytes);  // NaN for floats, -1 for ints
  return true;
}

inline void poison_tg() {
  auto& reg = tg_registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (auto& [ptr, nbytes] : reg.arrays) std::memset(ptr, 0xff, nbytes);
  for (size_t i = 0; i < reg.resets.size(); ++i) reg.resets[i](reg.owners[i]);
}

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
  c.group_barrier->wait(what, loc, c.group_calls++, int(c.local_index));
  if (orders_tg) ++c.tg_epoch;
}

// All lanes of the simdgroup publish `value`, then each combines the slots.
template <typename V, typename F>
V simd_exchange(V value, const char* what, const std::source_location& loc, F combine) {
  static_assert(sizeof(V) <= 16, "simd value too large");
  auto& c = ctx();
  SimdGroup& sg = *c.simd;
  const uint64_t seq = c.simd_calls++;
  std::memcpy(sg.slots[c.lane], &value, sizeof(V));
  sg.barrier.wait(what, loc, seq, int(c.local_index));
  auto slot = [&sg](int lane) {
    V v;
    std::memcpy(&v, sg.slots[lane], sizeof(V));
    return v;
  };
  V result = combine(slot, sg.size, int(c.lane));
  sg.barrier.wait(what, loc, seq, int(c.local_index));  // slots reusable after this
  return result;
}

inline void simd_sync(const char* what, const std::source_location& loc, bool orders_tg = true) {
  auto& c = ctx();
  c.simd->barrier.wait(what, loc, c.simd_calls++, int(c.local_index));
  if (orders_tg) ++c.simd_epoch;
}

// ---- driver -----------------------------------------------------------------

using KernelThunk = void (*)(void** buffers);

inline std::map<std::string, KernelThunk>& kernels() {
  static std::map<std::string, KernelThunk> table;
  return table;
}

struct KernelRegistrar {
  KernelRegistrar(const char* name, KernelThunk thunk) { kernels()[name] = thunk; }
};

struct Buffer {
  int is_output = 0;
  std::vector<unsigned char> host;  // file contents
  void* device = nullptr;           // exact-size heap copy so ASan sees overruns
  size_t nbytes = 0;
};

inline void read_exact(std::FILE* f, void* dst, size_t n) {
  if (n && std::fread(dst, 1, n, f) != n) fail(kExitUsage, "truncated input file");
}

// Input file: "KVEM" u32 version, u32 name_len, name, i32 grid[3], i32 group[3],
// i32 num_buffers, then per buffer: i32 is_output, i64 nbytes, bytes (inputs).
// Output file: the output buffers' bytes in order.
inline int driver_main(int argc, char** argv) {
  if (argc != 3) fail(kExitUsage, "usage: %s INPUT OUTPUT", argv[0]);
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) fail(kExitUsage, "cannot open %s", argv[1]);
  char magic[4];
  uint32_t version = 0, name_len = 0;
  read_exact(in, magic, 4);
  read_exact(in, &version, 4);
  if (std::memcmp(magic, "KVEM", 4) != 0 || version != 1) fail(kExitUsage, "bad input file");
  read_exact(in, &name_len, 4);
  std::string name(name_len, '\0');
  read_exact(in, name.data(), name_len);
  int32_t grid[3], group[3], num_buffers = 0;
  read_exact(in, grid, sizeof(grid));
  read_exact(in, group, sizeof(group));
  read_exact(in, &num_buffers, 4);
  std::vector<Buffer> buffers(num_buffers);
  std::vector<void*> pointers(num_buffers);
  for (int i = 0; i < num_buffers; ++i) {
    int64_t nbytes = 0;
    read_exact(in, &buffers[i].is_output, 4);
    read_exact(in, &nbytes, 8);
    buffers[i].nbytes = size_t(nbytes);
    buffers[i].device = std::malloc(nbytes > 0 ? nbytes : 1);
    if (buffers[i].is_output) {
      std::memset(buffers[i].device, 0xff, buffers[i].nbytes);  // unwritten -> NaN
    } else {
      read_exact(in, buffers[i].device, buffers[i].nbytes);
    }
    pointers[i] = buffers[i].device;
  }
  std::fclose(in);
  auto it = kernels().find(name);
  if (it == kernels().end()) fail(kExitUsage, "kernel %s not in this binary", name.c_str());
  KernelThunk thunk = it->second;

  Dim3 tg{unsigned(group[0]), unsigned(group[1]), unsigned(group[2])};
  Dim3 gt{unsigned(grid[0]), unsigned(grid[1]), unsigned(grid[2])};
  // dispatchThreads: ceil(grid / group) groups, partial groups at the edges.
  Dim3 ng{(gt.x + tg.x - 1) / tg.x, (gt.y + tg.y - 1) / tg.y, (gt.z + tg.z - 1) / tg.z};
  const int nthreads = int(tg.x * tg.y * tg.z);
  if (nthreads > 1024) fail(kExitUsage, "%d threads per group > 1024", nthreads);
  const int max_sg = (nthreads + kSimdWidth - 1) / kSimdWidth;

  Barrier between_groups;
  between_groups.reset("driver", nthreads);
  Barrier group_barrier;
  std::vector<SimdGroup> simdgroups(max_sg);
  Dim3 active;  // this group's (possibly partial) extent, set by thread 0

  auto setup_group = [&](Dim3 pos) {
    active = {std::min(tg.x, gt.x - pos.x * tg.x), std::min(tg.y, gt.y - pos.y * tg.y),
              std::min(tg.z, gt.z - pos.z * tg.z)};
    const int n = int(active.x * active.y * active.z);
    group_barrier.reset("threadgroup", n);
    for (int s = 0; s < max_sg; ++s) {
      const int size = std::max(0, std::min(kSimdWidth, n - s * kSimdWidth));
      simdgroups[s].size = size;
      simdgroups[s].barrier.reset("simdgroup", size);
    }
    poison_tg();
  };

  auto lane_main = [&](int tid) {
    const auto here = std::source_location::current();
    for (unsigned gz = 0; gz < ng.z; ++gz)
      for (unsigned gy = 0; gy < ng.y; ++gy)
        for (unsigned gx = 0; gx < ng.x; ++gx) {
          if (tid == 0) setup_group({gx, gy, gz});
          between_groups.wait("driver", here, 0, tid);
          // Threads are linearised over the group's actual extent, as Metal does.
          const int n = int(active.x * active.y * active.z);
          if (tid < n) {
            ThreadCtx& c = ctx();
            c.grid_threads = gt;
            c.group_threads = active;
            c.groups = ng;
            c.group_pos = {gx, gy, gz};
            c.local_pos = {tid % active.x, (tid / active.x) % active.y,
                           tid / (active.x * active.y)};
            c.local_index = unsigned(tid);
            c.lane = unsigned(tid % kSimdWidth);
            c.simdgroup = unsigned(tid / kSimdWidth);
            c.num_simdgroups = unsigned((n + kSimdWidth - 1) / kSimdWidth);
            c.simd_calls = c.group_calls = c.tg_epoch = c.simd_epoch = 0;
            c.simd = &simdgroups[c.simdgroup];
            c.group_barrier = &group_barrier;
            thunk(pointers.data());
          }
          between_groups.wait("driver", here, 0, tid);
        }
  };
  std::vector<std::thread> threads;
  threads.reserve(nthreads);
  for (int t = 0; t < nthreads; ++t) threads.emplace_back(lane_main, t);
  for (auto& t : threads) t.join();

  std::FILE* out = std::fopen(argv[2], "wb");
  if (!out) fail(kExitUsage, "cannot open %s", argv[2]);
  for (auto& b : buffers)
    if (b.is_output) std::fwrite(b.device, 1, b.nbytes, out);
  std::fclose(out);
  std::fprintf(stderr, "SHIM_TG_BYTES %zu\n", tg_registry().bytes);
  for (auto& b : buffers) std::free(b.device);
  return 0;
}

}  // namespace shim
