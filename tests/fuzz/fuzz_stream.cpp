// libFuzzer target: the stream receiver (transfer/receive.cpp through
// dvr::transfer::receive), which takes snapshots from another machine and
// trusts nothing in them. Each input is received from a memory file into a
// private store on /dev/shm; anything but a complete, checked stream must be
// refused with dvr::Error, leaving the store as it was (checked: no snapshot
// appears). A stream it accepts is verified, then removed again so the store
// stays small.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "dvr/dvr.hpp"
#include "dvr/transfer.hpp"

namespace {

dvr::Store& store() {
  static dvr::Store s = [] {
    static char dir[] = "/dev/shm/dvr-fuzz-stream-XXXXXX";
    if (!::mkdtemp(dir)) std::abort();
    std::atexit([] { std::filesystem::remove_all(dir); });  // the store goes with the process
    return dvr::Store::open(std::string(dir) + "/store");
  }();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dvr::Store& s = store();
  int fd = ::memfd_create("fuzz-stream", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  for (std::size_t done = 0; done < size;) {
    ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += static_cast<std::size_t>(n);
  }
  ::lseek(fd, 0, SEEK_SET);
  dvr::transfer::ReceiveOptions options;
  options.max_logical_bytes = 1ull << 30;  // what a fuzz input may make the receiver store
  bool stored = false;
  try {
    dvr::transfer::receive(s, fd, options);
    stored = true;
  } catch (const dvr::Error&) {
  }
  ::close(fd);
  auto all = s.list();
  if (!stored && !all.empty()) std::abort();  // a refused stream left a snapshot behind
  if (stored) {
    if (!s.verify().ok()) std::abort();  // accepted, but not stored intact
    for (auto& i : all)
      s.remove(i.session, i.name);
  }
  return 0;
}
