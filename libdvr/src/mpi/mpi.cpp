// Coordinated snapshots across MPI ranks with partner copies (dvr/mpi.hpp,
// docs/mpi.md).
//
// Per rank, in its own store:
//   SESSION/NAME                 its part of global snapshot NAME
//   mpi/SESSION/NAME.commit      the commit record ("seq N"), written only
//                                after every rank voted yes; fsynced
//   SESSION.rank-C/NAME          the copy of rank C's part it keeps as C's partner
// Partner copies travel as transfer streams (verified chunk by chunk, only
// what the partner lacks), carried by MPI messages.
#include "dvr/mpi.hpp"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <thread>

#include "dvr/transfer.hpp"
#include "base/os.hpp"  // the file helpers (linked from base/os.cpp, libdvr/CMakeLists.txt)

namespace dvr::mpi {

namespace {

constexpr int kTagStream = 0x4456;  // "DV"
constexpr int kTagList = 0x4457;
constexpr int kMaxSeqs = 64;  // seqs exchanged per rank in restore_latest()
constexpr int kMsg = 512;     // bytes of an error message exchanged
constexpr std::size_t kChannelBytes = 16u << 20;  // a stream's bytes queued between a rank's threads, each way
constexpr int kInFlight = 8;                       // messages of a stream sent and not yet received

// How long the stores this layer opens itself (the receivers of partner
// copies) wait for a store lock. Every call here is collective: a rank waiting
// for a lock forever holds up every rank, silently. The holder may be a
// process stopped or frozen inside a snapshot, gc or remove of this store, or
// another rank (ranks that share one store, against docs/mpi.md, wait for each
// other's receive while their exchanges wait on them). Bounded, the rank fails
// with the store's "stayed locked ... try again" error and every rank throws
// it (all_or_throw); a partner copy that was not received is only missing, the
// global snapshot stays committed. Other processes' snapshots and gc take
// seconds, far less than this.
constexpr std::chrono::milliseconds kLockTimeout{60000};

Store open_bounded(const Store& store) { return Store::open(store.path(), {.create = false, .lock_timeout = kLockTimeout}); }

double since(std::chrono::steady_clock::time_point t) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); }

// The same error on every rank: messages of the failing ranks gathered.
[[noreturn]] void fail_all(MPI_Comm comm, int size, bool ok, const std::string& mine, const std::string& what) {
  std::vector<char> all(static_cast<std::size_t>(size) * kMsg, 0), buf(kMsg, 0);
  if (!ok) std::strncpy(buf.data(), mine.c_str(), kMsg - 1);
  MPI_Allgather(buf.data(), kMsg, MPI_CHAR, all.data(), kMsg, MPI_CHAR, comm);
  std::string msg = what + ":";
  for (int r = 0; r < size; ++r)
    if (all[static_cast<std::size_t>(r) * kMsg])
      msg += "\n  rank " + std::to_string(r) + ": " + std::string(&all[static_cast<std::size_t>(r) * kMsg]);
  throw Error(Errc::io, msg);
}

// Runs a collective step: `f` on this rank, then everyone learns whether all
// succeeded; on any failure every rank throws the gathered messages.
void all_or_throw(MPI_Comm comm, int size, const std::string& what, const std::function<void()>& f) {
  std::string mine;
  int ok = 1;
  try {
    f();
  } catch (const std::exception& e) {
    ok = 0;
    mine = e.what();
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, comm);
  if (!all) fail_all(comm, size, ok, mine, what);
}

// Waiting on MPI without taking a core: a few yields, then short sleeps,
// longer once nothing has happened for a while. Ranks are often
// oversubscribed (more ranks and stream threads than cores), and MPI's own
// waits poll and yield on the core that the ranks still working need.
struct Backoff {
  int idle = 0;
  void reset() { idle = 0; }
  void wait() {
    if (++idle < 3)
      sched_yield();
    else
      ::usleep(idle < 256 ? 20 : 200);
  }
};

// MPI_Wait for `req`, waiting as Backoff does.
void wait_quietly(MPI_Request& req) {
  Backoff b;
  for (;;) {
    int done = 0;
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (done) return;
    b.wait();
  }
}

