// The C API's private parts, shared by c_api.cpp (dvr/dvr.h) and c_api_mpi.cpp
// (dvr/dvr_mpi.h, in dvr_mpi): what the handles hold, and the one guard that
// turns every exception into a dvr_status and the calling thread's message.
#pragma once

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "dvr/dvr.h"
#include "dvr/dvr.hpp"

struct dvr_store {
  dvr::Store store;
};

// An open session, owned or borrowed. Owned (dvr_session_open): the handle
// holds the dvr::Session and dvr_session_close frees both. Borrowed
// (dvr_mpi_local): the dvr::Session belongs to a dvr::mpi::Session, the handle
// is freed with it, and dvr_session_close leaves it alone.
struct dvr_session {
  std::optional<dvr::Session> owned;  // empty when borrowed
  dvr::Session& session;              // *owned, or the borrowed session

  explicit dvr_session(dvr::Session&& s) : owned(std::move(s)), session(*owned) {}
  explicit dvr_session(dvr::Session& borrowed) : session(borrowed) {}
  dvr_session(const dvr_session&) = delete;
  dvr_session& operator=(const dvr_session&) = delete;
  bool borrowed() const { return !owned; }
};

struct dvr_snapshot_job {
  dvr::SnapshotJob job;
};

namespace dvr::detail {

// The one place C calls meet C++ exceptions (c_api.cpp): runs body(context),
// turns what it throws into a dvr_status and the calling thread's
// dvr_errmsg(). Hidden, like all of dvr::detail.
dvr_status c_call(const char* function, void (*body)(void*), void* context) noexcept;

}  // namespace dvr::detail

// c_call, exported from libdvr.so for dvr_mpi's C API (dvr/dvr_mpi.h), whose
// failures must set the same per-thread message that dvr_errmsg() in
// libdvr.so reads. Declared only here, in no installed header: not part of the
// API (dvr_mpi always comes from the same build as libdvr).
extern "C" DVR_EXPORT dvr_status dvr_internal_c_call(const char* function, void (*body)(void*), void* context) noexcept;

namespace dvr::detail {

// Runs `body` under c_call (through dvr_internal_c_call, so that it works
// from dvr_mpi as well as from libdvr itself).
template <class F>
dvr_status guarded(const char* function, F&& body) noexcept {
  using Body = std::remove_reference_t<F>;
  return dvr_internal_c_call(
      function, [](void* c) { (*static_cast<Body*>(c))(); }, &body);
}

// Thrown by the entry points themselves for NULL arguments and the like; the
// guard reports it as the C++ API would report an invalid_argument.
inline dvr::Error bad_argument(const char* function, const std::string& what) {
  return dvr::Error(dvr::Errc::invalid_argument, std::string(function) + ": " + what);
}

inline void require(const char* function, const void* arg, const char* arg_name) {
  if (!arg) throw bad_argument(function, std::string(arg_name) + " is NULL");
}

}  // namespace dvr::detail
