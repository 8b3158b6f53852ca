// The one owner of an mmap()ed range: unmapped on destruction, move-only.
#pragma once

#include <sys/mman.h>
#include <sys/types.h>

#include <cstddef>
#include <string>
#include <utility>

namespace dvr::detail {

class Mapping {
 public:
  Mapping() = default;

  /// `len` bytes (> 0) of the file open as `fd`, from `offset`, mapped with
  /// `prot` and `flags` (MAP_SHARED or MAP_PRIVATE, maybe MAP_POPULATE).
  /// Throws the errno's Error (no_space, permission, io, ...): "cannot map
  /// WHAT", where `what` names the file ("heap file /x/y", a path).
  static Mapping file(int fd, std::size_t len, int prot, int flags, const std::string& what, off_t offset = 0);

  /// `len` bytes of private zero-filled memory, not reserved in swap
  /// (MAP_NORESERVE), plus `extra_flags`. A zero `len` maps one byte (so
  /// data() is never null). Throws no_space: "cannot allocate LEN bytes
  /// PURPOSE", e.g. purpose "to receive a region".
  static Mapping anonymous(std::size_t len, const std::string& purpose, int prot = PROT_READ | PROT_WRITE, int extra_flags = 0);

  /// Takes over a range mapped elsewhere (MAP_FAILED or nullptr: none).
  static Mapping adopt(void* addr, std::size_t len) noexcept;

  ~Mapping() { reset(); }
  Mapping(Mapping&& o) noexcept : addr_(std::exchange(o.addr_, nullptr)), len_(std::exchange(o.len_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  void* data() const { return addr_; }
  char* bytes() const { return static_cast<char*>(addr_); }
  /// Bytes mapped.
  std::size_t size() const { return len_; }
  explicit operator bool() const { return addr_ != nullptr; }

  /// msync(MS_SYNC) of the whole range; throws the errno's Error: "cannot
  /// persist WHAT".
  void sync(const std::string& what) const;
  /// Unmaps now.
  void reset() noexcept;
  /// Gives up ownership: the caller unmaps [data(), data() + size()).
  void* release() noexcept;

 private:
  Mapping(void* addr, std::size_t len) : addr_(addr), len_(len) {}
  void* addr_ = nullptr;
  std::size_t len_ = 0;
};

}  // namespace dvr::detail
