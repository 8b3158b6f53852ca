// memdvr._core — pybind11 bindings of libdvr (Store, Session, Clone).
//
// The friendly numpy-facing API lives in python/memdvr/__init__.py; this module
// stays close to the C++ API. Ownership rules:
//  * track(name, obj) holds a Py_buffer on obj while the region is tracked, so
//    the object (and its memory) stays alive and cannot be resized.
//  * alloc(name, size) and Clone.buffer(name) return memoryviews onto memory
//    the SDK owns; each view keeps its owner (the Session or the Clone) alive,
//    and untrack()/close() refuse while such a view is still referenced.
//  * close() never fails because Python buffers still reference SDK-owned
//    regions: those regions stay valid and are freed when their last buffer
//    goes (Lingering in regions.hpp).
//  * The GIL is released around every call that uses the store (snapshot,
//    restore, clone, gc, prune, verify, diff, export, import, list, info,
//    remove, sessions, stats); a progress callback re-acquires it
//    (PyProgress). dvr::Progress's contract asks for that: a callback runs
//    while its operation holds the store, so a thread that waits for the
//    store while holding the GIL would deadlock with it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dvr/dvr.hpp>
#include <dvr/proc.hpp>
#include <dvr/transfer.hpp>

#include "regions.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------- exceptions

struct ExcTypes {
  PyObject* base = nullptr;
  PyObject* by_code[9] = {};
};
ExcTypes g_exc;

PyObject* exception_for(dvr::Errc code) {
  auto i = static_cast<std::size_t>(code);
  if (i < std::size(g_exc.by_code) && g_exc.by_code[i]) return g_exc.by_code[i];
  return g_exc.base;
}

void register_exceptions(py::module_& m) {
  g_exc.base = PyErr_NewExceptionWithDoc("memdvr.DvrError",
                                         "Base class of every memdvr error. `code` is the C++ dvr::Errc name "
                                         "(\"not_found\", \"corrupt\", ...); str(e) is the C++ message.",
                                         PyExc_Exception, nullptr);
  if (!g_exc.base) throw py::error_already_set();
  PyObject_SetAttrString(g_exc.base, "code", py::str("").ptr());
  m.add_object("DvrError", py::handle(g_exc.base));

  struct Def {
    dvr::Errc code;
    const char* name;
    PyObject* builtin;  // second base, so `except ValueError` etc. also work
    const char* doc;
  };
  const Def defs[] = {
      {dvr::Errc::not_found, "NotFound", PyExc_LookupError, "Unknown session, snapshot, region or store."},
      {dvr::Errc::already_exists, "AlreadyExists", nullptr, "A snapshot or region of that name exists already."},
      {dvr::Errc::corrupt, "Corrupt", nullptr, "Data or metadata failed its checksum, or is malformed."},
      {dvr::Errc::no_space, "NoSpace", PyExc_OSError, "The store's file system is full (or a file-size limit was hit)."},
      {dvr::Errc::invalid_argument, "InvalidArgument", PyExc_ValueError,
       "Bad name, size mismatch, overlapping region, read-only or "
       "non-contiguous buffer, ..."},
      {dvr::Errc::io, "DvrIOError", PyExc_OSError, "Any other operating-system error."},
      {dvr::Errc::unsupported, "Unsupported", nullptr, "Newer store format, or a missing kernel or file-system feature."},
      {dvr::Errc::permission, "PermissionDenied", PyExc_PermissionError, "Store owned by another user, or not accessible."},
      {dvr::Errc::cancelled, "Cancelled", nullptr, "A background snapshot was cancelled before it was published."},
  };
  for (const Def& d : defs) {
    py::tuple bases = d.builtin ? py::make_tuple(py::handle(g_exc.base), py::handle(d.builtin)) : py::make_tuple(py::handle(g_exc.base));
    std::string full = std::string("memdvr.") + d.name;
    PyObject* type = PyErr_NewExceptionWithDoc(full.c_str(), d.doc, bases.ptr(), nullptr);
    if (!type) throw py::error_already_set();
    PyObject_SetAttrString(type, "code", py::str(dvr::errc_name(d.code)).ptr());
    g_exc.by_code[static_cast<std::size_t>(d.code)] = type;  // one reference kept for good
    m.add_object(d.name, py::handle(type));
  }

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dvr::Error& e) {
      // Decoded leniently: a message with bytes that are not UTF-8 (a name
      // as given) must still reach Python, not become an empty one.
      const char* what = e.what();
      PyObject* text = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "backslashreplace");
      if (!text) {
        PyErr_Clear();
        PyErr_SetString(exception_for(e.code()), "(a memdvr error whose message could not be decoded)");
        return;
      }
      PyErr_SetObject(exception_for(e.code()), text);
      Py_DECREF(text);
    }
  });
}

// ---------------------------------------------------------------- helpers

dvr::Tracking parse_tracking(const std::string& s) {
  if (s == "write_protect") return dvr::Tracking::write_protect;
  if (s == "hash") return dvr::Tracking::hash;
  invalid("unknown tracking mode '" + s + "': use \"write_protect\" or \"hash\"");
}

