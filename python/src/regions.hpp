// What memdvr._core (core.cpp) and memdvr._mpi (mpi.cpp) share: the Python
// side of a session's regions — buffers held while tracked, memoryviews onto
// SDK-owned regions that keep their owner alive — and the info dicts that
// memdvr.Session reads. Each module includes it in its own translation unit
// (an unnamed namespace), so each registers its own _MemoryOwner type.
#pragma once

#include <pybind11/pybind11.h>

#include <dvr/dvr.hpp>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

[[noreturn]] void invalid(const std::string& message) { throw dvr::Error(dvr::Errc::invalid_argument, message); }

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// A Py_buffer held for as long as a region is tracked.
struct HeldBuffer {
  Py_buffer view{};
  bool held = false;
  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() {
    if (held) PyBuffer_Release(&view);
  }
};

// The exporter behind every memoryview onto SDK-owned memory (alloc()ed regions,
// clone regions). `owner` keeps the Session or Clone alive; `token` tells the
// owner that some view may still point into the memory.
struct MemoryOwner {
  py::object owner;
  void* data = nullptr;
  std::size_t size = 0;
  bool readonly = false;
  std::shared_ptr<int> token;  // last: released before `owner`
};

py::memoryview view_of(py::object owner, void* data, std::size_t size, bool readonly, std::shared_ptr<int> token) {
  auto holder = std::make_unique<MemoryOwner>();
  holder->owner = std::move(owner);
  holder->data = data;
  holder->size = size;
  holder->readonly = readonly;
  holder->token = std::move(token);
  py::object exporter = py::cast(std::move(holder));
  PyObject* mv = PyMemoryView_FromObject(exporter.ptr());
  if (!mv) throw py::error_already_set();
  return py::reinterpret_steal<py::memoryview>(mv);
}

// Registers MemoryOwner as `_MemoryOwner` (a buffer exporter) in module m.
void register_memory_owner(py::module_& m) {
  py::class_<MemoryOwner>(m, "_MemoryOwner", py::buffer_protocol(), py::module_local()).def_buffer([](MemoryOwner& o) {
    return py::buffer_info(o.data, 1, py::format_descriptor<std::uint8_t>::format(), 1, {static_cast<py::ssize_t>(o.size)}, {1}, o.readonly);
  });
}

