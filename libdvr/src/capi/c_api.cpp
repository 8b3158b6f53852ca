// The C API (dvr/dvr.h): handles that own C++ objects, and one guard that turns
// every exception into a dvr_status and the calling thread's message.
#include "dvr/dvr.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "capi/c_api_impl.hpp"  // the handles (dvr_store, dvr_session) and guarded()
#include "dvr/dvr.hpp"

namespace {

thread_local std::string t_message;
thread_local const char* t_message_ptr = "";

// Never throws: building the message may itself run out of memory.
void set_message(const char* function, const char* text, const char* detail = "") noexcept {
  try {
    t_message.clear();
    if (function) t_message.append(function).append(": ");
    t_message.append(text).append(detail);
    t_message_ptr = t_message.c_str();
  } catch (...) {
    t_message_ptr = "out of memory (while recording the error message of a dvr_* call)";
  }
}

dvr_status status_of(dvr::Errc code) noexcept {
  switch (code) {
    case dvr::Errc::not_found:
      return DVR_E_NOT_FOUND;
    case dvr::Errc::already_exists:
      return DVR_E_ALREADY_EXISTS;
    case dvr::Errc::corrupt:
      return DVR_E_CORRUPT;
    case dvr::Errc::no_space:
      return DVR_E_NO_SPACE;
    case dvr::Errc::invalid_argument:
      return DVR_E_INVALID_ARGUMENT;
    case dvr::Errc::io:
      return DVR_E_IO;
    case dvr::Errc::unsupported:
      return DVR_E_UNSUPPORTED;
    case dvr::Errc::permission:
      return DVR_E_PERMISSION;
    case dvr::Errc::cancelled:
      return DVR_E_CANCELLED;
  }
  return DVR_E_INTERNAL;
}

using dvr::detail::bad_argument;
using dvr::detail::require;

}  // namespace

namespace dvr::detail {

// The one place C calls meet C++ exceptions: declared in c_api_impl.hpp for
// this file and c_api_mpi.cpp (dvr_mpi); its unit test feeds it every kind of
// exception.
dvr_status c_call(const char* function, void (*body)(void*), void* context) noexcept {
  try {
    body(context);
    return DVR_OK;
  } catch (const dvr::Error& e) {
    set_message(nullptr, e.what());  // the C++ message, as is
    return status_of(e.code());
  } catch (const std::bad_alloc&) {
    set_message(function, "out of memory");
    return DVR_E_NOMEM;
  } catch (const std::exception& e) {
    set_message(function, "unexpected error (please report it): ", e.what());
    return DVR_E_INTERNAL;
  } catch (...) {
    set_message(function, "unexpected error of unknown type (please report it)");
    return DVR_E_INTERNAL;
  }
}

}  // namespace dvr::detail

extern "C" dvr_status dvr_internal_c_call(const char* function, void (*body)(void*), void* context) noexcept {
  return dvr::detail::c_call(function, body, context);
}

using dvr::detail::guarded;

extern "C" {

const char* dvr_errmsg(void) { return t_message_ptr; }

const char* dvr_version(void) { return dvr::version(); }

dvr_status dvr_store_open(const char* path, dvr_store** out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = nullptr;
    *out = new dvr_store{path ? dvr::Store::open(path) : dvr::Store::open_default()};
  });
}

void dvr_store_close(dvr_store* store) { delete store; }

dvr_status dvr_store_path(const dvr_store* store, const char** out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = nullptr;
    require(fn, store, "store");
    *out = store->store.path().c_str();
  });
}

dvr_status dvr_list(dvr_store* store, const char* session, dvr_snapshot_info** out, size_t* count) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = nullptr;
    require(fn, count, "count");
    *count = 0;
    require(fn, store, "store");
    require(fn, session, "session");
    auto snaps = store->store.list(session);
    if (snaps.empty()) return;
    // One block: the entries, then their strings, so one free() releases all.
    std::size_t bytes = snaps.size() * sizeof(dvr_snapshot_info);
    for (auto& s : snaps)
      bytes += s.name.size() + s.parent.size() + s.label.size() + s.damage.size() + 4;
    auto* list = static_cast<dvr_snapshot_info*>(std::malloc(bytes));
    if (!list) throw std::bad_alloc();
    char* text = reinterpret_cast<char*>(list + snaps.size());
    auto put = [&](const std::string& s) {
      char* at = text;
      std::memcpy(at, s.c_str(), s.size() + 1);
      text += s.size() + 1;
      return at;
    };
    for (std::size_t i = 0; i < snaps.size(); ++i) {
      auto& s = snaps[i];
      list[i].name = put(s.name);
      list[i].parent = put(s.parent);
      list[i].label = put(s.label);
      list[i].damage = put(s.damage);
      list[i].time_ns = s.time_ns;
      list[i].logical_bytes = s.logical_bytes;
      list[i].stored_bytes = s.stored_bytes;
      list[i].damaged = s.damaged ? 1 : 0;
    }
    *out = list;
    *count = snaps.size();
  });
}

