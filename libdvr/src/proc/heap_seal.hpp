// Sealing the heaps of `dvr run --heap` programs at a dump (docs/criu.md,
// "Unmodified programs"; preload/README.md, "Sealing").
//
// Before CRIU runs, `dvr proc dump` asks each program's libdvr_heap.so,
// through its control pipe, to seal its heap: the program maps the heap file
// copy-on-write private for good and never writes the file again. The file
// then is the heap as it was at that moment, and it becomes the heap's
// snapshot as it is: linked into the store as a heap pack
// (packs/NNNNNNNN.heap, docs/format.md) and described by a manifest whose
// chunks point into it, hashed once, copied never. What the program writes
// after the seal is private memory that CRIU dumps with the rest of the
// process; a later dump of the same program finds the heap sealed already and
// inherits the previous heap snapshot without reading it.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "dvr/store.hpp"
#include "format/manifest.hpp"
#include "format/pack.hpp"
#include "proc/proc_heaps.hpp"

namespace dvr::detail::heaps {

/// The environment variable that tells the CRIU plugin which heap files
/// `dvr proc dump` snapshotted itself (sealed): one "BYTES<tab>PATH" a line.
inline constexpr const char* kSealedEnv = "DVR_CRIU_SEALED_HEAPS";

/// $DVR_PROC_HEAP_SEAL=0 turns sealing off: heaps are then copied into the
/// store at every dump, as for SDK heaps (a snapshot independent of the heap
/// file, at the cost of the copy).
bool sealing_enabled();

/// Seals the heaps of libdvr_heap.so that the processes of `tree` map, and
/// publishes each sealed file as snapshot `snapshot` of its heap session, in
/// place (through `store` when that is the heap's store). `base`: the heap
/// snapshots' name in the previous dump ("" = none): a heap still sealed over
/// the same file copies its chunk table instead of reading the file. A heap whose program does not answer within a few seconds (stopped,
/// or a shim without a control pipe), or cannot seal, is left out, with a
/// line in `skipped` saying why: the CRIU plugin snapshots it by copying, as
/// before. Throws only for what must stop the dump (the store refuses the
/// snapshot: it exists already, no space).
std::vector<HeapFile> seal_heaps(Store& store, const std::vector<pid_t>& tree, const std::string& snapshot, const std::string& base,
                                 std::vector<std::string>* skipped = nullptr);

/// Wakes the libdvr_heap.so of each heap of `heaps` that a process of
/// `tree` holds (through its control pipe): after a restore, so that it
/// notices at once that it was restored (its identity, and that of the
/// program it may exec, changed). Best effort.
void wake_shims(const std::vector<std::string>& heaps, const std::vector<pid_t>& tree);

/// The lines of kSealedEnv for `heaps`, and back.
std::string format_sealed(const std::vector<HeapFile>& heaps);
std::vector<HeapFile> parse_sealed(const std::string& text);

/// Pack id of the heap pack holding region `region` of manifest `m` in place
/// (every chunk that is not zero at offset j * chunk_size of that one heap
/// pack, none with pages stored apart), or 0.
std::uint32_t in_place_pack(const Manifest& m, const std::string& region, std::uint64_t bytes, Packs& packs);

}  // namespace dvr::detail::heaps
