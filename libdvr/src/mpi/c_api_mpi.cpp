// The C API of coordinated MPI snapshots (dvr/dvr_mpi.h), part of dvr_mpi:
// handles over dvr::mpi::Session, under c_api.cpp's guard (c_api_impl.hpp),
// so errors, messages and dvr_errmsg() are those of dvr/dvr.h.
#include "dvr/dvr_mpi.h"

#include <cstring>
#include <memory>
#include <string>

#include "capi/c_api_impl.hpp"
#include "dvr/mpi.hpp"

struct dvr_mpi_session {
  std::unique_ptr<dvr::mpi::Session> mpi;
  std::unique_ptr<dvr_session> local;  // borrowed handle of mpi->local(); declared after `mpi`, freed before it
};

namespace {

using dvr::detail::bad_argument;
using dvr::detail::guarded;
using dvr::detail::require;

void copy_info(const dvr::mpi::GlobalInfo& g, dvr_mpi_info* out) {
  // Global snapshot names are session snapshot names: at most DVR_NAME_MAX.
  std::strncpy(out->name, g.name.c_str(), sizeof out->name - 1);
  out->name[sizeof out->name - 1] = '\0';
  out->seq = g.seq;
  out->stored_bytes = g.stored_bytes;
  out->partner_bytes = g.partner_bytes;
  out->seconds = g.seconds;
}

}  // namespace

extern "C" {

void dvr_mpi_options_init(dvr_mpi_options* opts) {
  if (!opts) return;
  const dvr::mpi::Options d;
  opts->partner_offset = d.partner_offset;
  opts->partner_copies = d.partner_copies ? 1 : 0;
  opts->keep = d.keep;
  opts->level = d.level;
}

dvr_status dvr_mpi_session_open(dvr_store* store, const char* name, MPI_Comm comm, const dvr_mpi_options* opts, dvr_mpi_session** out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = nullptr;
    require(fn, store, "store");
    require(fn, name, "name");
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized) throw bad_argument(fn, finalized ? "MPI is finalized" : "MPI is not initialized (call MPI_Init first)");
    if (comm == MPI_COMM_NULL) throw bad_argument(fn, "comm is MPI_COMM_NULL");
    dvr::mpi::Options o;
    if (opts) {
      o.partner_offset = opts->partner_offset;
      o.partner_copies = opts->partner_copies != 0;
      o.keep = opts->keep;
      o.level = opts->level;
    }
    auto s = std::make_unique<dvr_mpi_session>();
    s->mpi = std::make_unique<dvr::mpi::Session>(store->store, name, comm, o);
    s->local = std::make_unique<dvr_session>(s->mpi->local());
    *out = s.release();
  });
}

void dvr_mpi_session_close(dvr_mpi_session* session) { delete session; }

dvr_status dvr_mpi_local(dvr_mpi_session* session, dvr_session** out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = nullptr;
    require(fn, session, "session");
    *out = session->local.get();
  });
}

dvr_status dvr_mpi_partner(const dvr_mpi_session* session, int* out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, out, "out");
    *out = -1;
    require(fn, session, "session");
    *out = session->mpi->partner();
  });
}

dvr_status dvr_mpi_snapshot(dvr_mpi_session* session, const char* name, dvr_mpi_info* out) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    if (out) *out = dvr_mpi_info{};
    require(fn, session, "session");
    require(fn, name, "name");
    auto info = session->mpi->snapshot(name);
    if (out) copy_info(info, out);
  });
}

dvr_status dvr_mpi_restore_latest(dvr_mpi_session* session, char* name_buf, size_t buf_size) {
  const char* const fn = __func__;
  return guarded(fn, [&] {
    require(fn, name_buf, "name_buf");
    if (buf_size > 0) name_buf[0] = '\0';
    require(fn, session, "session");
    // Checked before the collective: a name that does not fit would be found
    // only after every rank restored.
    if (buf_size < DVR_NAME_MAX + 1)
      throw bad_argument(
          fn, "name_buf holds " + std::to_string(buf_size) + " bytes; it needs DVR_NAME_MAX + 1 (" + std::to_string(DVR_NAME_MAX + 1) + ")");
    auto name = session->mpi->restore_latest();
    if (!name)
      throw dvr::Error(dvr::Errc::not_found,
                       "session '" + session->local->session.name() + "' has no global snapshot that every rank can restore (a fresh start)");
    std::strncpy(name_buf, name->c_str(), buf_size - 1);
    name_buf[buf_size - 1] = '\0';
  });
}

}  // extern "C"
