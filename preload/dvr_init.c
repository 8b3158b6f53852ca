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
// handler, or ignores the signal, replaces this one; a child process (not
// PID 1) and a statically linked program (the loader preloads nothing) are
// left alone. No libdvr, no allocation: it runs before the program's main.
#include <signal.h>
#include <unistd.h>

static void dvr_init_default_action(int sig) { _exit(128 + sig); }

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