void dvr_list_free(dvr_snapshot_info* list) { std::free(list); }

dvr_status dvr_latest(dvr_store* store, const char* session, char* name_buf, size_t buf_size) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, name_buf, "name_buf");
    if (buf_size > 0) name_buf[0] = '\0';
    require(fn, store, "store");
    require(fn, session, "session");
    std::vector<std::string> skipped;
    auto latest = store->store.latest(session, &skipped);
    if (!latest) {
      std::string msg = "session '" + std::string(session) + "' in store " + store->store.path() + " has no intact snapshot";
      for (auto& s : skipped)
        msg += "; skipped " + s;
      throw dvr::Error(dvr::Errc::not_found, msg);
    }
    if (latest->name.size() + 1 > buf_size)
      throw bad_argument(fn, "name_buf holds " + std::to_string(buf_size) + " bytes but snapshot name '" + latest->name + "' needs " +
                                 std::to_string(latest->name.size() + 1) + " (a buffer of DVR_NAME_MAX + 1 bytes always suffices)");
    std::memcpy(name_buf, latest->name.c_str(), latest->name.size() + 1);
  });
}

dvr_status dvr_remove(dvr_store* store, const char* session, const char* snapshot) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, store, "store");
    require(fn, session, "session");
    require(fn, snapshot, "snapshot");
    store->store.remove(session, snapshot);
  });
}

dvr_status dvr_session_open(dvr_store* store, const char* name, dvr_session** out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = nullptr;
    require(fn, store, "store");
    require(fn, name, "name");
    *out = new dvr_session(dvr::Session(store->store, name));
  });
}

void dvr_session_close(dvr_session* session) {
  if (session && !session->borrowed()) delete session;  // borrowed: closed with its dvr_mpi_session
}

dvr_status dvr_track(dvr_session* session, const char* region, void* data, size_t size) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, session, "session");
    require(fn, region, "region");
    require(fn, data, "data");
    session->session.track(region, data, size);
  });
}

dvr_status dvr_alloc(dvr_session* session, const char* region, size_t size, void** out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = nullptr;
    require(fn, session, "session");
    require(fn, region, "region");
    *out = session->session.alloc(region, size).data();
  });
}

dvr_status dvr_untrack(dvr_session* session, const char* region) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, session, "session");
    require(fn, region, "region");
    session->session.untrack(region);
  });
}

dvr_status dvr_snapshot(dvr_session* session, const char* name, const char* label) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, session, "session");
    require(fn, name, "name");
    dvr::SnapshotOptions options;
    if (label) options.label = label;
    session->session.snapshot(name, options);
  });
}

dvr_status dvr_snapshot_background(dvr_session* session, const char* name, const char* label, dvr_snapshot_job** job) {
  const char* const fn = __func__;
  if (job) *job = nullptr;
  return guarded(fn, [&] {
    require(fn, session, "session");
    require(fn, name, "name");
    require(fn, job, "job");
    dvr::SnapshotOptions options;
    if (label) options.label = label;
    auto handle = std::make_unique<dvr_snapshot_job>();
    handle->job = session->session.snapshot_background(name, options);
    *job = handle.release();
  });
}

dvr_status dvr_snapshot_job_wait(dvr_snapshot_job* job) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, job, "job");
    job->job.wait();
  });
}

int dvr_snapshot_job_done(const dvr_snapshot_job* job) { return job && job->job.done() ? 1 : 0; }

void dvr_snapshot_job_progress(const dvr_snapshot_job* job, uint64_t* done, uint64_t* total) {
  dvr::SnapshotProgress p = job ? job->job.progress() : dvr::SnapshotProgress{};
  if (done) *done = p.bytes_done;
  if (total) *total = p.bytes_total;
}

void dvr_snapshot_job_cancel(dvr_snapshot_job* job) {
  if (job) job->job.cancel();
}

int dvr_snapshot_job_background(const dvr_snapshot_job* job) { return job && job->job.background() ? 1 : 0; }

const char* dvr_snapshot_job_note(const dvr_snapshot_job* job) { return job ? job->job.note().c_str() : ""; }

double dvr_snapshot_job_stall(const dvr_snapshot_job* job) { return job ? job->job.stall_seconds() : 0.0; }

void dvr_snapshot_job_free(dvr_snapshot_job* job) { delete job; }

dvr_status dvr_restore(dvr_session* session, const char* name) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, session, "session");
    require(fn, name, "name");
    session->session.restore(name);
  });
}

}  // extern "C"
