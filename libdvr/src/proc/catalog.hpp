// Process snapshots as a store holds them: proc/NAME and the heap snapshots
// SESSION/proc.NAME it refers to (list(), info() and remove() of dvr/proc.hpp).
#pragma once

#include <cstdint>

#include "dvr/proc.hpp"
#include "proc/proc_heaps.hpp"

namespace dvr::proc::impl {

/// The heap snapshots of `p`, each where it is: `store` when it holds it (it
/// came here with the process snapshot), else the heap's own store.
detail::heaps::HeapImage heap_image_in(const Store& store, const ProcInfo& p);
/// Bytes the heap snapshots of a process snapshot added to their stores;
/// marks each heap of `p` that was sealed (HeapRef::sealed).
std::uint64_t account_heaps(const Store& store, ProcInfo& p);

}  // namespace dvr::proc::impl
