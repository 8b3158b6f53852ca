// Reaching a store on another machine through ssh (dvr push and pull): the
// ssh child, connections kept open (--keep-ssh), and the kept receiver, a far
// `dvr receive --listen` that later pushes reach through the kept connection
// without starting a shell or a dvr there (docs/migration.md, "Keeping the
// connection for the next push").
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "dvr/dvr.hpp"
#include "dvr/transfer.hpp"

namespace dvr::cli {

/// ssh://[USER@]HOST[:PORT]/STORE, taken apart.
struct SshTarget {
  std::string host;  // [user@]host
  std::string port;  // empty: ssh's default
  std::string path;  // the far store (absolute)
};

/// Parses ssh://[USER@]HOST[:PORT]/ABSOLUTE/PATH; throws invalid_argument
/// naming what is wrong.
SshTarget parse_ssh_url(const std::string& url);

/// The directory where --keep-ssh's connections keep their control sockets
/// (and the kept receivers their forwarded sockets): $XDG_RUNTIME_DIR/dvr-ssh,
/// else /tmp/dvr-ssh-UID; made if missing, refused (permission) unless it is
/// a directory of this user's alone.
std::string ssh_control_dir();

/// --keep-ssh DURATION, else $DVR_KEEP_SSH, in seconds (0: not kept); throws
/// invalid_argument naming the option or variable.
long keep_ssh_seconds(const std::string& option);

/// TEXT ("90", "10m", "1h30m") in whole seconds, at most 7 days; throws
/// invalid_argument naming `from` (the option or variable it came from).
long duration_up_to_7d(const std::string& text, const std::string& from);

/// Runs `SSH [control options] [-p PORT] HOST REMOTE-COMMAND` with its stdin
/// and stdout connected to `to` and `from`; its stderr (the far dvr's
/// messages) goes to ours. keep_s > 0: one connection shared between pushes
/// and pulls to the same host (OpenSSH's ControlMaster), kept open keep_s
/// seconds after the last one; the first one opens it.
struct SshChild {
  pid_t pid = -1;
  int to = -1, from = -1;
  SshChild(const std::string& ssh, const SshTarget& t, const std::vector<std::string>& remote, long keep_s = 0);
  /// Closes our ends and waits: ssh's exit status (128 + signal if killed).
  int finish();
  ~SshChild();
  SshChild(const SshChild&) = delete;
  SshChild& operator=(const SshChild&) = delete;
};

// ---- the kept receiver -------------------------------------------------------
//
// A push with --keep-ssh leaves, besides the ssh connection, a far
// `dvr receive --listen` running (one per far store, listening on a unix
// socket in a private directory) and forwards a local socket in
// ssh_control_dir() to it through the kept connection (`ssh -O forward`). The
// next push to the same store connects to that local socket: ssh opens a
// channel to the listener, which forks a receiver for it. No login shell, no
// dvr start at the far end.

/// The kept receiver of (t, remote_dvr) through its local forwarded socket,
/// checked alive (it greets within 10 s): a connected socket, or -1 when
/// there is none or it is gone (a socket nobody listens on is removed).
int connect_kept_receiver(const SshTarget& t, const std::string& remote_dvr);

/// After a push that opened an ssh session with keep_s > 0: starts (or finds)
/// the far kept receiver and forwards the local socket to it through the
/// kept connection. Never fails the push: when the far side cannot (an older
/// dvr, forwarding disabled by its sshd), says so once on stderr and leaves a
/// note that stops further tries for keep_s seconds.
void keep_receiver(const std::string& ssh, const SshTarget& t, const std::string& remote_dvr, long keep_s);

/// `dvr receive --listen --idle SECONDS`, the far side: finds the store's kept
/// receiver, or starts it (a daemon listening on a unix socket in
/// $XDG_RUNTIME_DIR/dvr-receive, else /tmp/dvr-receive-UID, accepting only
/// this user's connections and receiving each negotiated push in a process
/// of its own), and prints "listening PATH". The daemon ends after idle_s
/// seconds without a connection, or when its socket is removed or replaced;
/// its log is beside the socket (HEX.log). `ro` applies to every push it
/// receives (require_signature).
int listen_kept_receiver(Store& store, long idle_s, const transfer::ReceiveOptions& ro);

}  // namespace dvr::cli
