// A clone's network and mount namespaces (see netns.hpp, docs/criu.md
// "Clones with their own network").
//
// Network. `--net new`: a network namespace made by a helper process
// (unshare(CLONE_NEWNET)) and held by a file descriptor while it is set up
// with iproute2: a veth pair, its host end (dvrXXXXXXXX) on the host with the
// host address, its other end eth0 in the namespace with the clone's address,
// lo up, a default route through the host end. CRIU runs inside it (its
// child calls setns before exec), so the sockets it restores are created
// there. The namespace has no name: once CRIU restored the clone, only the
// clone's processes hold it, and it goes when they exit (the kernel removes
// the veth pair with it). Until then nothing is left either if dvr fails or
// is killed: the helper exits when its socket closes, the descriptor closes
// with dvr, and a failed clone deletes the host end at once.
// `--net NAME`: the existing namespace /run/netns/NAME (or a path), entered
// the same way; it is the caller's and is left as it is.
//
// Files. CRIU restores a listening Unix socket by unlinking whatever socket
// is at its path and binding a new one (criu/sk-unix.c, unlink_sk and
// bind_unix_sk): beside a running original that deletes the original's
// socket file and takes its address. So CRIU's child unshares its mount
// namespace and covers each directory that holds one of the job's named Unix
// sockets with a tmpfs into which every other entry of the directory is bound
// back (symbolic links recreated): the clone sees the same files, but the
// job's sockets are new, its own, and what it creates there stays private.
// The tmpfs is a mount of that namespace only, which goes with the clone.
#include "proc/netns.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <linux/nsfs.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "dvr/clone.hpp"
#include "proc/criu_runner.hpp"
#include "proc/heap_seal.hpp"
#include "store/store_impl.hpp"

namespace dvr::proc::impl {

namespace {

using detail::Fd;

// The interface of the clone's end, inside its namespace.
constexpr const char* kCloneIf = "eth0";
// Where `--net new` without --ip takes a /30 from.
constexpr std::uint32_t kAutoNet = 0x0ad50000;  // 10.213.0.0/16
constexpr int kAutoPrefix = 16;
// Serializes the choice of addresses between concurrent clones.
constexpr const char* kLockFile = "/run/dvr-clone-net.lock";

// ---- protobuf, as far as CRIU's unix socket entries need it

struct Pb {
  const unsigned char* p;
  const unsigned char* end;

  bool varint(std::uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64 && p < end; shift += 7) {
      unsigned char b = *p++;
      v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }
  // The next field: its number and wire type, with its value (varint) or
  // bytes (length-delimited). False at the end or on malformed data.
  bool next(std::uint64_t& field, std::uint64_t& value, std::string_view& bytes) {
    std::uint64_t key;
    if (p >= end || !varint(key)) return false;
    field = key >> 3;
    switch (key & 7) {
      case 0:
        return varint(value);
      case 1:
        if (end - p < 8) return false;
        p += 8;
        return true;
      case 5:
        if (end - p < 4) return false;
        p += 4;
        return true;
      case 2: {
        std::uint64_t n;
        if (!varint(n) || n > static_cast<std::uint64_t>(end - p)) return false;
        bytes = std::string_view(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n));
        p += n;
        return true;
      }
      default:
        return false;
    }
  }
};

Pb pb_of(std::string_view s) {
  auto* b = reinterpret_cast<const unsigned char*>(s.data());
  return {b, b + s.size()};
}

// unix_sk_entry (images/sk-unix.proto): name = 11, name_dir = 14.
void add_unix_entry(std::string_view msg, std::vector<std::string>& out) {
  Pb pb = pb_of(msg);
  std::uint64_t field = 0, value = 0;
  std::string_view bytes, name, name_dir;
  while (pb.next(field, value, bytes)) {
    if (field == 11) name = bytes;
    if (field == 14) name_dir = bytes;
  }
  if (name.empty() || name[0] == '\0') return;  // unnamed or abstract
  std::string path(name.substr(0, name.find('\0')));
  if (path[0] != '/') {
    if (name_dir.empty() || name_dir[0] != '/') return;  // nowhere we can tell
    path = std::string(name_dir) + "/" + path;
  }
  if (std::find(out.begin(), out.end(), path) == out.end()) out.push_back(path);
}

std::string errno_text(int e) { return std::strerror(e); }

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

bool is_executable(const std::string& p) { return ::access(p.c_str(), X_OK) == 0; }

// iproute2's ip: on $PATH or in the sbin directories.
std::string find_ip() {
  std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  path += ":/usr/sbin:/sbin:/usr/bin:/bin";
  std::istringstream in(path);
  std::string d;
  while (std::getline(in, d, ':'))
    if (!d.empty() && is_executable(d + "/ip")) return d + "/ip";
  return "";
}

// The IPv4 networks of this host's interfaces, and its routes (default
// routes left out).
std::vector<Ipv4Prefix> host_addresses() {
  std::vector<Ipv4Prefix> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || !a->ifa_netmask) continue;
    std::uint32_t addr = ntohl(reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr);
    std::uint32_t mask = ntohl(reinterpret_cast<sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr);
    out.push_back({addr, __builtin_popcount(mask)});
  }
  ::freeifaddrs(list);
  return out;
}

