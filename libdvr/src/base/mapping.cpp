#include "base/mapping.hpp"

#include <cerrno>
#include <utility>

#include "base/os.hpp"
#include "base/env.hpp"
#include "dvr/error.hpp"

namespace dvr::detail {

Mapping Mapping::file(int fd, std::size_t len, int prot, int flags, const std::string& what, off_t offset) {
  void* p = env().mmap(nullptr, len, prot, flags, fd, offset);
  if (p == MAP_FAILED) {
    if (errno == ENOMEM) throw OutOfAddressSpace("cannot map " + what);
    throw_errno(errno, "cannot map " + what);
  }
  return Mapping(p, len);
}

Mapping Mapping::anonymous(std::size_t len, const std::string& purpose, int prot, int extra_flags) {
  const std::size_t n = len == 0 ? 1 : len;
  void* p = ::mmap(nullptr, n, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | extra_flags, -1, 0);
  if (p == MAP_FAILED) throw Error(Errc::no_space, "cannot allocate " + std::to_string(len) + " bytes " + purpose);
  return Mapping(p, n);
}

Mapping Mapping::adopt(void* addr, std::size_t len) noexcept {
  if (addr == MAP_FAILED || addr == nullptr) return Mapping();
  return Mapping(addr, len);
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    reset();
    addr_ = std::exchange(o.addr_, nullptr);
    len_ = std::exchange(o.len_, 0);
  }
  return *this;
}

void Mapping::sync(const std::string& what) const {
  if (addr_ && env().msync(addr_, len_, MS_SYNC) != 0) throw_errno(errno, "cannot persist " + what);
}

void Mapping::reset() noexcept {
  if (addr_) env().munmap(addr_, len_);
  addr_ = nullptr;
  len_ = 0;
}

void* Mapping::release() noexcept {
  len_ = 0;
  return std::exchange(addr_, nullptr);
}

}  // namespace dvr::detail
