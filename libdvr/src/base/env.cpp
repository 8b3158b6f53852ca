#include "base/env.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

namespace dvr::detail {

Env::~Env() = default;
int Env::open(const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); }
ssize_t Env::write(int fd, const void* data, std::size_t len) { return ::write(fd, data, len); }
ssize_t Env::pwrite(int fd, const void* data, std::size_t len, off_t offset) { return ::pwrite(fd, data, len, offset); }
ssize_t Env::pwritev(int fd, const struct iovec* iov, int count, off_t offset) { return ::pwritev(fd, iov, count, offset); }
int Env::ftruncate(int fd, off_t length) { return ::ftruncate(fd, length); }
int Env::fallocate(int fd, int mode, off_t offset, off_t len) { return ::fallocate(fd, mode, offset, len); }
int Env::posix_fallocate(int fd, off_t offset, off_t len) { return ::posix_fallocate(fd, offset, len); }
int Env::fsync(int fd) { return ::fsync(fd); }
int Env::fdatasync(int fd) { return ::fdatasync(fd); }
int Env::sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags) { return ::sync_file_range(fd, offset, nbytes, flags); }
void* Env::mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t offset) { return ::mmap(addr, len, prot, flags, fd, offset); }
int Env::munmap(void* addr, std::size_t len) { return ::munmap(addr, len); }
int Env::msync(void* addr, std::size_t len, int flags) { return ::msync(addr, len, flags); }
int Env::rename(const char* from, const char* to) { return ::rename(from, to); }
int Env::link(const char* from, const char* to) { return ::link(from, to); }
int Env::unlink(const char* path) { return ::unlink(path); }
int Env::mkdir(const char* path, mode_t mode) { return ::mkdir(path, mode); }
int Env::rmdir(const char* path) { return ::rmdir(path); }

namespace {
constinit Env real;  // constant-initialized: usable from any static initializer
}

Env& real_env() { return real; }

namespace env_detail {
constinit Env* current = &real;
}

Env* set_env(Env* e) {
  Env* old = env_detail::current;
  env_detail::current = e ? e : &real_env();
  return old;
}

}  // namespace dvr::detail