// Sends the stream `produce` writes into a channel to rank `dest`, and gives
// the stream that arrives from rank `source` to `consume` through another;
// either may be empty (nothing to send / receive). Both directions run at
// once, so that pairs of ranks sending to each other cannot deadlock. Returns
// the bytes sent; an exception of either side is rethrown after both streams
// ended.
//
// `produce` and `consume` run on threads of their own; this thread is the
// only one that calls MPI. It sends each buffer the producer's channel hands
// over as one message, straight from that buffer (up to kInFlight at once),
// and gives it back once sent; each message that arrives goes into the
// consumer's channel as it is. The buffers are moved between the threads
// (only the receiving stream's reader copies records out of them): through
// pipes, the bytes crossed the kernel four times per copy (the stream's
// writer into a pipe, this loop out of it; this loop into the other pipe, the
// stream's reader out of it), 29% of the CPU time of a first checkpoint
// (docs/mpi.md, "The first checkpoint"). A consumer
// that falls behind (its channel full) leaves the next message waiting in
// MPI, which holds up its sender, not this loop: the other direction goes on.
std::uint64_t exchange(MPI_Comm comm, int dest, const std::function<void(transfer::Channel&)>& produce, int source,
                       const std::function<void(transfer::Channel&)>& consume) {
  transfer::Channel out(kChannelBytes), in(kChannelBytes);
  std::exception_ptr produce_error, consume_error;
  std::thread producer, consumer;
  if (produce)
    producer = std::thread([&] {
      try {
        produce(out);
      } catch (...) {
        produce_error = std::current_exception();
      }
      out.close();  // end of stream (a truncated one after an error: the receiver refuses it)
    });
  if (consume)
    consumer = std::thread([&] {
      try {
        consume(in);
      } catch (...) {
        consume_error = std::current_exception();
      }
      in.abandon();  // what else arrives is dropped, so the sender is never held up
    });
  struct Send {
    std::string buf;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  std::vector<Send> sends(kInFlight);
  std::uint64_t sent = 0;
  int in_flight = 0;
  bool final_sent = !produce;  // the empty message that ends the stream is under way
  bool recv_done = !consume;
  Backoff idle;
  while (!final_sent || in_flight > 0 || !recv_done) {
    bool progress = false;
    for (auto& x : sends) {
      if (x.req == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&x.req, &done, MPI_STATUS_IGNORE);
      if (done) {
        --in_flight;
        out.give_back(std::move(x.buf));
        x.buf = std::string();
        progress = true;
      }
    }
    while (!final_sent && in_flight < kInFlight) {
      Send& x = *std::find_if(sends.begin(), sends.end(), [](const Send& y) { return y.req == MPI_REQUEST_NULL; });
      if (!out.take(x.buf, false)) {
        if (!out.ended()) break;  // nothing yet
        x.buf.clear();
        final_sent = true;
      }
      sent += x.buf.size();
      MPI_Isend(x.buf.data(), static_cast<int>(x.buf.size()), MPI_BYTE, dest, kTagStream, comm, &x.req);
      ++in_flight;
      progress = true;
    }
    while (!recv_done && !in.full()) {
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(source, kTagStream, comm, &flag, &st);
      if (!flag) break;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      std::string buf = in.reuse();
      buf.resize(static_cast<std::size_t>(count));
      MPI_Recv(buf.data(), count, MPI_BYTE, source, kTagStream, comm, MPI_STATUS_IGNORE);
      progress = true;
      if (count == 0) {
        recv_done = true;
        in.close();
        break;
      }
      try {
        in.put(std::move(buf));  // does not wait: only this thread puts, and the channel was not full
      } catch (const Error&) {
        // The consumer is gone (abandoned): dropped.
      }
    }
    // Waiting leaves the CPU to the stream's own threads and other ranks.
    if (progress)
      idle.reset();
    else
      idle.wait();
  }
  if (producer.joinable()) producer.join();
  if (consumer.joinable()) consumer.join();
  if (produce_error) std::rethrow_exception(produce_error);
  if (consume_error) std::rethrow_exception(consume_error);
  return sent;
}

// Sends a list of strings to `dest` and receives one from `source`.
std::vector<std::string> swap_lists(MPI_Comm comm, int dest, const std::vector<std::string>& mine, int source) {
  std::string flat;
  for (auto& s : mine)
    flat += s + '\n';
  MPI_Request req;
  MPI_Isend(flat.data(), static_cast<int>(flat.size()), MPI_CHAR, dest, kTagList, comm, &req);
  MPI_Status st;
  MPI_Probe(source, kTagList, comm, &st);
  int count = 0;
  MPI_Get_count(&st, MPI_CHAR, &count);
  std::string got(static_cast<std::size_t>(count), '\0');
  MPI_Recv(got.data(), count, MPI_CHAR, source, kTagList, comm, MPI_STATUS_IGNORE);
  MPI_Wait(&req, MPI_STATUS_IGNORE);
  std::vector<std::string> out;
  std::size_t at = 0;
  for (std::size_t nl; (nl = got.find('\n', at)) != std::string::npos; at = nl + 1)
    out.push_back(got.substr(at, nl - at));
  return out;
}

}  // namespace

