// deepsolve's host (CPU) allocator for PyTorch: live-byte counters and a budget-bounded cache
// of large blocks.  Built on first use by deepsolve/memory/hostalloc.py (see its docstring
// for the design and the measurements behind it) and installed as PyTorch's CPU allocator.
//
// Every CPU tensor allocation goes through `allocate`:
//
//  * small blocks (< big_from bytes) and, outside a budget, all blocks come from the C
//    library's malloc, 64-byte aligned as PyTorch's default allocator aligns them: malloc
//    of the request plus 64 bytes, the tensor at the first 64-byte boundary 16 bytes or
//    more into the block, the block's address and its counted size stored in the 16 bytes
//    before the tensor.  `live` counts the chunk malloc carves for the request (the request,
//    the 64 bytes, the header, the 16-byte granule: see `nominal`).  Plain malloc rather
//    than posix_memalign, whose chunks' sizes depend on the address they land at (the
//    alignment's leftovers).
//  * under a budget (`limit >= 0`), blocks of big_from bytes and more are whole pages mapped
//    with mmap; a freed one is kept in a cache, keyed by its size, as long as the bytes live
//    plus the bytes cached stay within `limit`, and handed out again to the next request of
//    its size class (up to 1/4 larger).  So the resident memory of large tensors never
//    exceeds `limit` while the tensors live do not, and a step that frees and allocates the
//    same sizes at every step reuses warm pages instead of having the kernel zero-fill fresh
//    ones (what glibc's fixed mmap threshold costs).
//
// `live` and `peak` are the CPU counterpart of CUDA's memory_allocated/max_memory_allocated.
// Allocation and free events are still reported to PyTorch's profiler as the default
// allocator reports them.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <malloc.h>
#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;

struct State {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::mutex mu;                                  // guards everything below
  std::map<size_t, std::vector<void*>> cache;     // size class -> free mapped blocks (LIFO)
  std::unordered_map<void*, size_t> big;          // mapped block -> size class
  int64_t cached = 0;                             // bytes in the cache
  std::atomic<int64_t> mapped{0};                 // bytes of mapped blocks handed out
  int64_t limit = -1;                             // < 0: no budget (no mapping, no cache)
  size_t big_from = 64 * 1024;
  int64_t hits = 0, misses = 0, evictions = 0;
};

// never destroyed: tensors may be freed during interpreter shutdown, after static destructors
State& S() {
  static State* s = new State();
  return *s;
}

void count(int64_t delta) {
  State& s = S();
  int64_t now = s.live.fetch_add(delta, std::memory_order_relaxed) + delta;
  int64_t p = s.peak.load(std::memory_order_relaxed);
  while (now > p && !s.peak.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
  }
}

// what a small block counts: the request, the 64-byte prefix and malloc's chunk header,
// rounded to malloc's 16-byte granule — the size of the chunk malloc carves for it, not the
// chunk it happens to hand out (which can be up to 31 bytes larger when the free chunk it
// splits has no room for a remainder: that depends on the heap's history, so the same
// tensor would count differently in two processes)
inline int64_t nominal(size_t n) { return static_cast<int64_t>((n + 64 + 8 + 15) & ~size_t{15}); }

void free_small(void* p) {
  if (p == nullptr) return;
  c10::profiledCPUMemoryReporter().Delete(p);
  void* block = *(reinterpret_cast<void**>(p) - 1);
  count(-*(reinterpret_cast<int64_t*>(p) - 2));
  std::free(block);
}

c10::DataPtr allocate_small(size_t n) {
  void* block = std::malloc(n + 64);
  if (block == nullptr) {  // PyTorch's own message for an allocation that fails
    void* q = c10::alloc_cpu(n + 64);  // throws
    block = q;
  }
  auto addr = reinterpret_cast<uintptr_t>(block);
  void* p = reinterpret_cast<void*>((addr + 16 + 63) & ~static_cast<uintptr_t>(63));
  *(reinterpret_cast<void**>(p) - 1) = block;
  int64_t counted = nominal(n);
  *(reinterpret_cast<int64_t*>(p) - 2) = counted;
  count(counted);
  c10::profiledCPUMemoryReporter().New(p, n);
  return {p, p, &free_small, c10::Device(c10::DeviceType::CPU)};
}

// drop cached blocks (largest first) until live + cached + need <= limit; called locked
void evict_locked(State& s, int64_t need, std::vector<std::pair<void*, size_t>>& out) {
  while (s.cached > 0 && s.live.load() + s.cached + need > s.limit) {
    auto it = s.cache.rbegin();
    while (it != s.cache.rend() && it->second.empty()) ++it;
    if (it == s.cache.rend()) break;
    out.emplace_back(it->second.back(), it->first);
    it->second.pop_back();
    s.cached -= static_cast<int64_t>(it->first);
    ++s.evictions;
  }
}

