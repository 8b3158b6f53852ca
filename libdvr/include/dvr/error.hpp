// Memory DVR — errors.
//
// Every failure is a dvr::Error: a code a program can branch on, and a message
// a person can act on (it names the store, session, snapshot or file involved
// and says what to do). A call that throws has changed nothing the caller can
// see: live memory is untouched and the store holds no partial snapshot.
#pragma once

#include <stdexcept>
#include <string>

#include "dvr/export.h"

namespace dvr {

enum class Errc {
  not_found,         // unknown session, snapshot, region or store
  already_exists,    // a snapshot or region of that name exists already
  corrupt,           // data or metadata failed its checksum, or is malformed
  no_space,          // the store's file system is full (or a file-size limit hit)
  invalid_argument,  // bad name, size mismatch, overlapping region, ...
  io,                // any other operating-system error
  unsupported,       // newer store format, missing kernel or file-system feature
  permission,        // store owned by another user, or not accessible
  cancelled,         // a background snapshot was cancelled before it was published
};

/// Short stable name of a code ("not_found", "corrupt", ...), for logs and JSON.
DVR_EXPORT const char* errc_name(Errc code) noexcept;

/// Exported with its typeinfo and vtable (DVR_EXPORT): thrown inside libdvr,
/// caught in the program.
class DVR_EXPORT Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
  Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

}  // namespace dvr
