// Memory DVR — embeddable checkpoint/restore of application memory.
//
//   #include <dvr/dvr.hpp>
//   auto store = dvr::Store::open_default();
//   dvr::Session s(store, "sweep");
//   s.track("data", data.data(), data.size() * sizeof(float));
//   s.snapshot("loaded", {.label = "after load"});
//   ...
//   s.restore("loaded");
//
// store.hpp: the store (open, list, info, remove, gc, verify).
// session.hpp: sessions, regions, snapshot and restore.
// clone.hpp: thin copy-on-write clones of snapshots.
// error.hpp: dvr::Error and its codes.
// log.hpp: the log level and sink (DVR_LOG).
// jobs.hpp: the registry of running jobs and autosaves (STORE/run/) that dvr serve reads.
#pragma once

#include "dvr/arena.hpp"
#include "dvr/clone.hpp"
#include "dvr/error.hpp"
#include "dvr/export.h"
#include "dvr/jobs.hpp"
#include "dvr/log.hpp"
#include "dvr/session.hpp"
#include "dvr/store.hpp"

namespace dvr {
/// Library version, "MAJOR.MINOR.PATCH".
DVR_EXPORT const char* version() noexcept;
}  // namespace dvr
