// `dvr serve`: the HTTP server of the dashboard and the REST API
// (docs/dashboard.md; every route in docs/openapi.json). One process serves
// the stores given, samples host memory, watches for damage, low space and
// failing jobs, runs actions (verify, gc, prune, rm, proc dump/restore/clone,
// push) on worker threads, and aggregates the servers of other hosts.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace dvr::server {

/// What `dvr serve` is told (cli/dvr.cpp maps its options onto this).
struct ServeOptions {
  std::string listen = "127.0.0.1:8642";  // HOST:PORT ([V6]:PORT); port 0: any free port
  std::vector<std::string> stores;        // store directories (none: the default store)
  std::vector<std::string> peers;         // http(s)://HOST:PORT of other hosts' servers
  std::string token_file;                 // the bearer token (mode 0600, owned by the user)
  std::string tls_cert, tls_key;          // PEM files: serve HTTPS
  std::string web_root;                   // the built dashboard ("": next to the binary)
  std::string peer_ca;                    // CA file for https:// peers ("": the system's CAs)
  std::string peer_token_file;            // the token sent to peers (mode 0600)
  double sample_every_s = 10;             // memory sampling interval
  double check_every_s = 30;              // damage flags, space, permissions
  double verify_every_s = 6 * 3600;       // a full verify of each store (0: never by itself)
  unsigned action_rate = 6;               // actions of one kind per minute (burst as many)
  std::size_t max_body = 1 << 20;         // request bodies larger than this: 413
};

/// Checks the options (refusing what the security model forbids, with a
/// message naming the option or file and what to do), serves until SIGINT
/// or SIGTERM, and returns the exit status (0 after a clean stop). Prints
/// one JSON line {"schema_version":1,"event":"listening","url":...,"port":...}
/// on stdout once it accepts connections, and its log lines on stderr.
/// Throws dvr::Error for a refused setup (invalid_argument: bad options;
/// permission: token file or store not private to the user; not_found).
int serve(const ServeOptions& options);

}  // namespace dvr::server