std::vector<Ipv4Prefix> host_routes() {
  std::vector<Ipv4Prefix> out;
  std::ifstream in("/proc/net/route");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string ifname, dest, gw, flags, refcnt, use, metric, mask;
    if (!(f >> ifname >> dest >> gw >> flags >> refcnt >> use >> metric >> mask)) continue;
    // The kernel prints the network-order value as a native integer.
    auto net = static_cast<std::uint32_t>(std::strtoul(dest.c_str(), nullptr, 16));
    auto m = static_cast<std::uint32_t>(std::strtoul(mask.c_str(), nullptr, 16));
    int prefix = __builtin_popcount(m);
    if (prefix > 0) out.push_back({ntohl(net), prefix});
  }
  return out;
}

// What on this host uses an address of `net` ("" if nothing): an interface's
// address, by the interface's name.
std::string address_user(const Ipv4Prefix& net) {
  std::string who;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return who;
  for (ifaddrs* a = list; a && who.empty(); a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || !a->ifa_netmask) continue;
    Ipv4Prefix x{ntohl(reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr),
                 __builtin_popcount(ntohl(reinterpret_cast<sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr))};
    if (x.overlaps(net)) who = x.text() + " on " + a->ifa_name;
  }
  ::freeifaddrs(list);
  return who;
}

// A netns name of `ip netns` (/run/netns/NAME): no path, nothing odd.
bool plain_netns_name(const std::string& n) {
  if (n.empty() || n == "." || n == ".." || n.size() > 200) return false;
  return std::all_of(n.begin(), n.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'; });
}

// In CRIU's child, after fork: says what failed on stderr (captured as
// CRIU's output, quoted by restore()) and fails.
bool child_failed(const char* what, const std::string& path) {
  int e = errno;
  std::string m = std::string("cannot ") + what + (path.empty() ? "" : " " + path) + ": " + std::strerror(e);
  (void)!::write(2, m.data(), m.size());
  return false;
}

}  // namespace

bool Ipv4Prefix::overlaps(const Ipv4Prefix& o) const {
  int p = std::min(prefix, o.prefix);
  std::uint32_t m = p == 0 ? 0u : ~0u << (32 - p);
  return (addr & m) == (o.addr & m);
}

std::string Ipv4Prefix::address() const {
  in_addr a{htonl(addr)};
  char buf[INET_ADDRSTRLEN];
  return ::inet_ntop(AF_INET, &a, buf, sizeof buf) ? buf : "";
}

std::string Ipv4Prefix::text() const { return address() + "/" + std::to_string(prefix); }

