// A clone's namespaces: the network it runs in (the host's, a new namespace
// with a veth pair to the host, or an existing one) and its private mount
// view, in which CRIU binds the clone's Unix sockets and writes its new files
// without touching the original's (docs/criu.md, "Clones with their own
// network"). restore.cpp sets them up through CloneView; CRIU's child enters
// them before exec, so that everything CRIU restores is created there.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/os.hpp"
#include "dvr/proc.hpp"

namespace dvr::proc::impl {

/// An IPv4 address with its prefix length: 10.213.0.2/24.
struct Ipv4Prefix {
  std::uint32_t addr = 0;  // host byte order
  int prefix = 0;          // 0..32
  std::uint32_t mask() const { return prefix == 0 ? 0u : ~0u << (32 - prefix); }
  std::uint32_t network() const { return addr & mask(); }
  /// Whether the networks of the two share an address.
  bool overlaps(const Ipv4Prefix& o) const;
  std::string address() const;  // "10.213.0.2"
  std::string text() const;     // "10.213.0.2/24"
};

/// Parses "A.B.C.D/P" ("A.B.C.D" alone when `prefix_optional`, prefix 32 then).
std::optional<Ipv4Prefix> parse_ipv4_prefix(const std::string& text, bool prefix_optional = false);

/// The host end of a veth pair for a clone at `clone`: the first address of
/// its network that is neither the network's own, its broadcast address nor
/// `clone`. `clone` must be a host address of a network of at least 4 (/30).
Ipv4Prefix host_end_for(const Ipv4Prefix& clone);

/// The paths of the named (not abstract) Unix sockets in a CRIU image: a
/// files.img (FileEntry records, `file_entries`) or an older unixsk.img
/// (UnixSkEntry records). A relative name is joined to the directory CRIU
/// recorded with it. What a damaged image holds after the damage is ignored.
std::vector<std::string> unix_socket_paths(std::string_view image, bool file_entries);

/// The namespaces of one clone (RestoreOptions::clone), from the check of its
/// options to the moment CRIU restored it; a plain restore has none (every
/// call does nothing then). Created before anything changes: the options
/// are checked (bad or misplaced --net/--ip, a missing namespace) and the
/// snapshot's Unix sockets read, so a refusal leaves nothing behind. What
/// in_child() sets up goes again on destruction unless keep() was called.
class CloneView {
 public:
  CloneView(const Store& store, const std::string& name, const ProcInfo& p, const RestoreOptions& options);
  ~CloneView();
  CloneView(const CloneView&) = delete;
  CloneView& operator=(const CloneView&) = delete;

  /// Sets up the network (a new namespace: its veth pair, addresses, lo up)
  /// and returns what CRIU's child runs before exec: enter the network
  /// namespace, unshare its mount namespace, cover each directory of the
  /// job's Unix sockets with a tmpfs holding the directory's other entries
  /// bound back (the job's sockets are left out, so CRIU binds new ones
  /// there), and an empty tmpfs over each heap directory (the plugin puts
  /// private copies of the heaps there), in which a heap sealed at the dump
  /// (heap_seal.hpp) is its heap pack, bound there: the clone maps it
  /// copy-on-write, so its private memory is only what it writes. On failure the child writes why to
  /// its stderr and exits 126. Empty for a restore. Throws when the network
  /// cannot be set up (nothing of it is left then).
  std::function<bool()> in_child();
  /// CRIU restored the clone: its network namespace stays, held by its
  /// processes, and goes with them (the veth pair with it).
  void keep() { kept_ = true; }
  /// The clone's network, for RestoreResult (net, ip, host_ip, host_if).
  void report(RestoreResult& r) const;

 private:
  struct Entry {
    std::string name;
    enum Kind { other, dir, symlink } kind = other;
    std::string link;  // a symlink's target
  };
  struct Shadow {
    std::string dir;
    mode_t mode = 0755;
    uid_t uid = 0;
    gid_t gid = 0;
    std::vector<Entry> entries;  // bound back (or recreated, for symlinks)
  };
  enum class Net { host, fresh, existing };

  void check_network(const RestoreOptions& options);
  std::vector<Shadow> shadows() const;
  void make_network();
  std::string ip(const std::vector<std::string>& args, bool inside);
  void stop_helper();

  bool clone_ = false;
  std::string what_;  // "cannot clone process snapshot 'NAME'"
  std::vector<std::string> heap_dirs_;
  std::vector<std::pair<std::string, std::string>> sealed_heaps_;  // heap file -> its heap pack, bound there
  std::vector<std::string> sockets_;  // the job's named Unix sockets
  Net net_ = Net::host;
  std::string netns_path_;  // Net::existing: the namespace's file
  Ipv4Prefix ip_, host_ip_;
  bool ip_given_ = false, host_ip_given_ = false;
  std::string ip_tool_;
  detail::Fd netns_;      // the clone's network namespace
  detail::Fd lock_;       // held while a new network's address is chosen and set
  std::string host_if_;   // the veth's host end, once created
  pid_t helper_ = -1;     // holds a new namespace while it is set up
  detail::Fd helper_sk_;  // its end closed: the helper exits
  bool kept_ = false;
};

}  // namespace dvr::proc::impl
