// `dvr demo`: the parameter-sweep story in one command.
#pragma once

#include <cstdint>

#include "dvr/dvr.hpp"
#include "progress.hpp"

namespace dvr::cli {

struct DemoOptions {
  std::uint64_t size = 1ull << 30;  // bytes of feature data
  int trials = 5;
  bool json = false;
  /// How the first (full) snapshot shows its progress (dvr --progress).
  ProgressMode progress = ProgressMode::automatic;
};

/// Builds a data set, snapshots it, runs trials that mutate it with a restore
/// between each, checks a checksum after every restore, prints a table.
/// Returns the process exit status (non-zero if a checksum did not match).
int run_demo(Store& store, const DemoOptions& options);

}  // namespace dvr::cli
