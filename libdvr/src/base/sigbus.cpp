// See sigbus.hpp.
#include "base/sigbus.hpp"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace dvr::detail {
namespace {

// Each thread that makes guarded reads owns one slot of this table (claimed
// at its first guarded read, given back when it exits). The handler finds
// the faulting thread's slot by its kernel thread id: no thread-local
// storage is touched in the handler (a library loaded with dlopen, as by
// Python, may allocate its TLS lazily, which is not async-signal-safe).
constexpr std::size_t kSlots = 1024;
struct Slot {
  std::atomic<pid_t> tid{0};      // owner, 0 = free
  std::atomic<bool> active{false};  // a guarded read is under way
  std::uintptr_t lo = 0, hi = 0;
  sigjmp_buf* jump = nullptr;
  const void* fault = nullptr;
};
Slot g_slots[kSlots];

struct sigaction g_previous {};

struct Owner {
  Slot* slot = nullptr;
  ~Owner() {
    if (slot) slot->tid.store(0, std::memory_order_release);
  }
};
thread_local Owner t_owner;

// Not inlined: its loop would live in guarded_call's frame, across sigsetjmp.
[[gnu::noinline]] Slot* my_slot() {
  if (t_owner.slot) return t_owner.slot;
  const pid_t me = static_cast<pid_t>(::syscall(SYS_gettid));
  for (Slot& s : g_slots) {
    pid_t free = 0;
    if (s.tid.compare_exchange_strong(free, me, std::memory_order_acq_rel)) return t_owner.slot = &s;
  }
  return nullptr;  // more than kSlots threads: reads unguarded
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (info && info->si_code > 0) {
    const pid_t me = static_cast<pid_t>(::syscall(SYS_gettid));
    const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
    for (Slot& s : g_slots)
      if (s.tid.load(std::memory_order_acquire) == me && s.active.load(std::memory_order_acquire) && addr >= s.lo && addr < s.hi) {
        s.fault = info->si_addr;
        s.active.store(false, std::memory_order_release);
        siglongjmp(*s.jump, 1);
      }
  }
  // Not ours: what was there before.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action (SIG_IGN cannot ignore a fault: the access would
  // fault forever): restored, then the access re-executes and faults again;
  // a SIGBUS that was sent is raised again (delivered once this returns).
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
  if (!info || info->si_code <= 0) raise(sig);
}

void install() {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous);
  // A forked child's thread has another id: it claims a slot of its own.
  pthread_atfork(nullptr, nullptr, [] { t_owner.slot = nullptr; });
}

thread_local const void* t_fault = nullptr;

}  // namespace

bool guarded_call(const void* lo, std::size_t len, void (*fn)(void*), void* ctx) noexcept {
  static std::once_flag once;
  std::call_once(once, install);
  Slot* slot = my_slot();
  if (!slot) {
    fn(ctx);
    return true;
  }
  sigjmp_buf jump;
  slot->lo = reinterpret_cast<std::uintptr_t>(lo);
  slot->hi = slot->lo + len;
  slot->jump = &jump;
  if (sigsetjmp(jump, 0) != 0) {
    // Back from the handler, with SIGBUS still blocked (the mask was not
    // saved: that would cost a system call per guarded read).
    t_fault = slot->fault;
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
    return false;
  }
  slot->active.store(true, std::memory_order_release);
  fn(ctx);
  slot->active.store(false, std::memory_order_release);
  return true;
}

const void* guarded_fault_address() noexcept { return t_fault; }

}  // namespace dvr::detail
