// The negotiated transfer (dvr push / pull): the receiver first says which
// snapshots it holds, so that only what it lacks travels.
#include <sstream>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/os.hpp"
#include "store/store_impl.hpp"
#include "transfer/stream.hpp"
#include "dvr/proc.hpp"

namespace dvr::transfer {

using namespace internal;

namespace {

// ---- negotiation -------------------------------------------------------------
//
// sender -> receiver: kNegotiateMagic, u32 length, text:
//   "item SESSION NAME\n" then "have BASE FINGERPRINT-HEX\n" for candidate bases (newest first)
// receiver -> sender: u32 length, text: one line per item: "base NAME", "none", or
//   "exists" / "error MESSAGE" (the sender stops with that message)
// then the sender sends the stream (with the chosen bases), and the receiver
// answers u32 length + "ok JSON" or "error MESSAGE".

void send_text(int fd, const std::string& s) {
  std::uint32_t n = static_cast<std::uint32_t>(s.size());
  write_fd(fd, reinterpret_cast<const char*>(&n), 4);
  write_fd(fd, s.data(), s.size());
}

std::string recv_text(int fd) {
  char b[4];
  if (!read_fd(fd, b, 4, true)) throw Error(Errc::io, "the other end closed the connection (see its error message)");
  std::uint32_t n;
  std::memcpy(&n, b, 4);
  if (n > (16u << 20)) throw Error(Errc::corrupt, "the other end sent a malformed answer");
  std::string s(n, '\0');
  read_fd(fd, s.data(), n);
  return s;
}

std::string hex(const Hash128& h) { return detail::to_hex(h); }

// The commit number session/name's manifest header records; 0 when it
// records none (format < 4) or cannot be read.
std::uint64_t seq_of(const detail::StoreImpl& si, const std::string& session, const std::string& name) {
  try {
    detail::Fd fd = detail::open_or_throw(si.manifest_path(session, name), O_RDONLY);
    char head[128];
    const ssize_t n = ::pread(fd.get(), head, sizeof head, 0);
    return n > 0 ? detail::manifest_seq_hint(std::string_view(head, static_cast<std::size_t>(n))) : 0;
  } catch (const Error&) {
    return 0;
  }
}

std::string stats_json(const Stats& st) {
  std::ostringstream o;
  o << "{\"stored_bytes\":" << st.stored_bytes << ",\"chunks\":" << st.chunks << ",\"chunks_skipped\":" << st.chunks_skipped << "}";
  return o.str();
}

}  // namespace

Stats send_negotiated(const Store& store, const std::string& ref, int in, int out, const Options& options) {
  std::vector<Item> items = items_of(store, ref);
  std::string hello;
  for (auto& it : items) {
    hello += "item " + it.session + " " + it.name + "\n";
    // Candidate bases, newest first: ordered by the commit number each
    // manifest's header records, and only the newest 32 read whole (without
    // page hashes) for their fingerprints; damaged ones are not offered.
    // Manifests older than format 4 record no number: then all are read and
    // ordered as Store::list orders them.
    const detail::StoreImpl& si = detail::impl_of(it.store);
    const std::string want = base_in(ref, it.session, options.base);  // only the base asked for, when one was
    std::vector<std::pair<std::uint64_t, std::string>> newest;  // (seq, name)
    bool numbered = true;
    for (auto& name : si.snapshot_names(it.session)) {
      if (name == it.name || (!want.empty() && name != want)) continue;
      const std::uint64_t seq = seq_of(si, it.session, name);
      numbered = numbered && seq != 0;
      newest.emplace_back(seq, name);
    }
    if (!numbered) {
      std::vector<SnapshotInfo> infos;
      for (auto& [seq, name] : newest)
        try {
          infos.push_back(detail::info_from_manifest(si.load_manifest(it.session, name, nullptr, false)));
        } catch (const Error&) {
        }
      detail::order_snapshots(infos);
      // Keyed by place in that order: order_snapshots numbers the unnumbered
      // 1, 2, ..., which may equal a numbered snapshot's seq.
      newest.clear();
      for (std::size_t k = 0; k < infos.size(); ++k)
        newest.emplace_back(k + 1, infos[k].name);
    }
    std::sort(newest.begin(), newest.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    int offered = 0;
    for (auto& [seq, name] : newest) {
      if (offered == 32) break;
      try {
        hello += "have " + name + " " + hex(fingerprint_of(it.store, it.session, name)) + "\n";
        ++offered;
      } catch (const Error&) {
      }
    }
  }
  write_fd(out, kNegotiateMagic, 8);
  send_text(out, hello);
  std::istringstream answer(recv_text(in));
  std::vector<std::string> bases;
  std::string line;
  for (auto& it : items) {
    if (!std::getline(answer, line)) throw Error(Errc::io, "the receiver gave no answer for " + it.ref());
    if (line.rfind("error ", 0) == 0) throw Error(Errc::io, "the receiver refused: " + line.substr(6));
    if (line == "exists")
      throw Error(Errc::already_exists, "the receiving store holds snapshot '" + it.ref() + "' already; remove it there first — nothing was sent");
    std::string b = line.rfind("base ", 0) == 0 ? line.substr(5) : "";
    // Only a base that was offered for this item.
    if (!b.empty() && hello.find("item " + it.session + " " + it.name + "\n") != std::string::npos) {
      auto from = hello.find("item " + it.session + " " + it.name + "\n");
      auto to = hello.find("item ", from + 5);
      std::string offered = hello.substr(from, to == std::string::npos ? std::string::npos : to - from);
      if (offered.find("\nhave " + b + " ") == std::string::npos) throw Error(Errc::corrupt, "the receiver chose a base that was not offered");
    }
    bases.push_back(b);
  }
  if (!options.base.empty() && bases.back().empty())
    throw Error(Errc::not_found, "the receiving store does not hold base '" + options.base + "' with the same content; push without --base");
  Stats st;
  try {
    st = send_with(store, ref, out, options, bases);
  } catch (const Error& e) {
    // The receiver gave up while this side was still writing (a check
    // failed, its store is full): it said why before closing the stream.
    if (e.code() != Errc::io) throw;
    std::string why;
    try {
      why = recv_text(in);
    } catch (const Error&) {
    }
    if (why.rfind("error ", 0) == 0) throw Error(Errc::io, "the receiver failed: " + why.substr(6));
    throw;
  }
  std::string done = recv_text(in);
  if (done.rfind("error ", 0) == 0) throw Error(Errc::io, "the receiver failed: " + done.substr(6));
  // "ok {json}": the receiver's figures.
  auto grab = [&](const char* key) -> std::uint64_t {
    auto k = done.find(std::string("\"") + key + "\":");
    return k == std::string::npos ? 0 : std::strtoull(done.c_str() + k + std::strlen(key) + 3, nullptr, 10);
  };
  st.stored_bytes = grab("stored_bytes");
  return st;
}

Stats receive_negotiated(Store& store, int in, int out, const ReceiveOptions& options) {
  if (!options.session.empty())
    throw Error(Errc::invalid_argument, "receive_negotiated keeps the sender's session names; ReceiveOptions::session must be empty, not '" +
                                            options.session + "'");
  char magic[8];
  if (!read_fd(in, magic, 8, true)) throw Error(Errc::io, "the sending side ended before the transfer started (its message is above)");
  if (std::memcmp(magic, kNegotiateMagic, 8) != 0)
    throw Error(Errc::corrupt, "the sender does not speak the Memory DVR negotiation (is it `dvr send --negotiate`?)");
  std::istringstream hello(recv_text(in));
  std::string answer, line, session, name;
  bool chosen = false;
  auto close_item = [&] {
    if (!session.empty() && !chosen) answer += "none\n";
  };
  std::string error;
  while (std::getline(hello, line)) {
    std::istringstream f(line);
    std::string word;
    f >> word;
    if (word == "item") {
      close_item();
      f >> session >> name;
      chosen = false;
      try {
        detail::check_name("session", session);
        detail::check_name("snapshot", name);
        if (has_snapshot(store, session, name)) {
          answer += "exists\n";
          chosen = true;
        }
      } catch (const Error& e) {
        answer += std::string("error ") + e.what() + "\n";
        chosen = true;
      }
    } else if (word == "have" && !chosen) {
      std::string b, fp;
      f >> b >> fp;
      try {
        if (has_snapshot(store, session, b) && hex(fingerprint_of(store, session, b)) == fp) {
          answer += "base " + b + "\n";
          chosen = true;
        }
      } catch (const Error&) {
      }
    }
  }
  close_item();
  send_text(out, answer);
  if (answer.find("exists\n") != std::string::npos) throw Error(Errc::already_exists, "refused the transfer: " + answer);
  if (answer.find("error ") != std::string::npos) throw Error(Errc::invalid_argument, "refused the transfer: " + answer);
  try {
    RecordReader rd(in);
    Stats st = receive_stream(store, rd, options);
    send_text(out, "ok " + stats_json(st));
    return st;
  } catch (const std::exception& e) {
    try {
      send_text(out, std::string("error ") + e.what());
    } catch (...) {
    }
    throw;
  }
}

}  // namespace dvr::transfer