struct Session::State {
  Store store;
  std::string name;
  MPI_Comm comm;
  Options options;
  int rank = 0, size = 1, partner = 0, client = 0;
  dvr::Session local;
  // Handles of this rank's store for the threads that stream partner copies
  // while `local` snapshots into `store`: reading the base's tables (reader)
  // and receiving the client's copies (copies).
  std::optional<Store> reader, copies;
  State(Store s, std::string n, MPI_Comm c, const Options& o) : store(s), name(std::move(n)), comm(c), options(o), local(s, name) {}

  std::string records_dir() const { return store.path() + "/mpi/" + name; }
  std::string copies_session(int of) const { return name + ".rank-" + std::to_string(of); }

  // Commit records: name -> seq.
  std::map<std::string, std::uint64_t> records() const {
    std::map<std::string, std::uint64_t> out;
    for (auto& f : detail::list_dir(records_dir())) {
      if (f.size() < 8 || f.compare(f.size() - 7, 7, ".commit") != 0) continue;
      try {
        std::string text = detail::read_file(records_dir() + "/" + f);
        if (text.rfind("seq ", 0) == 0) out[f.substr(0, f.size() - 7)] = std::stoull(text.substr(4));
      } catch (const std::exception&) {
        // unreadable: as if not committed
      }
    }
    return out;
  }
  void record(const std::string& snapshot, std::uint64_t seq) {
    detail::make_private_dir(store.path() + "/mpi");
    detail::make_private_dir(records_dir());
    detail::write_file_atomic(records_dir(), records_dir() + "/" + snapshot + ".commit", "seq " + std::to_string(seq) + "\n");
  }
  // Whether `session` holds `snapshot` intact: its manifest alone is read and
  // checked (listing the session would read every manifest in it, for every
  // name asked about).
  bool has(const std::string& session, const std::string& snapshot) const {
    try {
      store.info(session, snapshot);
      return true;
    } catch (const Error&) {
      return false;  // missing, or damaged: as the session's list marks it
    }
  }
};

Session::Session(Store store, std::string name, MPI_Comm comm, const Options& options)
    : state_(std::make_unique<State>(std::move(store), std::move(name), comm, options)) {
  MPI_Comm_rank(comm, &state_->rank);
  MPI_Comm_size(comm, &state_->size);
  int offset = options.partner_offset > 0 ? options.partner_offset % state_->size : state_->size / 2;
  if (offset == 0) offset = state_->size > 1 ? 1 : 0;
  state_->partner = (state_->rank + offset) % state_->size;
  state_->client = (state_->rank - offset + state_->size) % state_->size;
  if (state_->partner == state_->rank) state_->options.partner_copies = false;  // one rank: no partner
}

Session::~Session() = default;
dvr::Session& Session::local() { return state_->local; }
int Session::rank() const { return state_->rank; }
int Session::size() const { return state_->size; }
int Session::partner() const { return state_->partner; }

std::vector<GlobalInfo> Session::committed() const {
  std::vector<GlobalInfo> out;
  for (auto& [n, seq] : state_->records())
    out.push_back({.name = n, .seq = seq});
  std::sort(out.begin(), out.end(), [](const GlobalInfo& a, const GlobalInfo& b) { return a.seq < b.seq; });
  return out;
}

