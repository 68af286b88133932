// mlx_bricks MSL emulator: the fiber runtime.
// Over 600 lines on purpose: the scheduler, the SIMD-group collectives and the fault handler
// share this unit's static state and are built once into libemu_runtime.so.
//
// Each threadgroup runs on one OS thread; its GPU threads are cooperative fibers switched by a
// hand-written x86-64 context switch (ucontext elsewhere). Fibers block at threadgroup
// barriers and at SIMD-group collectives; the last participant completes the collective and
// wakes the others. Device buffers and threadgroup memory live in mappings surrounded by
// PROT_NONE pages, so out-of-bounds accesses fault; the fault handler turns the fault into a
// report and abandons the launch. Compiled once into libemu_runtime.so and loaded RTLD_GLOBAL;
// kernels resolve emu_* against it.
#include "emu_abi.h"

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kStackBytes = 256 * 1024;  // per fiber, committed lazily by the kernel
constexpr size_t kGuardBytes = 1 << 20;     // PROT_NONE on each side of a buffer
constexpr int kMaxThreads = 1024;           // Metal's maximum threads per threadgroup
constexpr int kMaxSimd = kMaxThreads / EMU_SIMD_WIDTH;
constexpr size_t kArenaBytes = 4 << 20;
constexpr size_t kTgLimit = 32768;          // Apple GPUs: 32 KiB of threadgroup memory
constexpr int kMaxSlots = 64;
constexpr int kMaxWorkers = 16;
constexpr unsigned char kCanary = 0xCD;

enum FiberState { kReady, kRunning, kAtBarrier, kAtSimd, kDone };

struct Fiber {
  EmuLane lane;  // first member: emu_cur() hands out &fiber.lane
  void* sp;
  int state;
  uint32_t site;
  int completer;
};

struct TgSlot {
  uint32_t slot;
  uint64_t bytes;
  uint32_t elem;
  char* lo;  // writable region
  char* hi;
  char* ptr;
};

struct Buffer {  // a guarded copy of one launch buffer
  char* map = nullptr;
  size_t maplen = 0;
  char* data = nullptr;
  char* rw_lo = nullptr;
  char* rw_hi = nullptr;
  const EmuBuf* desc = nullptr;
};

struct Launch {
  const EmuLaunchDesc* d;
  std::vector<Buffer> bufs;
  std::vector<void*> ptrs;
  uint32_t ngroups[3];
  uint64_t total_groups;
  std::atomic<uint64_t> next{0};
  std::atomic<int> stop{0};
  std::mutex err_mu;
  std::string err;
};

struct Worker {
  char* stacks = nullptr;
  char* altstack = nullptr;
  char* arena = nullptr;
  Fiber fibers[kMaxThreads];
  EmuSimd simds[kMaxSimd];
  uint32_t sg_live[kMaxSimd], sg_arrived[kMaxSimd], sg_barrier[kMaxSimd];
  int runq[kMaxThreads + 1];
  int qh = 0, qt = 0;
  int n = 0, nsg = 0, live = 0, cur = -1;
  int tg_arrived = 0, tg_mixed = 0;
  uint32_t tg_site = 0;
  void* main_sp = nullptr;
  TgSlot slots[kMaxSlots];
  int nslots = 0;
  size_t arena_used = 0, tg_bytes = 0;
  Launch* L = nullptr;
  sigjmp_buf jb;
  volatile sig_atomic_t in_run = 0;
  bool faulted = false;
};

thread_local Worker* tw = nullptr;
Worker* g_workers[kMaxWorkers];
std::mutex g_launch_mu;

// ---------------------------------------------------------------------------------------------
// Context switch. emu_ctx_switch(&save_sp, new_sp): saves callee-saved state on the current
// stack, stores the stack pointer in *save_sp and resumes the context whose stack is new_sp.
#if defined(__x86_64__)
extern "C" void emu_ctx_switch(void** save_sp, void* new_sp);
asm(R"(
  .text
  .p2align 4
  .globl emu_ctx_switch
  .hidden emu_ctx_switch
  .type emu_ctx_switch,@function
emu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_ctx_switch, .-emu_ctx_switch
)");

void fiber_main();