// ---------------------------------------------------------------- progress

// Thrown through libdvr when a Python progress callback raised: not a
// dvr::Error (nothing may mistake it for a store problem), and carries
// nothing; the Python exception itself waits in PyProgress::error_.
struct CallbackRaised {};

// A Python callable(done, total) made into a dvr::Progress, which libdvr
// calls on the thread that called the operation (dvr::Progress's contract)
// while that thread has released the GIL. Each call takes the GIL back;
// calls closer than 50 ms apart are dropped (but the first one and the one
// that reaches the total always go through), and `done` never goes
// backwards (kept defensively: the mutex costs nothing on one thread). When the
// callback raises, that exception is kept, every later call throws at once
// (CallbackRaised), and rethrow() raises it in the caller once libdvr has
// unwound: the operation is abandoned as for any other error.
class PyProgress {
 public:
  explicit PyProgress(py::object callback) : callback_(std::move(callback)) {}
  PyProgress(const PyProgress&) = delete;
  PyProgress& operator=(const PyProgress&) = delete;
  ~PyProgress() {
    // The kept exception and the callable are Python objects: drop them with the GIL.
    py::gil_scoped_acquire gil;
    error_.reset();
    callback_ = py::object();
  }

  // The dvr::Progress to hand to libdvr. Without a callback it still looks
  // for signals (at most every 50 ms): Ctrl-C (KeyboardInterrupt) or any
  // signal handler that raises stops the operation as a raising callback
  // does, and nothing is published, instead of being seen only once the
  // call has returned (a script without a progress bar, run by cron or a
  // batch system, would otherwise get KeyboardInterrupt after its snapshot
  // replaced the old one).
  dvr::Progress fn() {
    return [this](std::uint64_t done, std::uint64_t total) { call(done, total); };
  }

  void call(std::uint64_t done, std::uint64_t total) {
    if (failed_.load()) throw CallbackRaised{};
    std::lock_guard<std::mutex> lock(mu_);
    done = std::max(done, done_);
    auto now = std::chrono::steady_clock::now();
    bool due = !called_ || done >= total || now - last_ >= std::chrono::milliseconds(50);
    done_ = done;
    total_ = total;
    if (!due) return;
    called_ = true;
    last_ = now;
    reported_ = done;
    py::gil_scoped_acquire gil;
    try {
      if (callback_.is_none()) {
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // a handler raised (main thread only)
      } else {
        callback_(done, total);
      }
    } catch (py::error_already_set& e) {
      error_.emplace(std::move(e));
      failed_ = true;
      throw CallbackRaised{};
    }
  }

  // After a successful operation (GIL held): one last call at the total when
  // the last ones were dropped, so a bar ends full; then rethrow().
  void finish() {
    if (!failed_ && called_ && reported_ < total_ && !callback_.is_none()) {
      try {
        callback_(total_, total_);
      } catch (py::error_already_set& e) {
        error_.emplace(std::move(e));
        failed_ = true;
      }
    }
    rethrow();
  }

  // Raises the callback's exception, if it raised (GIL held).
  void rethrow() {
    if (!failed_) return;
    py::error_already_set e = std::move(*error_);
    error_.reset();
    failed_ = false;
    throw e;
  }

 private:
  py::object callback_;
  std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::optional<py::error_already_set> error_;
  bool called_ = false;
  std::chrono::steady_clock::time_point last_{};
  std::uint64_t done_ = 0, total_ = 0, reported_ = 0;
};

// Runs `op` with the GIL released and `progress` wired; raises the
// callback's exception rather than whatever libdvr threw while unwinding
// from it.
template <class Op>
auto with_progress(PyProgress& progress, Op&& op) {
  try {
    py::gil_scoped_release nogil;
    auto result = op(progress.fn());
    return result;
  } catch (...) {
    progress.rethrow();
    throw;
  }
}

// ---------------------------------------------------------------- transfer

py::dict transfer_stats_dict(const dvr::transfer::Stats& st) {
  py::dict d;
  d["refs"] = texts(st.refs);
  d["base"] = text(st.base);
  d["logical_bytes"] = st.logical_bytes;
  d["wire_bytes"] = st.wire_bytes;
  d["data_bytes"] = st.data_bytes;
  d["chunks"] = st.chunks;
  d["chunks_skipped"] = st.chunks_skipped;
  d["chunks_compressed"] = st.chunks_compressed;
  d["chunks_raw"] = st.chunks_raw;
  d["read_bytes"] = st.read_bytes;
  d["stored_bytes"] = st.stored_bytes;
  d["seconds"] = st.seconds;
  d["compression_ratio"] = st.compression_ratio;
  d["fingerprint"] = st.fingerprint;
  d["signed_by"] = st.signed_by;
  return d;
}