GlobalInfo Session::snapshot(const std::string& name) {
  State& st = *state_;
  const auto t0 = std::chrono::steady_clock::now();
  GlobalInfo info;
  info.name = name;
  std::uint64_t my_max = 0, max_seq = 0;
  const auto recs = st.records();
  for (auto& [n, s] : recs)
    my_max = std::max(my_max, s);
  MPI_Allreduce(&my_max, &max_seq, 1, MPI_UINT64_T, MPI_MAX, st.comm);
  info.seq = max_seq + 1;
  const bool exists = recs.count(name) != 0;

  // What the partner holds of this rank's parts: the copy is sent relative to
  // the newest of them that this rank still has (none: everything is sent).
  const bool copies = st.options.partner_copies;
  std::string base;
  if (copies) {
    std::vector<std::string> held;
    try {
      for (auto& i : st.store.list(st.copies_session(st.client)))
        if (!i.damaged) held.push_back(i.name);
    } catch (const std::exception&) {
      // Unreadable here: the client sends everything (and learns why when
      // its copy cannot be stored either).
    }
    std::uint64_t base_seq = 0;
    for (auto& h : swap_lists(st.comm, st.client, held, st.partner))
      if (auto it = recs.find(h); it != recs.end() && it->first != name && it->second > base_seq && st.has(st.name, h)) {
        base = h;
        base_seq = it->second;
      }
  }

  // Phase 1: every rank snapshots its part locally (on a thread of its own)
  // while its partner copy streams from the same memory to the partner, and
  // its client's copy arrives (docs/mpi.md, "The protocol").
  bool took = false;
  std::string received;      // the client's copy that arrived ("session/name")
  std::string mine;          // this rank's local failure
  std::string copy_failure;  // this rank's partner-copy failure
  auto local = [&] {
    const auto tl = std::chrono::steady_clock::now();
    try {
      if (exists) throw Error(Errc::already_exists, "global snapshot '" + name + "' exists already");
      // A part without a commit record is the leftover of an attempt that was
      // never committed (a crash between the vote and the records): replaced.
      info.stored_bytes = st.local.snapshot(name, {.replace = true}).stored_bytes;
      took = true;
    } catch (const std::exception& e) {
      mine = e.what();
      if (mine.empty()) mine = "unknown error";
    }
    info.local_seconds = since(tl);
  };
  if (!copies) {
    local();
  } else {
    const auto tp = std::chrono::steady_clock::now();
    try {
      // A copy of this name kept for the client without a commit record is
      // the leftover of an attempt that was never committed: it goes first.
      if (!exists && st.has(st.copies_session(st.client), name)) st.store.remove(st.copies_session(st.client), name);
    } catch (const std::exception& e) {
      copy_failure = e.what();
    }
    // Handles of their own (their own lock and mutex) for the threads that
    // read the base and receive the client's copy while this rank's own
    // snapshot holds st.store; their lock waits are bounded (kLockTimeout).
    // Opened once and kept: a fresh handle would load the chunk index and
    // map the packs again for every copy.
    std::exception_ptr open_error;
    try {
      if (!st.reader) st.reader = open_bounded(st.store);
      if (!st.copies) st.copies = open_bounded(st.store);
    } catch (...) {
      open_error = std::current_exception();
    }
    const std::vector<Region*> regions = st.local.regions();
    std::promise<void> local_finished;
    std::shared_future<void> local_done = local_finished.get_future().share();
    std::thread local_thread([&] {
      local();
      local_finished.set_value();
    });
    transfer::Options topt;
    topt.base = base;
    topt.level = st.options.level;
    // Waits for this rank's own part; the copy is sent only if it was stored.
    auto own_part_stored = [&] {
      local_done.wait();
      if (!took) throw Error(Errc::io, "rank " + std::to_string(st.rank) + "'s own part failed, so its partner copy was not completed");
    };
    try {
      info.partner_bytes = exchange(
          st.comm, st.partner,
          [&](transfer::Channel& ch) {
            if (open_error) std::rethrow_exception(open_error);
            if (!base.empty()) {
              // A later checkpoint: the part, once stored, against the base
              // the partner holds. Its chunk tables and page hashes say what
              // differs, so only the pages written since are read; streaming
              // from memory would hash every page of every region again
              // (docs/mpi.md, "Later checkpoints").
              own_part_stored();
              transfer::send(*st.reader, st.name + "/" + name, ch, topt);
              return;
            }
            transfer::send_live(*st.reader, st.name, regions, name, ch, topt, [&](const std::string& sent) {
              // The stream ends only once the local part is stored and holds
              // exactly what was sent; else the partner stores nothing.
              own_part_stored();
              if (transfer::fingerprint(*st.reader, st.name + "/" + name) != sent)
                throw Error(Errc::io, "rank " + std::to_string(st.rank) +
                                          "'s regions changed while global snapshot '" + name +
                                          "' was taken (no thread may write them during snapshot()): its partner copy was not completed");
            });
          },
          st.client,
          [&](transfer::Channel& ch) {
            // Into this store once its own part is in: one writer at a time.
            local_done.wait();
            if (open_error) std::rethrow_exception(open_error);
            received = transfer::receive(*st.copies, ch, {.session = st.copies_session(st.client)}).refs.at(0);
          });
    } catch (const std::exception& e) {
      if (copy_failure.empty()) copy_failure = e.what();
    }
    local_thread.join();
    info.partner_seconds = since(tp);
  }
  // The vote on the local parts.
  int ok = took ? 1 : 0, all = 0;
  const auto tv = std::chrono::steady_clock::now();
  // Ranks done early wait here for the others without taking their cores.
  MPI_Request vote;
  MPI_Iallreduce(&ok, &all, 1, MPI_INT, MPI_MIN, st.comm, &vote);
  wait_quietly(vote);
  info.vote_seconds = since(tv);
  if (!all) {
    // Not committed anywhere: the parts that were taken go again, and the
    // copies that arrived for them.
    try {
      if (took) st.store.remove(st.name, name);
    } catch (const Error&) {
    }
    try {
      // By the name it arrived under (the client's, should the ranks' names differ).
      if (!received.empty()) {
        auto [session, copy] = split_ref(received);
        st.store.remove(session, copy);
      }
    } catch (const Error&) {
    }
    fail_all(st.comm, st.size, ok, mine, "global snapshot '" + name + "' of session '" + st.name + "' failed and was not committed");
  }
  // Phase 2: the commit records.
  const auto tc = std::chrono::steady_clock::now();
  all_or_throw(st.comm, st.size, "global snapshot '" + name + "' could not be recorded as committed on every rank",
               [&] { st.record(name, info.seq); });
  info.commit_seconds = since(tc);
  // The partner copies' outcome, known since phase 1: the snapshot is
  // committed (complete locally everywhere) either way.
  if (copies)
    all_or_throw(st.comm, st.size, "the partner copies of global snapshot '" + name + "' failed (it is committed; the copies are not)", [&] {
      if (!copy_failure.empty()) throw Error(Errc::io, copy_failure);
    });

  // Retention: the newest `keep` global snapshots, own parts and copies.
  const auto tr = std::chrono::steady_clock::now();
  if (st.options.keep > 0) {
    std::vector<std::pair<std::uint64_t, std::string>> by_seq;
    for (auto& [n, s] : st.records())
      by_seq.emplace_back(s, n);
    std::sort(by_seq.rbegin(), by_seq.rend());
    for (std::size_t k = st.options.keep; k < by_seq.size(); ++k) {
      const std::string& old = by_seq[k].second;
      try {
        if (st.has(st.name, old)) st.store.remove(st.name, old);
        if (st.has(st.copies_session(st.client), old)) st.store.remove(st.copies_session(st.client), old);
        ::unlink((st.records_dir() + "/" + old + ".commit").c_str());
      } catch (const Error&) {
      }
    }
  }
  info.retention_seconds = since(tr);
  info.seconds = since(t0);
  return info;
}