// MXCSR of a fiber: round to nearest, exceptions masked; in perturbed mode also FTZ (bit 15)
// and DAZ (bit 6): float32 subnormals flushed to zero, as Apple GPUs may.
constexpr uint32_t kMxcsr = 0x1F80;
constexpr uint32_t kMxcsrFlush = 0x1F80 | 0x8000 | 0x40;

void* init_stack(char* top, uint32_t mxcsr) {  // top: 16-byte aligned end of the fiber's stack
  uint64_t* p = reinterpret_cast<uint64_t*>(top - 16);
  p[0] = reinterpret_cast<uint64_t>(&fiber_main);  // return address, at a 16-aligned slot
  p -= 7;                                           // rbp rbx r12 r13 r14 r15 + mxcsr/fpu
  for (int i = 1; i < 7; ++i) p[i] = 0;
  uint32_t* ctl = reinterpret_cast<uint32_t*>(p);
  ctl[0] = mxcsr;
  ctl[1] = 0x037F;  // default x87 control word
  return p;
}
#else
#error "emu_runtime: only x86-64 Linux is supported (hand-written context switch)"
#endif

// ---------------------------------------------------------------------------------------------
// Messages

std::string thread_desc(const EmuLane& l) {
  char b[256];
  snprintf(b, sizeof b,
           "thread_position_in_grid=(%u,%u,%u) threadgroup_position_in_grid=(%u,%u,%u) "
           "thread_position_in_threadgroup=(%u,%u,%u) simdgroup %u lane %u",
           l.thread_position_in_grid[0], l.thread_position_in_grid[1],
           l.thread_position_in_grid[2], l.threadgroup_position_in_grid[0],
           l.threadgroup_position_in_grid[1], l.threadgroup_position_in_grid[2],
           l.thread_position_in_threadgroup[0], l.thread_position_in_threadgroup[1],
           l.thread_position_in_threadgroup[2], l.simdgroup_index_in_threadgroup,
           l.thread_index_in_simdgroup);
  return b;
}

std::string site_desc(uint32_t site) {
  char b[64];
  snprintf(b, sizeof b, "line %u col %u", site >> 12, site & 0xFFF);
  return b;
}

// "0-31, 40, 64-127" for the threads (indices in threadgroup) matching pred.
template <class Pred>
std::string ranges(Worker* w, Pred pred) {
  std::string s;
  int i = 0;
  while (i < w->n) {
    if (!pred(w->fibers[i])) { ++i; continue; }
    int j = i;
    while (j + 1 < w->n && pred(w->fibers[j + 1])) ++j;
    char b[32];
    if (j == i) snprintf(b, sizeof b, "%d", i); else snprintf(b, sizeof b, "%d-%d", i, j);
    if (!s.empty()) s += ", ";
    s += b;
    i = j + 1;
  }
  return s;
}

void record_error(Launch* L, const std::string& msg) {
  std::lock_guard<std::mutex> g(L->err_mu);
  if (L->err.empty()) L->err = msg;
  L->stop.store(1);
}

// Abandon the current threadgroup: back to the worker's own stack.
[[noreturn]] void fault_here(Worker* w, const std::string& msg) {
  record_error(w->L, msg);
  w->faulted = true;
  void* dummy;
  emu_ctx_switch(&dummy, w->main_sp);
  __builtin_unreachable();
}

// ---------------------------------------------------------------------------------------------
// Scheduling

inline void push(Worker* w, int f) {
  w->fibers[f].state = kReady;
  w->runq[w->qt] = f;
  w->qt = (w->qt + 1) % (kMaxThreads + 1);
}

inline int pop(Worker* w) {
  if (w->qh == w->qt) return -1;
  int f = w->runq[w->qh];
  w->qh = (w->qh + 1) % (kMaxThreads + 1);
  return f;
}

// Lanes of simdgroup sg waiting at the collective of its lowest waiting lane form the group
// that completes next; returns the fiber that completes it.
int start_group(Worker* w, int sg) {
  uint32_t arr = w->sg_arrived[sg];
  int low = __builtin_ctz(arr);
  uint32_t site = w->fibers[sg * EMU_SIMD_WIDTH + low].site;
  uint32_t group = 0;
  for (uint32_t m = arr; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    if (w->fibers[sg * EMU_SIMD_WIDTH + l].site == site) group |= 1u << l;
  }
  w->simds[sg].active = group;
  int c = sg * EMU_SIMD_WIDTH + low;
  w->fibers[c].completer = 1;
  return c;
}

