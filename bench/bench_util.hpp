// What the C++ benchmarks (dvr_bench.cpp, mpi_bench.cpp) share.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <string>

namespace dvrbench {

// Has the kernel read every page of [p, p+n) once, as a pwrite from it does
// (into 1 MiB of an unnamed file in `dir`, over and over). On a VM with
// shadow page tables (these machines) the kernel's first read of each page of
// a process costs ~2 ms per MiB, once (docs/performance.md, "Writing new
// space"): a peer measured on memory the kernel has not read yet would pay it
// while ours, measured after, would not — or the other way round. Best
// effort: without a file to write into, nothing is done.
inline void let_kernel_read(const std::string& dir, const char* p, std::size_t n) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {  // a file system without O_TMPFILE: a named file, unlinked at once
    std::string path = dir + "/dvr-bench-read.XXXXXX";
    fd = ::mkostemp(path.data(), O_CLOEXEC);
    if (fd < 0) return;
    ::unlink(path.c_str());
  }
  constexpr std::size_t kCall = 1u << 20;
  for (std::size_t off = 0; off < n; off += kCall)
    if (::pwrite(fd, p + off, std::min(kCall, n - off), 0) < 0) break;
  ::close(fd);
}

}  // namespace dvrbench