std::optional<std::string> Session::restore_latest() {
  State& st = *state_;
  // What each rank can give: its own committed, intact parts, and the parts
  // it keeps for its client.
  auto recs = st.records();
  std::vector<std::uint64_t> own(kMaxSeqs, 0), held(kMaxSeqs, 0);
  {
    std::vector<std::uint64_t> a, b;
    for (auto& [n, s] : recs) {
      if (st.has(st.name, n)) a.push_back(s);
      if (st.options.partner_copies && st.has(st.copies_session(st.client), n)) b.push_back(s);
    }
    std::sort(a.rbegin(), a.rend());
    std::sort(b.rbegin(), b.rend());
    std::copy_n(a.begin(), std::min<std::size_t>(a.size(), kMaxSeqs), own.begin());
    std::copy_n(b.begin(), std::min<std::size_t>(b.size(), kMaxSeqs), held.begin());
  }
  const auto n = static_cast<std::size_t>(st.size);
  std::vector<std::uint64_t> all_own(n * kMaxSeqs), all_held(n * kMaxSeqs);
  MPI_Allgather(own.data(), kMaxSeqs, MPI_UINT64_T, all_own.data(), kMaxSeqs, MPI_UINT64_T, st.comm);
  MPI_Allgather(held.data(), kMaxSeqs, MPI_UINT64_T, all_held.data(), kMaxSeqs, MPI_UINT64_T, st.comm);
  auto in = [&](const std::vector<std::uint64_t>& v, int r, std::uint64_t s) {
    auto b = v.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * kMaxSeqs);
    return s != 0 && std::find(b, b + kMaxSeqs, s) != b + kMaxSeqs;
  };
  auto partner_of = [&](int r) {
    int offset = (st.partner - st.rank + st.size) % st.size;
    return (r + offset) % st.size;
  };
  // The newest seq every rank can restore, from its store or its partner's.
  std::vector<std::uint64_t> candidates(all_own.begin(), all_own.end());
  std::sort(candidates.rbegin(), candidates.rend());
  std::uint64_t chosen = 0;
  for (std::uint64_t s : candidates) {
    if (s == 0) break;
    bool everyone = true;
    for (int r = 0; r < st.size && everyone; ++r)
      everyone = in(all_own, r, s) || (st.options.partner_copies && in(all_held, partner_of(r), s));
    if (everyone) {
      chosen = s;
      break;
    }
  }
  if (chosen == 0) return std::nullopt;
  // Its name, from the lowest rank that has a record of it.
  int knows = -1;
  for (auto& [nm, s] : recs)
    if (s == chosen) knows = st.rank;
  int root = 0;
  int mine = knows >= 0 ? st.rank : st.size;
  MPI_Allreduce(&mine, &root, 1, MPI_INT, MPI_MIN, st.comm);
  char name_buf[256] = {};
  if (st.rank == root)
    for (auto& [nm, s] : recs)
      if (s == chosen) std::strncpy(name_buf, nm.c_str(), sizeof name_buf - 1);
  MPI_Bcast(name_buf, sizeof name_buf, MPI_CHAR, root, st.comm);
  const std::string name = name_buf;

  // Parts a rank lacks come back from its partner.
  const bool need = !in(all_own, st.rank, chosen);
  const bool client_needs = st.options.partner_copies && !in(all_own, st.client, chosen);
  all_or_throw(st.comm, st.size, "the parts of global snapshot '" + name + "' lost with a store could not be brought back from partners", [&] {
    if (!need && !client_needs) return;
    // A Store of its own (its own lock and mutex, as in snapshot()), with
    // bounded lock waits (kLockTimeout).
    std::optional<Store> here;
    // A failure here still takes part in the exchange (its receiving side
    // fails at once and drops what arrives): a rank that left it would
    // leave its partner sending a copy nobody receives, and the next
    // exchange would take those messages as its own.
    std::exception_ptr prepare_error;
    if (need) {
      try {
        here = open_bounded(st.store);
        // A damaged leftover goes before the exchange starts: removing takes the
        // store's lock exclusively, and during the exchange this rank's own send
        // to its client holds it shared until the whole copy is sent, which
        // waits for this side to read (a rank that both lacks its part and
        // sends its client's copy would wait for itself forever).
        for (auto& i : here->list(st.name))
          if (i.name == name) here->remove(st.name, name);
      } catch (...) {
        prepare_error = std::current_exception();
      }
    }
    exchange(st.comm, st.client,
             client_needs ? std::function<void(transfer::Channel&)>(
                                [&](transfer::Channel& ch) { transfer::send(st.store, st.copies_session(st.client) + "/" + name, ch); })
                          : std::function<void(transfer::Channel&)>(),
             st.partner,
             need ? std::function<void(transfer::Channel&)>([&](transfer::Channel& ch) {
               if (prepare_error) std::rethrow_exception(prepare_error);
               transfer::receive(*here, ch, {.session = st.name});
             })
                  : std::function<void(transfer::Channel&)>());
    if (need) st.record(name, chosen);
  });
  all_or_throw(st.comm, st.size, "global snapshot '" + name + "' could not be restored on every rank", [&] { st.local.restore(name); });
  return name;
}

}  // namespace dvr::mpi