[[noreturn]] void deadlock(Worker* w) {
  std::string msg = "barrier reached by only part of a threadgroup (divergent control flow); "
                    "threadgroup_position_in_grid=(";
  const EmuLane& l0 = w->fibers[0].lane;
  msg += std::to_string(l0.threadgroup_position_in_grid[0]) + "," +
         std::to_string(l0.threadgroup_position_in_grid[1]) + "," +
         std::to_string(l0.threadgroup_position_in_grid[2]) + ")";
  std::string at_b = ranges(w, [](const Fiber& f) { return f.state == kAtBarrier; });
  std::string at_s = ranges(w, [](const Fiber& f) { return f.state == kAtSimd; });
  std::string done = ranges(w, [](const Fiber& f) { return f.state == kDone; });
  if (!at_b.empty()) {
    msg += "; threads (thread_index_in_threadgroup) waiting at threadgroup_barrier (" +
           site_desc(w->tg_site) + "): " + at_b;
  }
  if (!at_s.empty()) msg += "; threads waiting at a SIMD-group function: " + at_s;
  if (!done.empty()) msg += "; threads that returned without reaching it: " + done;
  fault_here(w, msg);
}

// Switch from the current fiber (its stack pointer saved in *save) to the next runnable one.
void switch_next(Worker* w, void** save) {
  int next = pop(w);
  if (next < 0) {
    if (w->live == 0) {
      emu_ctx_switch(save, w->main_sp);
      return;
    }
    int sg = -1;
    for (int s = 0; s < w->nsg; ++s) {
      uint32_t arr = w->sg_arrived[s];
      if (arr && (arr | w->sg_barrier[s]) == w->sg_live[s]) { sg = s; break; }
    }
    if (sg < 0) deadlock(w);
    next = start_group(w, sg);  // a divergent SIMD-group: complete the lanes that are there
  }
  if (next == w->cur) {
    w->fibers[next].state = kRunning;
    return;
  }
  w->cur = next;
  w->fibers[next].state = kRunning;
  emu_ctx_switch(save, w->fibers[next].sp);
}

void fiber_main() {
  Worker* w = tw;
  w->L->d->entry(w->L->ptrs.data());
  Fiber* f = &w->fibers[w->cur];
  f->state = kDone;
  w->live--;
  int sg = f->lane.simdgroup_index_in_threadgroup;
  w->sg_live[sg] &= ~(1u << f->lane.thread_index_in_simdgroup);
  if (w->sg_arrived[sg] && w->sg_arrived[sg] == w->sg_live[sg]) push(w, start_group(w, sg));
  if (w->tg_arrived && w->tg_arrived == w->live) deadlock(w);
  void* dummy;
  switch_next(w, &dummy);
  __builtin_unreachable();
}

// ---------------------------------------------------------------------------------------------
// Guarded memory

char* map_none(size_t len) {
  void* p = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    fprintf(stderr, "mlx_bricks emulator: mmap of %zu bytes failed\n", len);
    abort();
  }
  return static_cast<char*>(p);
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

Worker* get_worker(int i) {
  if (!g_workers[i]) {
    Worker* w = new Worker();
    size_t per = kStackBytes + kPage;
    w->stacks = map_none(per * kMaxThreads);
    for (int f = 0; f < kMaxThreads; ++f) {
      mprotect(w->stacks + f * per + kPage, kStackBytes, PROT_READ | PROT_WRITE);
    }
    w->altstack = static_cast<char*>(malloc(1 << 16));
    w->arena = map_none(kArenaBytes);
    g_workers[i] = w;
  }
  return g_workers[i];
}

// One buffer: the data either ends exactly at a PROT_NONE page (schedule 0: catches overruns)
// or starts right after one (schedule 1: catches underruns). Bytes of the writable pages
// outside the data hold a canary, so stray writes there are found after the run.
void make_buffer(Buffer& b, const EmuBuf* d, int schedule) {
  b.desc = d;
  size_t padded = round_up(d->nbytes ? d->nbytes : 1, 16);
  size_t body = round_up(padded, kPage);
  b.maplen = kGuardBytes + body + kGuardBytes;
  b.map = map_none(b.maplen);
  b.rw_lo = b.map + kGuardBytes;
  b.rw_hi = b.rw_lo + body;
  mprotect(b.rw_lo, body, PROT_READ | PROT_WRITE);
  memset(b.rw_lo, kCanary, body);
  b.data = schedule == 0 ? b.rw_hi - padded : b.rw_lo;
  if (d->nbytes) memcpy(b.data, d->host, d->nbytes);
}

