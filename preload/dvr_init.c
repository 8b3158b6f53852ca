// libdvr_init.so: preloaded by `dvr run` into every job it starts, so that
// the job stops on SIGTERM, SIGINT, SIGHUP and SIGQUIT as the program would.
//
// A `dvr run` job is PID 1 of a PID namespace of its own, and the kernel
// gives a namespace's init no default action for a signal: one whose
// disposition is SIG_DFL is dropped, so `kill PID` and Ctrl-C did nothing.
// When the process is PID 1, this installs, for those four signals while
// they are still at SIG_DFL, a handler that does what the default action
// would: end the process (exit status 128+N, which is what `dvr proc restore`
// reports for a job killed by signal N). A program that installs its own
// handler, or ignores the signal, replaces this one.
//
// A program that sets one of them back to SIG_DFL itself (dash does, for
// SIGTERM, as it starts) gets the same handler instead, through sigaction()
// and signal() below, and is told SIG_DFL when it asks: it meant "end the
// process", which SIG_DFL no longer does in PID 1. A child process (not PID
// 1) and a statically linked program (the loader preloads nothing) are left
// alone. No libdvr, no allocation: it runs before the program's main.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stddef.h>
#include <unistd.h>

static void dvr_init_default_action(int sig) { _exit(128 + sig); }

static int dvr_init_ends_job(int sig) { return sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT; }

typedef int (*sigaction_fn)(int, const struct sigaction*, struct sigaction*);

static sigaction_fn dvr_init_real_sigaction(void) {
  static sigaction_fn real;
  if (!real) real = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  return real;
}

__attribute__((visibility("default"))) int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  sigaction_fn real = dvr_init_real_sigaction();
  if (!real) return -1;
  struct sigaction sub;
  if (act && dvr_init_ends_job(sig) && !(act->sa_flags & SA_SIGINFO) && act->sa_handler == SIG_DFL && getpid() == 1) {
    sub = *act;
    sub.sa_handler = dvr_init_default_action;
    act = &sub;
  }
  int rc = real(sig, act, old);
  if (rc == 0 && old && !(old->sa_flags & SA_SIGINFO) && old->sa_handler == dvr_init_default_action) old->sa_handler = SIG_DFL;
  return rc;
}

// glibc's signal() does not go through the sigaction() symbol: the same,
// with its BSD semantics (SA_RESTART, the handler stays).
__attribute__((visibility("default"))) sighandler_t signal(int sig, sighandler_t handler) {
  struct sigaction sa = {0}, old;
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(sig, &sa, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

__attribute__((constructor)) static void dvr_init_signals(void) {
  if (getpid() != 1) return;
  static const int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  for (unsigned k = 0; k < sizeof sigs / sizeof sigs[0]; ++k) {
    struct sigaction old;
    if (sigaction(sigs[k], NULL, &old) != 0 || old.sa_handler != SIG_DFL || (old.sa_flags & SA_SIGINFO)) continue;
    struct sigaction sa = {0};
    sa.sa_handler = dvr_init_default_action;
    sigemptyset(&sa.sa_mask);
    sigaction(sigs[k], &sa, NULL);
  }
}