[[noreturn]] void throw_file_errno(int err, const std::string& what) {
  dvr::Errc code = err == ENOENT ? dvr::Errc::not_found : err == ENOSPC ? dvr::Errc::no_space : err == EACCES || err == EPERM ? dvr::Errc::permission : dvr::Errc::io;
  throw dvr::Error(code, what + ": " + std::strerror(err));
}

// What `dvr export REF -o FILE` does: the stream goes to FILE.part-PID beside
// FILE, is fsync()ed and renamed over FILE once complete (no half files; on
// any error, the callback's included, the part file is removed).
// A FILE that exists and is a FIFO, device or socket is written in place
// (renaming over it would replace it); a directory is refused.
dvr::transfer::Stats export_to(const dvr::Store& store, const std::string& ref, const std::string& file, const dvr::transfer::Options& o) {
  struct stat target {};
  if (::stat(file.c_str(), &target) == 0 && !S_ISREG(target.st_mode)) {
    if (S_ISDIR(target.st_mode)) invalid("cannot export to " + file + ": it is a directory; give a file name");
    int fd = ::open(file.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) throw_file_errno(errno, "cannot open " + file + " for writing");
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{fd};
    return dvr::transfer::send(store, ref, fd, o);
  }
  dvr::transfer::remove_stale_export_parts(file);  // left by an export to FILE that was killed
  std::string tmp = file + ".part-" + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw_file_errno(errno, "cannot create " + tmp);
  try {
    dvr::transfer::Stats st = dvr::transfer::send(store, ref, fd, o);
    if (::fsync(fd) != 0) throw_file_errno(errno, "cannot write " + tmp);
    ::close(fd);
    fd = -1;
    if (::rename(tmp.c_str(), file.c_str()) != 0) throw_file_errno(errno, "cannot rename " + tmp + " to " + file);
    return st;
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
}

// What `dvr import FILE` does: receive() from the file, with its progress
// (ReceiveOptions::progress: bytes of the file read, out of its size).
dvr::transfer::Stats import_from(dvr::Store& store, const std::string& file, const dvr::Progress& progress,
                                 const std::vector<dvr::transfer::VerifyKey>& keys) {
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_file_errno(errno, "cannot open " + file);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } close_file{fd};
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) invalid("cannot import " + file + ": it is a directory; give the file export() wrote");
  dvr::transfer::ReceiveOptions o;
  o.progress = progress;
  o.require_signature = keys;
  try {
    return dvr::transfer::receive(store, fd, o);
  } catch (const dvr::Error& e) {
    // A refused stream: the message says what; this says which file (as `dvr import`).
    if (e.code() == dvr::Errc::corrupt || e.code() == dvr::Errc::permission || e.code() == dvr::Errc::unsupported)
      throw dvr::Error(e.code(), "import of " + file + ": " + e.what());
    throw;
  }
}

// ---------------------------------------------------------------- logging

// Routes libdvr's log (dvr::set_log_sink) to a Python callable(level, line).
// The library may log from any of its threads, some of them holding the
// store's locks, while a Python thread holding the GIL waits for those very
// locks (a call that keeps the GIL, such as Store.list()). So the sink never
// waits for the GIL: it queues the line and returns, and one dispatcher
// thread of its own, which holds no library lock, takes the GIL and hands
// the lines to Python. stop() (memdvr calls it atexit, before the
// interpreter finalizes) restores the default sink and joins the thread
// with the GIL released, so shutdown never waits on a thread stuck on the
// GIL. Lines beyond kMaxQueued waiting are dropped and counted (one line
// then says how many).
class LogBridge {
 public:
  static LogBridge& get() {
    static LogBridge* bridge = new LogBridge;  // never destroyed: outlives static teardown
    return *bridge;
  }

  // Starts routing to `handler` (GIL held).
  void start(py::object handler) {
    stop();
    {
      std::lock_guard<std::mutex> lock(mu_);
      handler_ = std::move(handler);
      stopping_ = false;
    }
    thread_ = std::thread([this] { run(); });
    dvr::set_log_sink([this](dvr::LogLevel level, std::string_view line) { push(level, line); });
  }

  // Back to the default sink (stderr); delivers what is queued first (GIL held).
  void stop() {
    if (!thread_.joinable()) return;
    dvr::set_log_sink(nullptr);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    {
      py::gil_scoped_release nogil;
      thread_.join();
    }
    handler_ = py::object();
  }

  // Waits (GIL released) until every line queued so far was handed to Python.
  void flush() {
    if (!thread_.joinable()) return;
    py::gil_scoped_release nogil;
    std::unique_lock<std::mutex> lock(mu_);
    std::uint64_t target = queued_;
    idle_.wait_for(lock, std::chrono::seconds(10), [&] { return delivered_ >= target || stopping_; });
  }

 private:
  static constexpr std::size_t kMaxQueued = 10000;