// Text the store holds as Python str: UTF-8, or any bytes a snapshot
// received from elsewhere carried (a label may hold any): bytes that are not
// UTF-8 become lone surrogates (surrogateescape, as os.fsdecode gives file
// names), so nothing is lost and nothing raises UnicodeDecodeError; memdvr's
// printers write them as \xNN (docs/cli.md, "Text output").
inline py::str text(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

inline py::list texts(const std::vector<std::string>& v) {
  py::list out;
  for (const auto& s : v)
    out.append(text(s));
  return out;
}

py::dict region_info_dict(const dvr::RegionInfo& r) {
  py::dict d;
  d["name"] = text(r.name);
  d["size"] = r.size;
  d["sdk_owned"] = r.sdk_owned;
  return d;
}

py::list regions_list(const std::vector<dvr::Region*>& regions) {
  py::list out;
  for (const dvr::Region* r : regions)
    out.append(region_info_dict({r->name(), r->size(), r->sdk_owned()}));
  return out;
}

py::dict snapshot_info_dict(const dvr::SnapshotInfo& i) {
  py::dict d;
  d["session"] = text(i.session);
  d["name"] = text(i.name);
  d["parent"] = text(i.parent);
  d["label"] = text(i.label);
  d["time_ns"] = i.time_ns;
  d["seq"] = i.seq;
  d["origin_time_ns"] = i.origin_time_ns;
  d["logical_bytes"] = i.logical_bytes;
  d["stored_bytes"] = i.stored_bytes;
  d["chunks"] = i.chunks;
  d["zero_chunks"] = i.zero_chunks;
  py::list regions;
  for (const auto& r : i.regions)
    regions.append(region_info_dict(r));
  d["regions"] = regions;
  d["tracking"] = text(i.tracking);
  d["chunks_read"] = i.chunks_read;
  d["damaged"] = i.damaged;
  d["damage"] = text(i.damage);
  d["pending"] = i.pending;
  return d;
}

// SDK-owned regions that Python buffers still referenced when their session
// closed: the dvr::Session lives on here holding only them, and each is
// untracked (its memory freed) when its last buffer goes; the session itself
// ends with the last one. Nothing else reaches the session meanwhile.
struct Lingering {
  std::optional<dvr::Session> session;
  std::set<std::string> regions;

  void release(const std::string& region) noexcept {
    if (!session || !regions.erase(region)) return;
    try {
      session->untrack(region);
    } catch (...) {  // cannot happen (the region is there); freed with the session anyway
    }
    if (regions.empty()) session.reset();
  }
};

// The token of an alloc()ed region: every memoryview onto it holds a copy.
// When the last copy goes after the session closed with views still alive,
// the region is freed (Lingering::release).
using Token = std::shared_ptr<int>;
inline Token make_token(std::shared_ptr<Lingering> lingering, std::string region) {
  return Token(new int(0), [lingering = std::move(lingering), region = std::move(region)](int* p) {
    delete p;
    lingering->release(region);
  });
}

// The Python side of one session's regions. The owner declares it before its
// dvr::Session, so that the library lets go of the memory first and Python
// gets its buffers back after.
struct RegionBuffers {
  std::map<std::string, std::unique_ptr<HeldBuffer>> buffers;
  std::map<std::string, py::object> objects;  // the tracked Python objects
  std::map<std::string, Token> tokens;        // alloc()ed regions
  std::shared_ptr<Lingering> lingering = std::make_shared<Lingering>();

  // Tracks a writable, C-contiguous buffer in place, holding it meanwhile.
  void track(dvr::Session& session, const std::string& name, py::object obj) {
    auto held = std::make_unique<HeldBuffer>();
    if (PyObject_GetBuffer(obj.ptr(), &held->view, PyBUF_RECORDS_RO) != 0) {
      PyErr_Clear();
      invalid("cannot track region '" + name + "': a " + type_name(obj) + " does not expose a buffer (track a numpy array, bytearray or memoryview)");
    }
    held->held = true;
    if (held->view.readonly)
      invalid("cannot track region '" + name + "': the " + type_name(obj) +
              " is read-only (a bytes object, or an array with writeable=False); "
              "track a writable buffer");
    if (!PyBuffer_IsContiguous(&held->view, 'C'))
      invalid("cannot track region '" + name + "': the " + type_name(obj) +
              " is not C-contiguous (a strided slice such as a[::2], or a transposed "
              "array); track np.ascontiguousarray(a) instead");
    session.track(name, held->view.buf, static_cast<std::size_t>(held->view.len));
    buffers[name] = std::move(held);
    objects[name] = std::move(obj);
  }

  // alloc() and a writable memoryview onto it that keeps `owner` alive.
  py::memoryview alloc(py::object owner, dvr::Session& session, const std::string& name, std::size_t size) {
    dvr::Region& r = session.alloc(name, size);
    Token token = make_token(lingering, name);
    tokens[name] = token;
    return view_of(std::move(owner), r.data(), r.size(), false, token);
  }

  // The tracked object, or a new memoryview onto an SDK-owned region.
  py::object buffer(py::object owner, dvr::Session& session, const std::string& name) {
    dvr::Region& r = session.region(name);
    if (auto it = objects.find(name); it != objects.end()) return it->second;
    Token& token = tokens[name];
    if (!token) token = make_token(lingering, name);
    return view_of(std::move(owner), r.data(), r.size(), false, token);
  }

  bool has_views(const std::string& region) const {
    auto it = tokens.find(region);
    return it != tokens.end() && it->second.use_count() > 1;
  }

  void check_no_views(const std::string& session, const std::string& region) const {
    auto it = tokens.find(region);
    if (it != tokens.end() && it->second.use_count() > 1)
      invalid("region '" + region + "' of session '" + session + "' is still referenced by " + std::to_string(it->second.use_count() - 1) +
              " Python buffer(s) (arrays or memoryviews from alloc()/array()): delete them "
              "before untracking it or closing the session");
  }
  void check_no_views(const std::string& session) const {
    for (const auto& [name, token] : tokens)
      check_no_views(session, name);
  }

  // Ends `session` (its owner's optional, reset here): cancels a background
  // snapshot, untracks every region no Python buffer references (releasing
  // the tracked objects), and hands the session with the others, if any, to
  // `lingering`, which frees each once its last buffer goes. Never fails
  // because buffers are still referenced: they stay valid.
  void close(std::optional<dvr::Session>& session) {
    if (!session) return;
    if (dvr::SnapshotJob job = session->background()) job.cancel();
    std::vector<std::string> kept;
    for (dvr::Region* r : session->regions()) {
      std::string name = r->name();
      if (has_views(name)) {
        kept.push_back(name);
        continue;
      }
      session->untrack(name);
      forget(name);
    }
    if (!kept.empty()) {
      lingering->regions.insert(kept.begin(), kept.end());
      lingering->session.emplace(std::move(*session));
    }
    session.reset();
    clear();  // the views hold their tokens: the last one frees its region
  }

  void forget(const std::string& region) {
    tokens.erase(region);
    objects.erase(region);
    buffers.erase(region);
  }
  void clear() {
    tokens.clear();
    objects.clear();
    buffers.clear();
  }
};

}  // namespace