void unmap(std::vector<std::pair<void*, size_t>>& blocks) {
  for (auto& b : blocks) munmap(b.first, b.second);
}

void free_big(void* p) {
  if (p == nullptr) return;
  c10::profiledCPUMemoryReporter().Delete(p);
  State& s = S();
  size_t cls;
  std::vector<std::pair<void*, size_t>> drop;
  {
    std::lock_guard<std::mutex> g(s.mu);
    auto it = s.big.find(p);
    cls = it->second;
    s.big.erase(it);
    count(-static_cast<int64_t>(cls));
    s.mapped.fetch_sub(static_cast<int64_t>(cls));
    if (s.limit >= 0 && s.live.load() + s.cached + static_cast<int64_t>(cls) <= s.limit) {
      s.cache[cls].push_back(p);
      s.cached += static_cast<int64_t>(cls);
      return;
    }
  }
  munmap(p, cls);
}

void free_any(void* p) {  // raw_deleter: either kind
  if (p == nullptr) return;
  bool mapped;
  {
    State& s = S();
    std::lock_guard<std::mutex> g(s.mu);
    mapped = s.big.count(p) != 0;
  }
  if (mapped) {
    free_big(p);
  } else {
    free_small(p);
  }
}

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    State& s = S();
    if (n == 0) return s.base->allocate(0);
    if (s.limit < 0 || n < s.big_from) return allocate_small(n);
    size_t cls = (n + kPage - 1) & ~(kPage - 1);
    void* p = nullptr;
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> g(s.mu);
      auto it = s.cache.lower_bound(cls);
      while (it != s.cache.end() && it->second.empty()) ++it;
      if (it != s.cache.end() && it->first <= cls + cls / 4) {
        p = it->second.back();
        it->second.pop_back();
        cls = it->first;
        s.cached -= static_cast<int64_t>(cls);
        ++s.hits;
      } else {
        ++s.misses;
        evict_locked(s, static_cast<int64_t>(cls), drop);
      }
    }
    unmap(drop);
    if (p == nullptr) {
      p = mmap(nullptr, cls, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return allocate_small(n);  // the C library's turn (or error)
    }
    {
      std::lock_guard<std::mutex> g(s.mu);
      s.big[p] = cls;
      count(static_cast<int64_t>(cls));
      s.mapped.fetch_add(static_cast<int64_t>(cls));
    }
    c10::profiledCPUMemoryReporter().New(p, n);
    return {p, p, &free_big, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_any; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

HostAllocator* instance() {
  static HostAllocator* a = new HostAllocator();
  return a;
}

void atfork_prepare() { S().mu.lock(); }
void atfork_release() { S().mu.unlock(); }

}  // namespace

extern "C" {

// Install as PyTorch's CPU allocator (once); returns 1 when it is the CPU allocator.
int ds_install(void) {
  State& s = S();
  if (s.base == nullptr) {
    s.base = c10::GetCPUAllocator();
    pthread_atfork(&atfork_prepare, &atfork_release, &atfork_release);
    c10::SetCPUAllocator(instance(), 100);
  }
  return c10::GetCPUAllocator() == instance() ? 1 : 0;
}

// The budget: cache while live + cached <= limit; limit < 0 turns mapping and caching off.
// Empties the cache first.
void ds_set_limit(int64_t limit) {
  State& s = S();
  std::vector<std::pair<void*, size_t>> drop;
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.limit = -1;
    evict_locked(s, 0, drop);  // limit -1: everything goes
    s.limit = limit;
  }
  unmap(drop);
}

void ds_set_big_from(uint64_t bytes) { S().big_from = bytes; }

void ds_reset_peak(void) {
  State& s = S();
  s.peak.store(s.live.load());
}

// live, peak, cached, limit, hits, misses, evictions, mapped blocks' bytes
void ds_stats(int64_t* out) {
  State& s = S();
  std::lock_guard<std::mutex> g(s.mu);
  out[0] = s.live.load();
  out[1] = s.peak.load();
  out[2] = s.cached;
  out[3] = s.limit;
  out[4] = s.hits;
  out[5] = s.misses;
  out[6] = s.evictions;
  out[7] = s.mapped.load();
}

int64_t ds_live(void) { return S().live.load(); }
int64_t ds_peak(void) { return S().peak.load(); }
int64_t ds_mapped(void) { return S().mapped.load(); }

}  // extern "C"
