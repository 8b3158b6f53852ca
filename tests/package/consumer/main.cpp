// An outside program using the installed Memory DVR: snapshot a buffer, change
// it, restore it, check it is bit-exact. Built by tests/package/run.sh twice:
// through find_package(dvr) (CMakeLists.txt here) and through pkg-config.
//
//   consumer STORE_DIR [EXPECTED_VERSION]
#include <dvr/dvr.hpp>

#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::fprintf(stderr, "usage: consumer STORE_DIR [EXPECTED_VERSION]\n");
    return 2;
  }
  if (argc > 2 && std::strcmp(dvr::version(), argv[2]) != 0) {
    std::fprintf(stderr, "consumer: libdvr says version %s, expected %s\n", dvr::version(), argv[2]);
    return 1;
  }
  auto store = dvr::Store::open(argv[1]);
  dvr::Session s(store, "consumer");
  std::vector<unsigned char> data(1 << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7 + 3);
  const std::vector<unsigned char> original = data;
  s.track("data", data.data(), data.size());
  s.snapshot("base", {.replace = true});
  for (std::size_t i = 0; i < data.size(); i += 4096) data[i] ^= 0xff;
  s.restore("base");
  if (data != original) {
    std::fprintf(stderr, "consumer: restore was not bit-exact\n");
    return 1;
  }
  std::printf("consumer: dvr %s, snapshot and restore of %zu bytes ok\n", dvr::version(), data.size());
  return 0;
} catch (const dvr::Error& e) {
  std::fprintf(stderr, "consumer: %s\n", e.what());
  return 1;
}
