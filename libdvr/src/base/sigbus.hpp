// Reads from mapped pack files that survive SIGBUS.
//
// A mapped file delivers SIGBUS, not an error code, when a read reaches past
// its end (the file was truncated while mapped) or the medium cannot supply a
// page (an I/O error). Every bulk read of pack data (hashing it to check it,
// copying it out: restore, verify, diff, clone checks, send) goes through
// guarded(), which turns such a SIGBUS into a false return; the caller throws
// a dvr::Error naming the pack (Packs::unreadable()).
//
// How (docs/format.md, "Reading packs: pread, and SIGBUS"): the first guarded() call
// installs one process-wide SIGBUS handler (SA_SIGINFO, SA_ONSTACK), keeping
// the handler that was there before. Each thread owns a slot of a global
// table (claimed at its first guarded read, by its kernel thread id); guarded()
// records there the address range it reads and a jump buffer (sigsetjmp
// without the signal mask, so a guarded call costs no system call); the
// handler, when the fault address lies in the faulting thread's range (found
// by gettid, never through thread-local storage, which a library loaded with
// dlopen may allocate lazily), siglongjmp()s back, and guarded() unblocks
// SIGBUS again and returns false. (Beyond 1024 threads with guarded reads at
// once, further threads read unguarded.) Any other SIGBUS (another
// thread, another address, one sent with kill) goes to the previous handler:
// its sa_sigaction or sa_handler is called; for SIG_DFL or SIG_IGN the
// default action is restored and the fault re-executes (a signal that was
// sent, not a fault, is raised again). The handler uses only atomics of the
// table, the gettid system call, sigaction, raise and siglongjmp: all
// async-signal-safe. An application that installs its own
// SIGBUS handler after the library must chain to the one it replaces, as
// this one does.
#pragma once

#include <cstddef>
#include <type_traits>

namespace dvr::detail {

/// Runs fn(ctx), which reads [lo, lo+len) and may write memory it owns;
/// false when a read of that range took SIGBUS (fn stopped there). fn must
/// not allocate, lock or own anything that needs a destructor: it is
/// abandoned where the fault hit. Not reentrant on one thread.
bool guarded_call(const void* lo, std::size_t len, void (*fn)(void*), void* ctx) noexcept;

/// guarded_call() for a lambda (or any callable) `f`.
template <class F>
bool guarded(const void* lo, std::size_t len, F&& f) noexcept {
  return guarded_call(lo, len, [](void* p) { (*static_cast<std::remove_reference_t<F>*>(p))(); }, const_cast<void*>(static_cast<const void*>(&f)));
}

/// Where the last SIGBUS guarded() caught on this thread hit.
const void* guarded_fault_address() noexcept;

}  // namespace dvr::detail
