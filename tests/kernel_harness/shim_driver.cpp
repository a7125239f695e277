// The runtime half of the CPU emulator (see shim_runtime.h): barriers, the
// threadgroup-memory registry and the driver that reads a launch, runs one OS
// thread per lane and writes the outputs. Compiled once per sanitizer and
// linked into every kernel binary; emulator.py builds it.
#include "shim_runtime.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shim {

[[noreturn]] void fail(int code, const char* fmt, ...) {
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

static std::chrono::milliseconds barrier_timeout() {
  const char* env = std::getenv("SHIM_BARRIER_TIMEOUT_MS");
  return std::chrono::milliseconds(env ? std::atol(env) : 30000);
}

// Counting barrier (mutex + condvar, which also gives TSan its edges).
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

void barrier_wait(Barrier& barrier, const char* what, const std::source_location& loc,
                  uint64_t seq, int who) {
  barrier.wait(what, loc, seq, who);
}

struct TgRegistry {
  std::mutex mutex;
  std::vector<std::pair<void*, size_t>> arrays;
  std::vector<void (*)(void*)> resets;
  std::vector<void*> owners;
  size_t bytes = 0;
};

static TgRegistry& tg_registry() {
  static TgRegistry registry;
  return registry;
}

bool register_tg(void* ptr, size_t nbytes, void (*reset)(void*), void* owner) {
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

static void poison_tg() {
  auto& reg = tg_registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (auto& [ptr, nbytes] : reg.arrays) std::memset(ptr, 0xff, nbytes);
  for (size_t i = 0; i < reg.resets.size(); ++i) reg.resets[i](reg.owners[i]);
}

// ---- driver -----------------------------------------------------------------

static std::map<std::string, KernelThunk>& kernels() {
  static std::map<std::string, KernelThunk> table;
  return table;
}

void register_kernel(const char* name, KernelThunk thunk) { kernels()[name] = thunk; }

struct Buffer {
  int is_output = 0;
  std::vector<unsigned char> host;  // file contents
  void* device = nullptr;           // exact-size heap copy so ASan sees overruns
  size_t nbytes = 0;
};

static void read_exact(std::FILE* f, void* dst, size_t n) {
  if (n && std::fread(dst, 1, n, f) != n) fail(kExitUsage, "truncated input file");
}

// Input file: "KVEM" u32 version, u32 name_len, name, i32 grid[3], i32 group[3],
// i32 num_buffers, then per buffer: i32 is_output, i64 nbytes, bytes (inputs).
// Output file: the output buffers' bytes in order.
int driver_main(int argc, char** argv) {
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
  std::vector<Barrier> simd_barriers(max_sg);
  std::vector<SimdGroup> simdgroups(max_sg);
  for (int s = 0; s < max_sg; ++s) simdgroups[s].barrier = &simd_barriers[s];
  Dim3 active;  // this group's (possibly partial) extent, set by thread 0

  auto setup_group = [&](Dim3 pos) {
    active = {std::min(tg.x, gt.x - pos.x * tg.x), std::min(tg.y, gt.y - pos.y * tg.y),
              std::min(tg.z, gt.z - pos.z * tg.z)};
    const int n = int(active.x * active.y * active.z);
    group_barrier.reset("threadgroup", n);
    for (int s = 0; s < max_sg; ++s) {
      const int size = std::max(0, std::min(kSimdWidth, n - s * kSimdWidth));
      simdgroups[s].size = size;
      simdgroups[s].barrier->reset("simdgroup", size);
    }
    poison_tg();
  };

  auto lane_main = [&](int tid) {
    const auto here = std::source_location::current();
    for (unsigned gz = 0; gz < ng.z; ++gz)
      for (unsigned gy = 0; gy < ng.y; ++gy)
        for (unsigned gx = 0; gx < ng.x; ++gx) {
          if (tid == 0) setup_group({gx, gy, gz});
          barrier_wait(between_groups, "driver", here, 0, tid);
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
          barrier_wait(between_groups, "driver", here, 0, tid);
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