  void push(dvr::LogLevel level, std::string_view line) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      if (queue_.size() >= kMaxQueued) {
        ++dropped_;
        return;
      }
      queue_.emplace_back(level, std::string(line));
      ++queued_;
    }
    cv_.notify_one();
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything delivered
      std::vector<std::pair<dvr::LogLevel, std::string>> batch(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
      queue_.clear();
      std::uint64_t dropped = std::exchange(dropped_, 0);
      lock.unlock();
      {
        py::gil_scoped_acquire gil;
        for (auto& [level, line] : batch)
          deliver(dvr::log_level_name(level), line);
        if (dropped)
          deliver("warn", "memdvr: " + std::to_string(dropped) + " log line(s) dropped: the Python log handler could not keep up");
      }
      lock.lock();
      delivered_ += batch.size();
      idle_.notify_all();
    }
  }

  void deliver(const char* level, const std::string& line) {  // GIL held
    try {
      handler_(level, py::bytes(line).attr("decode")("utf-8", "backslashreplace"));
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("memdvr log handler");  // logging never fails anything
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, idle_;
  std::deque<std::pair<dvr::LogLevel, std::string>> queue_;
  std::uint64_t queued_ = 0, delivered_ = 0, dropped_ = 0;
  bool stopping_ = false;
  std::thread thread_;
  py::object handler_;
};

// ---------------------------------------------------------------- Session

// A dvr::Session is used from one thread at a time; Python threads may share
// one memdvr.Session, so each call holds the session's mutex for its whole
// length (close() too: it waits for the calls in flight). The mutex is always
// taken with the GIL released — a call in flight may need the GIL (its
// progress callback) — and a thread that already holds it (a progress
// callback calling back into its own session) gets an error, not a deadlock.
struct PySession {
  RegionBuffers regions;  // before `session`: released after it (regions.hpp)
  std::optional<dvr::Session> session;
  std::mutex mu;
  std::atomic<std::thread::id> owner{};

  dvr::Session& get() {
    if (!session) invalid("memdvr: the session is closed");
    return *session;
  }
};

// Holds a PySession's mutex (see PySession); taken with the GIL held by the caller.
class SessionCall {
 public:
  explicit SessionCall(PySession& s) : s_(s) {
    if (s.owner.load() == std::this_thread::get_id())
      invalid("memdvr: this session is busy in this thread (a progress callback cannot call its own session)");
    if (!s.mu.try_lock()) {
      py::gil_scoped_release nogil;
      s.mu.lock();
    }
    s.owner.store(std::this_thread::get_id());
  }
  ~SessionCall() {
    s_.owner.store(std::thread::id{});
    s_.mu.unlock();
  }
  SessionCall(const SessionCall&) = delete;
  SessionCall& operator=(const SessionCall&) = delete;

 private:
  PySession& s_;
};

// ---------------------------------------------------------------- Clone

struct PyClone {
  std::unique_ptr<dvr::Clone> clone;
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "memdvr._core: bindings of the Memory DVR C++ library (use the memdvr package)";
  m.attr("__version__") = dvr::version();
  register_exceptions(m);

  register_memory_owner(m);

  m.def(
      "set_log_level", [](const std::string& level) { dvr::set_log_level(dvr::parse_log_level(level)); }, py::arg("level"),
      "Sets libdvr's log level for the process: \"error\", \"warn\", \"info\" or \"debug\" (overrides $DVR_LOG).");
  m.def(
      "escape_text", [](const py::bytes& text) { return dvr::escape_text(std::string(text)); }, py::arg("text"),
      "dvr::escape_text: the bytes of `text` for one line of a terminal (docs/cli.md, \"Text output\"); memdvr's text output uses it.");
  m.def(
      "log_level", [] { return std::string(dvr::log_level_name(dvr::log_level())); }, "libdvr's log level: set_log_level(), else $DVR_LOG, else \"warn\".");
  m.def(
      "set_log_handler",
      [](py::object handler) {
        if (handler.is_none())
          LogBridge::get().stop();
        else
          LogBridge::get().start(std::move(handler));
      },
      py::arg("handler"),
      "handler(level, line) receives libdvr's log lines on a dispatcher thread (with the GIL); None restores the "
      "default sink (stderr), delivering what is queued first.");
  m.def(
      "flush_log", [] { LogBridge::get().flush(); }, "Waits until every log line queued so far reached the handler.");

  m.def(
      "keygen",
      [](const std::string& prefix) {
        dvr::transfer::SigningKey k = dvr::transfer::SigningKey::generate();
        k.save(prefix);
        return k.fingerprint();
      },
      py::arg("prefix"),
      "Writes a new Ed25519 key pair as PREFIX.key (secret, mode 0600) and PREFIX.pub (what `dvr keygen --out PREFIX` does); "
      "returns its fingerprint. AlreadyExists when either file exists.");
  m.def(
      "key_fingerprint", [](const std::string& path) { return dvr::transfer::VerifyKey::load(path).fingerprint(); }, py::arg("path"),
      "The fingerprint (\"ed25519:\" and 32 hex digits) of a public key file.");

  m.def("split_ref", &dvr::split_ref, py::arg("ref"),
        "Splits a snapshot reference 'SESSION/NAME' ('proc/NAME' for a process snapshot) into (SESSION, NAME); "
        "InvalidArgument unless it is two non-empty parts around one '/' (dvr::split_ref).");

  // ---- Store
  py::class_<dvr::Store>(m, "Store", "A handle to an open store (a directory of snapshots).")
      .def_static(
          "open",
          [](const std::string& path, std::optional<std::uint32_t> chunk_size, bool create, std::optional<double> lock_timeout) {
            dvr::StoreOptions o;
            if (chunk_size) o.chunk_size = *chunk_size;
            o.create = create;
            if (lock_timeout) {
              if (!(*lock_timeout >= 0) || *lock_timeout > 1e9)
                invalid("Store: lock_timeout must be a number of seconds from 0 to 1e9 (or None to wait), not " + std::to_string(*lock_timeout));
              o.lock_timeout = std::chrono::milliseconds(static_cast<long long>(*lock_timeout * 1000));
            }
            py::gil_scoped_release nogil;
            return dvr::Store::open(path, o);
          },
          py::arg("path"), py::arg("chunk_size") = py::none(), py::arg("create") = true, py::arg("lock_timeout") = py::none(),
          "Opens (and with create=True creates) the store in `path`; lock_timeout: seconds to wait for another process's lock (None: as long as it takes).")
      .def_static("default_path", &dvr::Store::default_path, "$DVR_STORE if set, else /dev/shm/dvr-<uid>, else $HOME/.local/share/dvr.")
      .def_property_readonly("path", &dvr::Store::path)
      .def_property_readonly("medium", [](const dvr::Store& s) { return dvr::medium_name(s.medium()); })
      .def_property_readonly("chunk_size", &dvr::Store::chunk_size)
      .def(
          "sessions",
          [](const dvr::Store& s) {
            py::gil_scoped_release nogil;
            return s.sessions();
          },
          "Sessions with at least one snapshot, sorted.")
      .def(
          "list",
          [](const dvr::Store& s, std::optional<std::string> session) {
            std::vector<dvr::SnapshotInfo> infos;
            {
              py::gil_scoped_release nogil;
              infos = session ? s.list(*session) : s.list();
            }
            py::list out;
            for (const auto& i : infos)
              out.append(snapshot_info_dict(i));
            return out;
          },
          py::arg("session") = py::none(), "Snapshots (dicts), oldest first; damaged ones marked.")
      .def(
          "info",
          [](const dvr::Store& s, const std::string& session, const std::string& name) {
            dvr::SnapshotInfo info;
            {
              py::gil_scoped_release nogil;
              info = s.info(session, name);
            }
            return snapshot_info_dict(info);
          },
          py::arg("session"), py::arg("name"))
      .def(
          "remove",
          [](dvr::Store& s, const std::string& session, const std::string& name) {
            py::gil_scoped_release nogil;
            // As `dvr rm`: proc/NAME goes with its heap snapshots, and a heap
            // snapshot a process snapshot still needs is refused.
            dvr::proc::remove_snapshot(s, session, name);
          },
          py::arg("session"), py::arg("name"))
      .def(
          "check_removable",
          [](const dvr::Store& s, const std::string& session, const std::string& name) {
            py::gil_scoped_release nogil;
            dvr::proc::check_removable(s, session, name);
          },
          py::arg("session"), py::arg("name"))
      .def(
          "gc",
          [](dvr::Store& s, py::object progress) {
            PyProgress p(std::move(progress));
            dvr::GcReport r = with_progress(p, [&](const dvr::Progress& fn) { return s.gc(fn); });
            p.finish();
            py::dict d;
            d["bytes_before"] = r.bytes_before;
            d["bytes_after"] = r.bytes_after;
            d["packs_removed"] = r.packs_removed;
            d["temp_files_removed"] = r.temp_files_removed;
            return d;
          },
          py::arg("progress") = py::none(), "Reclaims unreferenced space; progress(done, total) in bytes of pack files examined.")
      .def(
          "prune",
          [](dvr::Store& s, const std::string& session, unsigned keep_last, std::int64_t keep_within, unsigned keep_hourly, unsigned keep_daily,
             unsigned keep_weekly, unsigned keep_monthly, bool dry_run) {
            if (keep_within < 0) invalid("prune: keep_within must be a number of seconds >= 0, not " + std::to_string(keep_within));
            dvr::PrunePolicy policy;
            policy.keep_last = keep_last;
            policy.keep_within = std::chrono::seconds(keep_within);
            policy.keep_hourly = keep_hourly;
            policy.keep_daily = keep_daily;
            policy.keep_weekly = keep_weekly;
            policy.keep_monthly = keep_monthly;
            dvr::PruneReport r;
            {
              py::gil_scoped_release nogil;
              r = s.prune(session, policy, dry_run);
            }
            py::list decisions;
            for (const auto& dec : r.decisions) {
              py::dict d;
              d["snapshot"] = snapshot_info_dict(dec.snapshot);
              d["keep"] = dec.keep;
              d["reason"] = text(dec.reason);
              decisions.append(d);
            }
            py::dict out;
            out["decisions"] = decisions;
            out["removed"] = r.removed;
            out["dry_run"] = r.dry_run;
            return out;
          },
          py::arg("session"), py::arg("keep_last") = 0, py::arg("keep_within") = 0, py::arg("keep_hourly") = 0, py::arg("keep_daily") = 0,
          py::arg("keep_weekly") = 0, py::arg("keep_monthly") = 0, py::arg("dry_run") = false,
          "Removes the snapshots of `session` the policy does not keep (dvr::Store::prune; keep_within in seconds).")
      .def(
          "verify",
          [](const dvr::Store& s, py::object progress) {
            PyProgress p(std::move(progress));
            dvr::VerifyReport r = with_progress(p, [&](const dvr::Progress& fn) { return s.verify(fn); });
            p.finish();
            py::dict d;
            d["ok"] = r.ok();
            d["snapshots"] = r.snapshots;
            d["chunks"] = r.chunks;
            d["bytes"] = r.bytes;
            py::list problems;
            for (const auto& pr : r.problems) {
              py::dict pd;
              pd["session"] = text(pr.session);
              pd["snapshot"] = text(pr.snapshot);
              pd["what"] = text(pr.what);
              problems.append(pd);
            }
            d["problems"] = problems;
            d["damaged_snapshots"] = texts(r.damaged_snapshots());
            d["warnings"] = texts(r.warnings);
            return d;
          },
          py::arg("progress") = py::none(), "Re-hashes everything; progress(done, total) in bytes if given (GIL released meanwhile).")
      .def(
          "export_",
          [](const dvr::Store& s, const std::string& ref, const std::string& path, const std::string& base, const std::string& compress, int level,
             py::object progress, const std::string& sign) {
            dvr::transfer::Options o;
            o.base = base;
            if (!sign.empty()) o.sign_with = dvr::transfer::SigningKey::load(sign);
            o.compress = dvr::transfer::parse_compress(compress, "compress");
            o.level = level;
            PyProgress p(std::move(progress));
            dvr::transfer::Stats st = with_progress(p, [&](const dvr::Progress& fn) {
              o.progress = fn;
              return export_to(s, ref, path, o);
            });
            p.finish();
            return transfer_stats_dict(st);
          },
          py::arg("ref"), py::arg("path"), py::arg("base") = "", py::arg("compress") = "auto", py::arg("level") = 1, py::arg("progress") = py::none(),
          py::arg("sign") = "",
          "Writes snapshot REF as a stream file at `path` (what `dvr export REF -o PATH [--sign KEY]` does); `sign`: a secret key file.")
      .def(
          "import_",
          [](dvr::Store& s, const std::string& path, py::object progress, const std::vector<std::string>& require_signature) {
            std::vector<dvr::transfer::VerifyKey> keys;
            for (auto& f : require_signature)
              keys.push_back(dvr::transfer::VerifyKey::load(f));
            PyProgress p(std::move(progress));
            dvr::transfer::Stats st = with_progress(p, [&](const dvr::Progress& fn) { return import_from(s, path, fn, keys); });
            p.finish();
            return transfer_stats_dict(st);
          },
          py::arg("path"), py::arg("progress") = py::none(), py::arg("require_signature") = std::vector<std::string>{},
          "Reads a stream file into the store (what `dvr import PATH [--require-signature PUBKEY...]` does); "
          "`require_signature`: public key files, one of which must have signed it.")
      .def("stats",
           [](const dvr::Store& s) {
             dvr::StoreStats st;
             {
               py::gil_scoped_release nogil;
               st = s.stats();
             }
             py::dict d;
             d["path"] = text(st.path);
             d["medium"] = dvr::medium_name(st.medium);
             d["format_version"] = st.format_version;
             d["chunk_size"] = st.chunk_size;
             d["sessions"] = st.sessions;
             d["snapshots"] = st.snapshots;
             d["logical_bytes"] = st.logical_bytes;
             d["pack_bytes"] = st.pack_bytes;
             d["pack_files"] = st.pack_files;
             d["warnings"] = texts(st.warnings);
             return d;
           })
      .def(
          "diff",
          [](const dvr::Store& s, const std::string& sa, const std::string& a, const std::string& sb, const std::string& b) {
            std::vector<dvr::RegionDiff> diffs;
            {
              py::gil_scoped_release nogil;
              diffs = s.diff(sa, a, sb, b);
            }
            py::list out;
            for (const auto& r : diffs) {
              py::dict d;
              d["name"] = text(r.name);
              d["size_a"] = r.size_a;
              d["size_b"] = r.size_b;
              d["only_in_a"] = r.only_in_a;
              d["only_in_b"] = r.only_in_b;
              d["bytes_differ"] = r.bytes_differ;
              d["pages_differ"] = r.pages_differ;
              out.append(d);
            }
            return out;
          },
          py::arg("session_a"), py::arg("snapshot_a"), py::arg("session_b"), py::arg("snapshot_b"))
      .def(
          "latest",
          [](const dvr::Store& s, const std::string& session) -> py::object {
            std::optional<dvr::SnapshotInfo> i;
            {
              py::gil_scoped_release nogil;
              i = s.latest(session);
            }
            if (!i) return py::none();
            return snapshot_info_dict(*i);
          },
          py::arg("session"))
      .def(
          "open_snapshot",
          [](const dvr::Store& s, const std::string& session, const std::string& name, bool verify) {
            auto c = std::make_unique<PyClone>();
            {
              py::gil_scoped_release nogil;
              c->clone = std::make_unique<dvr::Clone>(s.open_snapshot(session, name, {.verify = verify}));
            }
            return c;
          },
          py::arg("session"), py::arg("name"), py::arg("verify") = true, "A copy-on-write clone of a snapshot (see Clone).");

  // ---- Session
  py::class_<PySession>(m, "Session", "One application's named set of memory regions in a store.")
      .def(py::init([](const dvr::Store& store, const std::string& name, std::optional<std::string> tracking) {
             dvr::SessionOptions o;
             if (tracking) o.tracking = parse_tracking(*tracking);
             auto s = std::make_unique<PySession>();
             {
               py::gil_scoped_release nogil;
               s->session.emplace(store, name, o);
             }
             return s;
           }),
           py::arg("store"), py::arg("name"), py::arg("tracking") = py::none())
      .def_property_readonly("name", [](PySession& s) {
        SessionCall call(s);
        return s.get().name();
      })
      .def_property_readonly("store", [](PySession& s) {
        SessionCall call(s);
        return s.get().store();
      })
      .def_property_readonly("head", [](PySession& s) {
        SessionCall call(s);
        return s.get().head();
      })
      .def_property_readonly("closed", [](PySession& s) { return !s.session.has_value(); })
      .def(
          "track", [](PySession& s, const std::string& name, py::object obj) {
            SessionCall call(s);
            s.regions.track(s.get(), name, std::move(obj));
          }, py::arg("name"),
          py::arg("buffer"), "Tracks a writable C-contiguous buffer in place (zero-copy); holds a reference to it.")
      .def(
          "alloc",
          [](py::object self, const std::string& name, std::size_t size) {
            auto& s = self.cast<PySession&>();
            SessionCall call(s);
            return s.regions.alloc(self, s.get(), name, size);
          },
          py::arg("name"), py::arg("size"), "Allocates an SDK-owned, zero-filled region; returns a writable memoryview onto it.")
      .def(
          "untrack",
          [](PySession& s, const std::string& name) {
            SessionCall call(s);
            s.get().region(name);  // not_found first
            s.regions.check_no_views(s.get().name(), name);
            s.get().untrack(name);
            s.regions.forget(name);
          },
          py::arg("name"))
      .def(
          "buffer",
          [](py::object self, const std::string& name) {
            auto& s = self.cast<PySession&>();
            SessionCall call(s);
            return s.regions.buffer(self, s.get(), name);
          },
          py::arg("name"), "The tracked object, or a new memoryview onto an SDK-owned region.")
      .def("regions",
           [](PySession& s) {
             SessionCall call(s);
             return regions_list(s.get().regions());
           })
      .def(
          "snapshot",
          [](PySession& s, const std::string& name, const std::string& label, bool replace, py::object progress) {
            SessionCall call(s);
            dvr::Session& session = s.get();
            PyProgress p(std::move(progress));
            dvr::SnapshotInfo info = with_progress(p, [&](const dvr::Progress& fn) {
              return session.snapshot(name, {.label = label, .replace = replace, .progress = fn});
            });
            p.finish();
            return snapshot_info_dict(info);
          },
          py::arg("name"), py::arg("label") = "", py::arg("replace") = false, py::arg("progress") = py::none(),
          "Takes snapshot `name`; progress(done, total) in bytes of region memory read (GIL released meanwhile).")
      .def(
          "snapshot_background",
          [](PySession& s, const std::string& name, const std::string& label, bool replace) {
            SessionCall call(s);
            dvr::Session& session = s.get();
            py::gil_scoped_release nogil;
            return session.snapshot_background(name, {.label = label, .replace = replace});
          },
          py::arg("name"), py::arg("label") = "", py::arg("replace") = false,
          "Starts a background snapshot (see dvr::Session::snapshot_background); returns a SnapshotJob.")
      .def(
          "restore",
          [](PySession& s, const std::string& name, py::object progress) {
            SessionCall call(s);
            dvr::Session& session = s.get();
            PyProgress p(std::move(progress));
            with_progress(p, [&](const dvr::Progress& fn) {
              session.restore(name, dvr::RestoreOptions{.progress = fn});
              return 0;
            });
            p.finish();
          },
          py::arg("name"), py::arg("progress") = py::none(),
          "Restores snapshot `name`; progress(done, total): bytes checked, then bytes copied, out of twice the bytes copied.")
      .def("list",
           [](PySession& s) {
             SessionCall call(s);
             dvr::Session& session = s.get();
             std::vector<dvr::SnapshotInfo> infos;
             {
               py::gil_scoped_release nogil;
               infos = session.list();
             }
             py::list out;
             for (const auto& i : infos)
               out.append(snapshot_info_dict(i));
             return out;
           })
      .def("latest",
           [](PySession& s) -> py::object {
             SessionCall call(s);
             dvr::Session& session = s.get();
             std::optional<dvr::SnapshotInfo> i;
             {
               py::gil_scoped_release nogil;
               i = session.latest();
             }
             if (!i) return py::none();
             return snapshot_info_dict(*i);
           })
      .def(
          "clone",
          [](PySession& s, const std::string& name, bool verify) {
            SessionCall call(s);
            dvr::Session& session = s.get();
            auto c = std::make_unique<PyClone>();
            {
              py::gil_scoped_release nogil;
              c->clone = std::make_unique<dvr::Clone>(session.clone(name, {.verify = verify}));
            }
            return c;
          },
          py::arg("name"), py::arg("verify") = true)
      .def(
          "tracking",
          [](PySession& s, const std::string& region) {
            SessionCall call(s);
            return dvr::tracking_name(s.get().tracking(region));
          }, py::arg("region"))
      .def("tracking_note",
           [](PySession& s) {
             SessionCall call(s);
             return s.get().tracking_note();
           })
      .def(
          "autosave",
          [](PySession& s, double every, std::size_t keep) {
            SessionCall call(s);
            if (!(every >= 0) || every > 1e9) invalid("autosave: every must be a number of seconds >= 0 (0 turns autosave off), not " + std::to_string(every));
            // A positive interval below a millisecond is one millisecond, never 0 (off).
            auto ms = every > 0 ? std::max<std::int64_t>(1, static_cast<std::int64_t>(every * 1000 + 0.5)) : 0;
            s.get().autosave(std::chrono::milliseconds(ms), keep);
          },
          py::arg("every"), py::arg("keep"), "Turns on autosave every `every` seconds at checkpoint_point(), keeping the newest `keep` (dvr::Session::autosave).")
      .def("checkpoint_point",
           [](PySession& s) -> py::object {
             SessionCall call(s);
             dvr::Session& session = s.get();
             std::optional<dvr::SnapshotInfo> i;
             {
               py::gil_scoped_release nogil;
               i = session.checkpoint_point();
             }
             if (!i) return py::none();
             return snapshot_info_dict(*i);
           })
      .def(
          "close",
          [](PySession& s) {
            SessionCall call(s);  // waits for the calls in flight
            s.regions.close(s.session);
          },
          "Ends the session: forgets every region and releases the tracked buffers. SDK-owned regions that "
          "Python buffers still reference stay valid until the last of them goes.");

  // ---- SnapshotJob
  py::class_<dvr::SnapshotJob>(m, "SnapshotJob", "A snapshot being taken in the background (dvr::SnapshotJob).")
      .def_property_readonly("name", &dvr::SnapshotJob::name)
      .def_property_readonly("background", &dvr::SnapshotJob::background)
      .def_property_readonly("note", &dvr::SnapshotJob::note)
      .def_property_readonly("stall_seconds", &dvr::SnapshotJob::stall_seconds)
      .def_property_readonly("bytes_copied_aside", &dvr::SnapshotJob::bytes_copied_aside)
      .def("progress",
           [](const dvr::SnapshotJob& j) {
             dvr::SnapshotProgress p = j.progress();
             return py::make_tuple(p.bytes_done, p.bytes_total, p.finished);
           })
      .def("done", &dvr::SnapshotJob::done)
      .def(
          "wait_for",
          [](const dvr::SnapshotJob& j, double seconds) {
            py::gil_scoped_release nogil;
            return j.wait_for(std::chrono::milliseconds(static_cast<std::int64_t>(std::max(0.0, seconds) * 1000)));
          },
          py::arg("seconds"))
      .def("wait",
           [](const dvr::SnapshotJob& j) {
             dvr::SnapshotInfo info;
             {
               py::gil_scoped_release nogil;
               info = j.wait();
             }
             return snapshot_info_dict(info);
           })
      .def("cancel", &dvr::SnapshotJob::cancel);

  // ---- Clone
  py::class_<PyClone>(m, "Clone",
                      "A copy-on-write view of one snapshot's regions. Writes stay private to "
                      "the clone; it lives while it or a buffer of it is referenced.")
      .def_property_readonly("session", [](PyClone& c) { return c.clone->session(); })
      .def_property_readonly("snapshot", [](PyClone& c) { return c.clone->snapshot(); })
      .def("regions", [](PyClone& c) { return regions_list(c.clone->regions()); })
      .def(
          "buffer",
          [](py::object self, const std::string& name) {
            auto& c = self.cast<PyClone&>();
            dvr::Region& r = c.clone->region(name);
            return view_of(self, r.data(), r.size(), false, nullptr);
          },
          py::arg("name"), "A writable (copy-on-write) memoryview onto region `name`.");
}