void free_buffer(Buffer& b) {
  if (b.map) munmap(b.map, b.maplen);
  b.map = nullptr;
}

std::string check_canary(const Launch* L) {
  for (const Buffer& b : L->bufs) {
    const EmuBuf* d = b.desc;
    for (char* p = b.rw_lo; p < b.rw_hi; ++p) {
      if (p >= b.data && p < b.data + d->nbytes) { p = b.data + d->nbytes - 1; continue; }
      if (static_cast<unsigned char>(*p) != kCanary) {
        long long off = p - b.data;
        long long idx = off >= 0 ? off / d->elem_bytes : -((-off + d->elem_bytes - 1) / d->elem_bytes);
        char m[512];
        snprintf(m, sizeof m,
                 "out-of-bounds write to device buffer '%s' (%llu elements of %u bytes): "
                 "element index %lld (found after the run; the writing thread is unknown)",
                 d->name, (unsigned long long)(d->nbytes / d->elem_bytes), d->elem_bytes, idx);
        return m;
      }
    }
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Faults (SIGSEGV/SIGBUS for bad addresses, SIGFPE for integer division by zero)

struct sigaction g_old_segv, g_old_bus, g_old_fpe;

void describe_address(Worker* w, char* addr, bool is_write, std::string& out) {
  Launch* L = w->L;
  const char* rw = is_write ? "write" : "read";
  char m[640];
  for (const Buffer& b : L->bufs) {
    if (addr >= b.map && addr < b.map + b.maplen) {
      const EmuBuf* d = b.desc;
      long long off = addr - b.data;
      long long idx = off >= 0 ? off / d->elem_bytes : -((-off + d->elem_bytes - 1) / d->elem_bytes);
      snprintf(m, sizeof m,
               "out-of-bounds %s of device buffer '%s' (%llu elements of %u bytes): element "
               "index %lld (byte offset %lld)",
               rw, d->name, (unsigned long long)(d->nbytes / d->elem_bytes), d->elem_bytes, idx, off);
      out = m;
      return;
    }
  }
  for (int i = 0; i < w->nslots; ++i) {
    const TgSlot& s = w->slots[i];
    if (addr >= s.lo - kPage && addr < s.hi + kPage) {
      long long off = addr - s.ptr;
      long long idx = off >= 0 ? off / s.elem : -((-off + s.elem - 1) / s.elem);
      const char* name = s.slot < L->d->ntg_names ? L->d->tg_names[s.slot] : "?";
      snprintf(m, sizeof m,
               "out-of-bounds %s of threadgroup memory '%s' (%llu bytes, elements of %u "
               "bytes): element index %lld (byte offset %lld)",
               rw, name, (unsigned long long)s.bytes, s.elem, idx, off);
      out = m;
      return;
    }
  }
  size_t per = kStackBytes + kPage;
  if (addr >= w->stacks && addr < w->stacks + per * kMaxThreads &&
      static_cast<size_t>(addr - w->stacks) % per < kPage) {
    snprintf(m, sizeof m,
             "thread stack overflow: a kernel thread used more than %zu KiB of thread memory",
             kStackBytes / 1024);
    out = m;
    return;
  }
  snprintf(m, sizeof m, "invalid %s of address %p (not near any device buffer or threadgroup "
           "array)", rw, static_cast<void*>(addr));
  out = m;
}

void on_fault(int sig, siginfo_t* si, void* ucv) {
  Worker* w = tw;
  if (!w || !w->in_run) {  // not ours: put the previous handler back and let it run
    sigaction(sig, sig == SIGSEGV ? &g_old_segv : sig == SIGBUS ? &g_old_bus : &g_old_fpe,
              nullptr);
    return;
  }
  std::string what;
  if (sig == SIGFPE) {
    what = "integer division by zero (or INT_MIN / -1): a GPU returns an unspecified value, "
           "the emulator stops";
  } else {
    bool is_write = false;
#if defined(__x86_64__)
    is_write = (static_cast<ucontext_t*>(ucv)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
    describe_address(w, static_cast<char*>(si->si_addr), is_write, what);
  }
  if (w->cur >= 0 && w->cur < w->n) what += "; by " + thread_desc(w->fibers[w->cur].lane);
  record_error(w->L, what);
  w->faulted = true;
  siglongjmp(w->jb, 1);
}

// ---------------------------------------------------------------------------------------------
// Threadgroups

void run_group(Worker* w, Launch* L, uint64_t flat) {
  const EmuLaunchDesc* d = L->d;
  uint32_t gpos[3] = {static_cast<uint32_t>(flat % L->ngroups[0]),
                      static_cast<uint32_t>((flat / L->ngroups[0]) % L->ngroups[1]),
                      static_cast<uint32_t>(flat / (uint64_t(L->ngroups[0]) * L->ngroups[1]))};
  uint32_t dims[3];
  for (int k = 0; k < 3; ++k) {
    dims[k] = d->threadgroup[k];
    uint32_t rest = d->grid[k] - gpos[k] * d->threadgroup[k];
    if (rest < dims[k]) dims[k] = rest;
  }
  int n = dims[0] * dims[1] * dims[2];
  uint32_t dispatch = d->threadgroup[0] * d->threadgroup[1] * d->threadgroup[2];
  w->n = n;
  w->nsg = (n + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH;
  w->live = n;
  w->tg_arrived = 0;
  w->tg_mixed = 0;
  w->qh = w->qt = 0;
  size_t per = kStackBytes + kPage;
  for (int i = 0; i < n; ++i) {
    Fiber& f = w->fibers[i];
    EmuLane& l = f.lane;
    uint32_t loc[3] = {i % dims[0], (i / dims[0]) % dims[1], i / (dims[0] * dims[1])};
    for (int k = 0; k < 3; ++k) {
      l.thread_position_in_threadgroup[k] = loc[k];
      l.threadgroup_position_in_grid[k] = gpos[k];
      l.thread_position_in_grid[k] = gpos[k] * d->threadgroup[k] + loc[k];
      l.threads_per_threadgroup[k] = dims[k];
      l.dispatch_threads_per_threadgroup[k] = d->threadgroup[k];
      l.threadgroups_per_grid[k] = L->ngroups[k];
      l.threads_per_grid[k] = d->grid[k];
    }
    l.thread_index_in_threadgroup = i;
    l.thread_index_in_simdgroup = i % EMU_SIMD_WIDTH;
    l.simdgroup_index_in_threadgroup = i / EMU_SIMD_WIDTH;
    l.simdgroups_per_threadgroup = w->nsg;
    l.dispatch_simdgroups_per_threadgroup = (dispatch + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH;
    l.simd = &w->simds[i / EMU_SIMD_WIDTH];
    f.state = kReady;
    f.completer = 0;
    f.site = 0;
    f.sp = init_stack(w->stacks + i * per + per, d->perturb ? kMxcsrFlush : kMxcsr);
  }
  for (int s = 0; s < w->nsg; ++s) {
    int lanes = n - s * EMU_SIMD_WIDTH;
    if (lanes > EMU_SIMD_WIDTH) lanes = EMU_SIMD_WIDTH;
    w->sg_live[s] = lanes == 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1);
    w->sg_arrived[s] = 0;
    w->sg_barrier[s] = 0;
    w->simds[s].nlanes = lanes;
    w->simds[s].active = 0;
  }
  for (int i = 0; i < w->nslots; ++i) {
    memset(w->slots[i].lo, static_cast<int>(d->tg_poison), w->slots[i].hi - w->slots[i].lo);
  }
  for (int i = 0; i < n; ++i) push(w, d->schedule ? n - 1 - i : i);
  w->cur = pop(w);
  w->fibers[w->cur].state = kRunning;
  emu_ctx_switch(&w->main_sp, w->fibers[w->cur].sp);
  w->cur = -1;
}

void run_worker(Worker* w, Launch* L) {
  tw = w;
  w->L = L;
  w->faulted = false;
  w->cur = -1;
  w->nslots = 0;
  w->arena_used = 0;
  w->tg_bytes = 0;
  mprotect(w->arena, kArenaBytes, PROT_NONE);
  stack_t ss{}, old_ss{};
  ss.ss_sp = w->altstack;
  ss.ss_size = 1 << 16;
  sigaltstack(&ss, &old_ss);
  if (sigsetjmp(w->jb, 1) == 0) {
    w->in_run = 1;
    while (!L->stop.load(std::memory_order_relaxed)) {
      uint64_t i = L->next.fetch_add(1);
      if (i >= L->total_groups) break;
      run_group(w, L, L->d->schedule ? L->total_groups - 1 - i : i);
      if (w->faulted) break;
    }
  }
  w->in_run = 0;
  sigaltstack(&old_ss, nullptr);
  tw = nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points for kernels

extern "C" {

// float -> bfloat conversions (round to nearest even; NaN stays NaN). clang emits calls to
// these; libgcc before GCC 13 lacks them.
__attribute__((visibility("default"))) __bf16 __truncsfbf2(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t r;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    r = static_cast<uint16_t>((u >> 16) | 0x40u);
  } else {
    u += 0x7FFFu + ((u >> 16) & 1u);
    r = static_cast<uint16_t>(u >> 16);
  }
  return __builtin_bit_cast(__bf16, r);
}
__attribute__((visibility("default"))) __bf16 __truncdfbf2(double d) {
  // via float: double rounding differs from a direct rounding only in rare ties
  return __truncsfbf2(static_cast<float>(d));
}

// The launch's perturbation seed (0: off), read by the shim's fast:: functions, reductions and
// simdgroup products. Launches are serialised (g_launch_mu), so one global serves.
__attribute__((visibility("default"))) uint32_t emu_perturb_seed = 0;

EmuLane* emu_cur(void) { return &tw->fibers[tw->cur].lane; }

int emu_simd_arrive(EmuLane* lane, uint32_t site) {
  Worker* w = tw;
  Fiber* f = reinterpret_cast<Fiber*>(lane);
  int sg = lane->simdgroup_index_in_threadgroup;
  f->site = site;
  f->state = kAtSimd;
  w->sg_arrived[sg] |= 1u << lane->thread_index_in_simdgroup;
  if (w->sg_arrived[sg] == w->sg_live[sg]) {
    int c = start_group(w, sg);
    if (c == w->cur) {
      f->completer = 0;
      f->state = kRunning;
      return 1;
    }
    push(w, c);
  }
  switch_next(w, &f->sp);
  if (f->completer) {
    f->completer = 0;
    return 1;
  }
  return 0;
}

void emu_simd_release(EmuLane* lane) {
  // Every participant, the completer included, goes back to the run queue in schedule order,
  // so schedule 1 really runs the group in the reverse order after the collective.
  Worker* w = tw;
  int sg = lane->simdgroup_index_in_threadgroup;
  uint32_t group = w->simds[sg].active;
  w->sg_arrived[sg] &= ~group;
  int base = sg * EMU_SIMD_WIDTH;
  if (w->L->d->schedule == 0) {
    for (uint32_t m = group; m; m &= m - 1) push(w, base + __builtin_ctz(m));
  } else {
    for (int l = EMU_SIMD_WIDTH - 1; l >= 0; --l) {
      if (group >> l & 1) push(w, base + l);
    }
  }
  Fiber* f = reinterpret_cast<Fiber*>(lane);
  switch_next(w, &f->sp);
}

void emu_tg_barrier(EmuLane* lane, uint32_t site) {
  Worker* w = tw;
  Fiber* f = reinterpret_cast<Fiber*>(lane);
  int sg = lane->simdgroup_index_in_threadgroup;
  if (w->tg_arrived == 0) {
    w->tg_site = site;
    w->tg_mixed = 0;
  } else if (site != w->tg_site) {
    w->tg_mixed = 1;
  }
  f->site = site;
  f->state = kAtBarrier;
  w->tg_arrived++;
  w->sg_barrier[sg] |= 1u << lane->thread_index_in_simdgroup;
  if (w->tg_arrived == w->live) {
    if (w->live != w->n) deadlock(w);
    if (w->tg_mixed) {
      std::string msg = "threads of one threadgroup wait at different threadgroup_barrier "
                        "calls (divergent control flow): ";
      uint32_t s0 = w->tg_site;
      msg += site_desc(s0) + ": threads " +
             ranges(w, [s0](const Fiber& x) { return x.site == s0; }) + "; other threads: " +
             ranges(w, [s0](const Fiber& x) { return x.site != s0; });
      fault_here(w, msg);
    }
    w->tg_arrived = 0;
    for (int s = 0; s < w->nsg; ++s) w->sg_barrier[s] = 0;
    if (w->L->d->schedule == 0) {
      for (int i = 0; i < w->n; ++i) push(w, i);
    } else {
      for (int i = w->n - 1; i >= 0; --i) push(w, i);
    }
  }
  switch_next(w, &f->sp);
}

void* emu_tg_alloc(uint32_t slot, uint64_t bytes, uint64_t align, uint32_t elem_bytes) {
  Worker* w = tw;
  for (int i = 0; i < w->nslots; ++i) {
    if (w->slots[i].slot == slot && w->slots[i].bytes == bytes) return w->slots[i].ptr;
  }
  if (w->nslots == kMaxSlots) emu_fault("more than 64 threadgroup declarations");
  w->tg_bytes += bytes;
  if (w->tg_bytes > kTgLimit) {
    char m[200];
    snprintf(m, sizeof m, "threadgroup memory of %zu bytes exceeds the 32 KiB Apple GPUs have",
             w->tg_bytes);
    emu_fault(m);
  }
  size_t a = align > 16 ? align : 16;
  size_t padded = round_up(bytes ? bytes : 1, a);
  size_t body = round_up(padded, kPage);
  char* lo = w->arena + w->arena_used + kPage;  // one PROT_NONE page before each array
  w->arena_used += kPage + body;
  mprotect(lo, body, PROT_READ | PROT_WRITE);
  TgSlot& s = w->slots[w->nslots++];
  s.slot = slot;
  s.bytes = bytes;
  s.elem = elem_bytes ? elem_bytes : 1;
  s.lo = lo;
  s.hi = lo + body;
  s.ptr = w->L->d->schedule == 0 ? s.hi - padded : s.lo;
  memset(lo, static_cast<int>(w->L->d->tg_poison), body);
  return s.ptr;
}

void emu_fault(const char* msg) {
  Worker* w = tw;
  std::string m = msg;
  if (w->cur >= 0) m += "; by " + thread_desc(w->fibers[w->cur].lane);
  fault_here(w, m);
}

int emu_launch(const EmuLaunchDesc* d, char* err, uint32_t errlen) {
  std::lock_guard<std::mutex> guard(g_launch_mu);
  emu_perturb_seed = d->perturb;
  Launch L;
  L.d = d;
  L.total_groups = 1;
  for (int k = 0; k < 3; ++k) {
    L.ngroups[k] = (d->grid[k] + d->threadgroup[k] - 1) / d->threadgroup[k];
    L.total_groups *= L.ngroups[k];
  }
  L.bufs.resize(d->nbufs);
  L.ptrs.resize(d->nbufs);
  for (uint32_t i = 0; i < d->nbufs; ++i) {
    if (d->checks) {
      make_buffer(L.bufs[i], &d->bufs[i], d->schedule);
      L.ptrs[i] = L.bufs[i].data;
    } else {
      L.bufs[i].desc = &d->bufs[i];
      L.ptrs[i] = d->bufs[i].host;
    }
  }
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
  sigaction(SIGFPE, &sa, &g_old_fpe);

  int nthreads = d->nthreads < 1 ? 1 : d->nthreads > kMaxWorkers ? kMaxWorkers : d->nthreads;
  if (static_cast<uint64_t>(nthreads) > L.total_groups) nthreads = static_cast<int>(L.total_groups);
  std::vector<std::thread> pool;
  for (int t = 1; t < nthreads; ++t) {
    Worker* w = get_worker(t);
    pool.emplace_back([w, &L] { run_worker(w, &L); });
  }
  run_worker(get_worker(0), &L);
  for (auto& t : pool) t.join();

  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  sigaction(SIGFPE, &g_old_fpe, nullptr);

  if (L.err.empty() && d->checks) L.err = check_canary(&L);
  if (L.err.empty()) {
    for (uint32_t i = 0; i < d->nbufs; ++i) {
      if (d->checks && d->bufs[i].is_output && d->bufs[i].nbytes) {
        memcpy(d->bufs[i].host, L.bufs[i].data, d->bufs[i].nbytes);
      }
    }
  }
  for (Buffer& b : L.bufs) free_buffer(b);
  if (!L.err.empty()) {
    snprintf(err, errlen, "%s", L.err.c_str());
    return 1;
  }
  return 0;
}

}  // extern "C"
