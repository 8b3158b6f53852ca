// See sigbus.hpp.
#include "base/sigbus.hpp"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>

#include <cstdint>
#include <mutex>

namespace dvr::detail {
namespace {

struct Guard {
  sigjmp_buf jump;
  std::uintptr_t lo = 0, hi = 0;
};

// The current thread's guarded read, or nullptr. initial-exec: reading it in
// the handler never allocates TLS.
[[gnu::tls_model("initial-exec")]] thread_local Guard* t_guard = nullptr;
[[gnu::tls_model("initial-exec")]] thread_local const void* t_fault = nullptr;

struct sigaction g_previous {};

void on_sigbus(int sig, siginfo_t* info, void* context) {
  Guard* g = t_guard;
  const auto addr = reinterpret_cast<std::uintptr_t>(info ? info->si_addr : nullptr);
  if (g && info && info->si_code > 0 && addr >= g->lo && addr < g->hi) {
    t_fault = info->si_addr;
    t_guard = nullptr;
    siglongjmp(g->jump, 1);
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
}

}  // namespace

bool guarded_call(const void* lo, std::size_t len, void (*fn)(void*), void* ctx) noexcept {
  static std::once_flag once;
  std::call_once(once, install);
  Guard g;
  g.lo = reinterpret_cast<std::uintptr_t>(lo);
  g.hi = g.lo + len;
  if (sigsetjmp(g.jump, 0) != 0) {
    // Back from the handler, with SIGBUS still blocked (the mask was not
    // saved: that would cost a system call per guarded read).
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
    return false;
  }
  t_guard = &g;
  fn(ctx);
  t_guard = nullptr;
  return true;
}

const void* guarded_fault_address() noexcept { return t_fault; }

}  // namespace dvr::detail