std::optional<Ipv4Prefix> parse_ipv4_prefix(const std::string& text, bool prefix_optional) {
  auto slash = text.find('/');
  if (slash == std::string::npos && !prefix_optional) return std::nullopt;
  std::string a = text.substr(0, slash);
  in_addr in{};
  if (a.empty() || ::inet_pton(AF_INET, a.c_str(), &in) != 1) return std::nullopt;
  Ipv4Prefix r{ntohl(in.s_addr), 32};
  if (slash != std::string::npos) {
    std::string p = text.substr(slash + 1);
    if (p.empty() || p.size() > 2 || !std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
    r.prefix = std::atoi(p.c_str());
    if (r.prefix > 32) return std::nullopt;
  }
  return r;
}

Ipv4Prefix host_end_for(const Ipv4Prefix& clone) {
  std::uint32_t first = clone.network() + 1;
  return {first == clone.addr ? first + 1 : first, clone.prefix};
}

std::vector<std::string> unix_socket_paths(std::string_view image, bool file_entries) {
  std::vector<std::string> out;
  // Two magics (IMG_COMMON_MAGIC, the image's own), then records: a
  // little-endian u32 length and that many bytes of protobuf.
  std::size_t off = 8;
  while (off + 4 <= image.size()) {
    auto* b = reinterpret_cast<const unsigned char*>(image.data() + off);
    std::size_t n = b[0] | (std::size_t{b[1]} << 8) | (std::size_t{b[2]} << 16) | (std::size_t{b[3]} << 24);
    off += 4;
    if (n > image.size() - off) break;
    std::string_view msg = image.substr(off, n);
    off += n;
    if (!file_entries) {
      add_unix_entry(msg, out);
      continue;
    }
    // file_entry (images/fdinfo.proto): type = 1 (UNIXSK = 5), usk = 16.
    Pb pb = pb_of(msg);
    std::uint64_t field = 0, value = 0, type = 0;
    std::string_view bytes, usk;
    while (pb.next(field, value, bytes)) {
      if (field == 1) type = value;
      if (field == 16) usk = bytes;
    }
    if (type == 5 && !usk.empty()) add_unix_entry(usk, out);
  }
  return out;
}

// ---- CloneView

CloneView::CloneView(const Store& store, const std::string& name, const ProcInfo& p, const RestoreOptions& options)
    : clone_(options.clone), what_(std::string("cannot ") + (options.clone ? "clone" : "restore") + " process snapshot '" + name + "'") {
  if (!clone_) {
    if (!options.net.empty() || !options.ip.empty() || !options.host_ip.empty())
      throw Error(Errc::invalid_argument, "--net, --ip and --host-ip are for clones (`dvr proc clone " + name +
                                              " --net new`); a restore takes the host's network, as the dumped job had (nothing was changed)");
    return;
  }
  for (auto& h : p.heaps) {
    std::string d = dir_of(h.path);
    if (std::find(heap_dirs_.begin(), heap_dirs_.end(), d) == heap_dirs_.end()) heap_dirs_.push_back(d);
    // A heap sealed at the dump lies in place in a heap pack: the clone maps
    // that file copy-on-write instead of a private copy (the plugin checks
    // every page of it before CRIU maps it).
    try {
      detail::heaps::HeapFile f = detail::heaps::heap_file_of(h.path);
      f.bytes = h.bytes;
      const std::string snapshot = std::string(kHeapPrefix) + name;
      Store heap_store = Store::open(detail::heaps::heap_store(f, snapshot, store.path()), {.create = false});
      detail::StoreImpl& si = detail::impl_of(heap_store);
      const detail::Manifest m = si.load_manifest(f.session, snapshot, nullptr, false);
      if (std::uint32_t pack = detail::heaps::in_place_pack(m, f.region, f.bytes, *si.packs))
        sealed_heaps_.emplace_back(h.path, si.packs->heap_path_of(pack));
    } catch (const Error&) {
      // Not sealed, or unreadable: the plugin copies it (and reports what is wrong).
    }
  }
  check_network(options);
  // The job's Unix sockets, from its CRIU images (read unchecked: they only
  // say which directories the clone sees privately; the restore checks every
  // byte before CRIU reads it).
  Clone peek = store.open_snapshot(kImageSession, name, {.verify = false});
  for (Region* r : peek.regions())
    if (r->name() == "files.img" || r->name() == "unixsk.img")
      for (auto& s : unix_socket_paths(std::string_view(static_cast<const char*>(r->data()), r->size()), r->name() == "files.img"))
        if (std::find(sockets_.begin(), sockets_.end(), s) == sockets_.end()) sockets_.push_back(s);
  for (auto& s : sockets_)
    if (dir_of(s).empty() || dir_of(s) == "/")
      throw Error(Errc::unsupported, what_ + ": its Unix socket " + s +
                                         " lies in /, and a clone can only keep the original's sockets apart in a directory "
                                         "of their own; have the job put its socket in a directory (nothing was changed)");
}

CloneView::~CloneView() {
  if (!kept_ && !host_if_.empty()) {
    try {
      std::string out;
      run_capture({ip_tool_, "link", "del", host_if_}, {}, &out);  // its peer goes with it
    } catch (const std::exception&) {
    }
  }
  stop_helper();
}

void CloneView::check_network(const RestoreOptions& options) {
  const std::string& what = what_;
  if (options.net != "new") {
    if (!options.ip.empty() || !options.host_ip.empty())
      throw Error(Errc::invalid_argument,
                  what + ": --ip and --host-ip need --net new" +
                      (options.net.empty() ? std::string(" (a clone without --net shares the host's network)")
                                           : "; the existing namespace " + options.net + " keeps the addresses it has (ip -n " + options.net +
                                                 " addr add ADDR/PREFIX dev IF sets one)") +
                      "; nothing was changed");
  }
  if (options.net.empty()) return;
  if (options.net == "new") {
    net_ = Net::fresh;
    if (!options.ip.empty()) {
      auto a = parse_ipv4_prefix(options.ip);
      if (!a || a->prefix < 1 || a->prefix > 30)
        throw Error(Errc::invalid_argument, what + ": --ip '" + options.ip +
                                                "' is not an IPv4 address with a prefix of 1 to 30 (ADDR/PREFIX, e.g. 10.213.0.2/24: "
                                                "the clone's end and the host's need two addresses of one network); nothing was changed");
      std::uint32_t bcast = a->network() | ~a->mask();
      if (a->addr == a->network() || a->addr == bcast)
        throw Error(Errc::invalid_argument, what + ": --ip " + options.ip + " is the " + (a->addr == bcast ? "broadcast" : "network") +
                                                " address of its network; give the clone a host address (e.g. " +
                                                Ipv4Prefix{a->network() + 2, a->prefix}.text() + "); nothing was changed");
      ip_ = *a;
      ip_given_ = true;
    }
    if (!options.host_ip.empty()) {
      auto h = parse_ipv4_prefix(options.host_ip, true);
      if (!h)
        throw Error(Errc::invalid_argument, what + ": --host-ip '" + options.host_ip + "' is not an IPv4 address (ADDR or ADDR/PREFIX); nothing was changed");
      if (!ip_given_)
        throw Error(Errc::invalid_argument, what + ": --host-ip needs --ip (the clone's address, whose network the host end joins); nothing was changed");
      bool with_prefix = options.host_ip.find('/') != std::string::npos;
      Ipv4Prefix hp{h->addr, ip_.prefix};
      std::uint32_t bcast = ip_.network() | ~ip_.mask();
      if ((with_prefix && h->prefix != ip_.prefix) || hp.network() != ip_.network() || h->addr == ip_.addr || h->addr == ip_.network() ||
          h->addr == bcast)
        throw Error(Errc::invalid_argument, what + ": --host-ip " + options.host_ip + " must be another host address of --ip " + ip_.text() +
                                                "'s network " + Ipv4Prefix{ip_.network(), ip_.prefix}.text() + "; nothing was changed");
      host_ip_ = hp;
      host_ip_given_ = true;
    }
    ip_tool_ = find_ip();
    if (ip_tool_.empty())
      throw Error(Errc::unsupported, what + " with --net new: the ip command (iproute2) was not found; install iproute2 "
                                            "(./install-deps.sh does); nothing was changed");
    return;
  }
  net_ = Net::existing;
  if (options.net.find('/') != std::string::npos) {
    netns_path_ = options.net;
  } else {
    if (!plain_netns_name(options.net))
      throw Error(Errc::invalid_argument, what + ": --net '" + options.net +
                                              "' is neither new nor the name of a network namespace (letters, digits, '-', '_', '.'; "
                                              "or a path such as /proc/PID/ns/net); nothing was changed");
    netns_path_ = "/run/netns/" + options.net;
  }
  netns_ = Fd(::open(netns_path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (!netns_) {
    int e = errno;
    if (e == ENOENT)
      throw Error(Errc::not_found, what + ": no network namespace " +
                                       (options.net.find('/') == std::string::npos
                                            ? "'" + options.net + "' (" + netns_path_ + " does not exist); create it with `ip netns add " + options.net +
                                                  "`, or use --net new for one made for the clone"
                                            : netns_path_ + " (it does not exist)") +
                                       "; nothing was changed");
    detail::throw_errno(e, what + ": cannot open network namespace " + netns_path_);
  }
  int type = ::ioctl(netns_.get(), NS_GET_NSTYPE);
  if (type != CLONE_NEWNET)
    throw Error(Errc::invalid_argument, what + ": " + netns_path_ + " is not a network namespace (" +
                                            (type < 0 ? errno_text(errno) : "another kind of namespace") + "); nothing was changed");
}

std::string CloneView::ip(const std::vector<std::string>& args, bool inside) {
  std::vector<std::string> argv{ip_tool_};
  argv.insert(argv.end(), args.begin(), args.end());
  std::string out;
  int fd = netns_.get();
  int rc = run_capture(argv, {}, &out, inside ? std::function<bool()>([fd] { return ::setns(fd, CLONE_NEWNET) == 0; }) : std::function<bool()>());
  if (rc != 0) {
    std::string cmd = "ip";
    for (auto& a : args) cmd += " " + a;
    throw Error(Errc::io, what_ + " with --net new: `" + cmd + "`" + (inside ? " in its namespace" : "") +
                              " failed (exit " + std::to_string(rc) + "): " + trimmed(out) + " (nothing of its network is left)");
  }
  return out;
}

void CloneView::stop_helper() {
  if (helper_ < 0) return;
  helper_sk_ = Fd();  // the helper reads EOF and exits
  int status = 0;
  while (::waitpid(helper_, &status, 0) < 0 && errno == EINTR) {
  }
  helper_ = -1;
}

void CloneView::make_network() {
  const std::string what = what_ + " with --net new";
  lock_ = Fd(::open(kLockFile, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!lock_) detail::throw_errno(errno, what + ": cannot open " + kLockFile);
  while (::flock(lock_.get(), LOCK_EX) != 0)
    if (errno != EINTR) detail::throw_errno(errno, what + ": cannot lock " + kLockFile);

  if (ip_given_) {
    Ipv4Prefix net{ip_.network(), ip_.prefix};
    std::string user = address_user(net);
    if (!user.empty())
      throw Error(Errc::already_exists, what + ": the network " + net.text() + " of --ip " + ip_.text() + " is in use on this host (" + user +
                                            (user.find(" on dvr") != std::string::npos ? ", another clone's" : "") +
                                            "); choose another --ip, or leave it out for a free one; nothing was changed");
  } else {
    std::vector<Ipv4Prefix> used = host_addresses();
    for (auto& r : host_routes())
      used.push_back(r);
    bool found = false;
    for (std::uint32_t n = kAutoNet; n < kAutoNet + (1u << (32 - kAutoPrefix)) && !found; n += 4) {
      Ipv4Prefix cand{n, 30};
      if (std::none_of(used.begin(), used.end(), [&](const Ipv4Prefix& u) { return u.overlaps(cand); })) {
        ip_ = {n + 2, 30};
        found = true;
      }
    }
    if (!found)
      throw Error(Errc::no_space, what + ": every /30 of " + Ipv4Prefix{kAutoNet, kAutoPrefix}.text() + " is in use on this host; give --ip ADDR/PREFIX");
  }
  if (!host_ip_given_) host_ip_ = host_end_for(ip_);

  // The namespace, held by a helper until its descriptor is ours and the
  // veth's end is in it (ip names the namespace by the helper's PID).
  int sk[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sk) != 0) detail::throw_errno(errno, what + ": cannot create a socket pair");
  pid_t h = ::fork();
  if (h < 0) {
    int e = errno;
    ::close(sk[0]);
    ::close(sk[1]);
    detail::throw_errno(e, what + ": cannot fork");
  }
  if (h == 0) {
    ::close(sk[0]);
    int err = ::unshare(CLONE_NEWNET) == 0 ? 0 : errno;
    (void)!::write(sk[1], &err, sizeof err);
    char c;
    for (;;) {  // until dvr closes its end (or dies)
      ssize_t k = ::read(sk[1], &c, 1);
      if (k < 0 && errno == EINTR) continue;
      break;
    }
    ::_exit(0);
  }
  ::close(sk[1]);
  helper_ = h;
  helper_sk_ = Fd(sk[0]);
  int err = -1;
  ssize_t n;
  while ((n = ::read(helper_sk_.get(), &err, sizeof err)) < 0 && errno == EINTR) {
  }
  if (n != sizeof err || err != 0)
    throw Error(err == EPERM ? Errc::permission : Errc::io,
                what + ": cannot create a network namespace (" + (n == sizeof err ? errno_text(err) : "the helper died") + "); nothing was changed");
  netns_ = Fd(::open(("/proc/" + std::to_string(h) + "/ns/net").c_str(), O_RDONLY | O_CLOEXEC));
  if (!netns_) detail::throw_errno(errno, what + ": cannot open the new network namespace");

  const std::string host_if = "dvr" + detail::random_hex().substr(0, 8);
  ip({"link", "add", host_if, "type", "veth", "peer", "name", kCloneIf, "netns", std::to_string(h)}, false);
  host_if_ = host_if;
  ip({"addr", "add", host_ip_.text(), "dev", host_if_}, false);
  ip({"link", "set", host_if_, "up"}, false);
  ip({"addr", "add", ip_.text(), "dev", kCloneIf}, true);
  ip({"link", "set", kCloneIf, "up"}, true);
  ip({"link", "set", "lo", "up"}, true);
  ip({"route", "add", "default", "via", host_ip_.address()}, true);
  stop_helper();
  lock_ = Fd();  // the host end holds its address now: the next clone sees it
}

std::vector<CloneView::Shadow> CloneView::shadows() const {
  std::vector<Shadow> out;
  auto covered_by_heap = [&](const std::string& d) {
    return std::any_of(heap_dirs_.begin(), heap_dirs_.end(), [&](const std::string& h) { return d == h || d.rfind(h + "/", 0) == 0; });
  };
  std::vector<std::pair<std::string, std::vector<std::string>>> dirs;  // real directory, the job's socket names in it
  for (auto& s : sockets_) {
    char real[PATH_MAX];
    if (!::realpath(dir_of(s).c_str(), real)) continue;  // CRIU will say what is missing
    std::string d = real, base = s.substr(s.rfind('/') + 1);
    if (d == "/" || covered_by_heap(d)) continue;
    auto it = std::find_if(dirs.begin(), dirs.end(), [&](auto& x) { return x.first == d; });
    if (it == dirs.end()) dirs.push_back({d, {base}});
    else it->second.push_back(base);
  }
  std::sort(dirs.begin(), dirs.end(), [](auto& a, auto& b) { return a.first.size() < b.first.size(); });
  for (auto& [d, names] : dirs) {
    Shadow sh;
    sh.dir = d;
    struct stat st {};
    if (::stat(d.c_str(), &st) != 0) continue;
    sh.mode = st.st_mode & 07777;
    sh.uid = st.st_uid;
    sh.gid = st.st_gid;
    DIR* dir = ::opendir(d.c_str());
    if (!dir) detail::throw_errno(errno, what_ + ": cannot list " + d + ", which holds its Unix sockets");
    while (dirent* e = ::readdir(dir)) {
      std::string n = e->d_name;
      if (n == "." || n == ".." || std::find(names.begin(), names.end(), n) != names.end()) continue;
      Entry en;
      en.name = n;
      struct stat es {};
      if (::lstat((d + "/" + n).c_str(), &es) != 0) continue;  // gone meanwhile
      if (S_ISDIR(es.st_mode)) {
        en.kind = Entry::dir;
      } else if (S_ISLNK(es.st_mode)) {
        en.kind = Entry::symlink;
        char buf[PATH_MAX];
        ssize_t k = ::readlink((d + "/" + n).c_str(), buf, sizeof buf);
        if (k < 0) continue;
        en.link.assign(buf, static_cast<std::size_t>(k));
      }
      sh.entries.push_back(std::move(en));
    }
    ::closedir(dir);
    out.push_back(std::move(sh));
  }
  return out;
}

std::function<bool()> CloneView::in_child() {
  if (!clone_) return {};
  if (net_ == Net::fresh) make_network();
  std::vector<Shadow> shadow = shadows();
  int netfd = netns_ ? netns_.get() : -1;
  return [netfd, shadow = std::move(shadow), heaps = heap_dirs_, sealed = sealed_heaps_] {
    if (netfd >= 0 && ::setns(netfd, CLONE_NEWNET) != 0) return child_failed("enter the clone's network namespace", "");
    if (::unshare(CLONE_NEWNS) != 0) return child_failed("create a mount namespace", "");
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return child_failed("make the mounts private", "");
    for (auto& s : shadow) {
      int dfd = ::open(s.dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
      if (dfd < 0) return child_failed("open", s.dir);
      char opts[96];
      std::snprintf(opts, sizeof opts, "mode=%o,uid=%u,gid=%u", static_cast<unsigned>(s.mode), static_cast<unsigned>(s.uid),
                    static_cast<unsigned>(s.gid));
      if (::mount("dvr-clone", s.dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, opts) != 0) return child_failed("cover with a tmpfs", s.dir);
      const std::string from = "/proc/self/fd/" + std::to_string(dfd) + "/";
      for (auto& e : s.entries) {
        std::string to = s.dir + "/" + e.name;
        if (e.kind == Entry::symlink) {
          if (::symlink(e.link.c_str(), to.c_str()) != 0) return child_failed("recreate the symbolic link", to);
          continue;
        }
        if (e.kind == Entry::dir ? ::mkdir(to.c_str(), 0700) != 0 : ::mknod(to.c_str(), S_IFREG | 0600, 0) != 0)
          return child_failed("create a mount point at", to);
        if (::mount((from + e.name).c_str(), to.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) return child_failed("bind back", to);
      }
      ::close(dfd);
    }
    for (auto& d : heaps)
      if (::mount("dvr-clone-heap", d.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700") != 0) return child_failed("cover with a tmpfs", d);
    for (auto& [file, pack] : sealed) {
      if (::mknod(file.c_str(), S_IFREG | 0600, 0) != 0) return child_failed("create a mount point at", file);
      if (::mount(pack.c_str(), file.c_str(), nullptr, MS_BIND, nullptr) != 0) return child_failed("bind its sealed heap pack at", file);
    }
    return true;
  };
}

void CloneView::report(RestoreResult& r) const {
  if (net_ == Net::host) return;
  r.net = net_ == Net::fresh ? "new" : netns_path_;
  if (net_ != Net::fresh) return;
  r.ip = ip_.text();
  r.host_ip = host_ip_.text();
  r.host_if = host_if_;
}

}  // namespace dvr::proc::impl
