// A parameter sweep with Memory DVR: load data once, snapshot it, and restore it
// between trials instead of reloading.
//
//   build/dvr-example-sweep [STORE_DIR]
#include <dvr/dvr.hpp>

#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

static std::vector<float> load_big_dataset() {
  std::vector<float> v(16 << 20);  // 64 MiB
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = std::sin(static_cast<float>(i) * 1e-3f);
  return v;
}

int main(int argc, char** argv) try {
  if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {  // --help, or a typo: never a store called "--help"
    std::fprintf(stderr, "usage: %s [STORE_DIR]   (default: the default store, $DVR_STORE or /dev/shm/dvr-$UID)\n", argv[0]);
    return argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") ? 0 : 2;
  }
  auto store = argc > 1 ? dvr::Store::open(argv[1]) : dvr::Store::open_default();
  dvr::Session s(store, "sweep");

  std::vector<float> data = load_big_dataset();
  s.track("data", data.data(), data.size() * sizeof(float));
  auto scratch = s.alloc("scratch", 16 << 20).as<double>();  // SDK-owned, page-aligned, zeroed
  s.snapshot("loaded", {.label = "after load", .replace = true});
  const double baseline = std::accumulate(data.begin(), data.end(), 0.0);

  for (float gain : {0.5f, 1.5f, 2.0f}) {
    for (auto& x : data)
      x *= gain;  // a trial that mutates the data
    scratch[0] = std::accumulate(data.begin(), data.end(), 0.0);
    std::printf("gain %.1f: sum %.3f\n", gain, scratch[0]);
    s.restore("loaded");  // data and scratch are bit-exact again
    if (std::accumulate(data.begin(), data.end(), 0.0) != baseline || scratch[0] != 0.0) {
      std::fprintf(stderr, "restore was not exact\n");
      return 1;
    }
  }
  for (auto& info : store.list("sweep"))
    std::printf("%s/%s: %llu bytes, %llu stored, parent '%s', label '%s'\n", info.session.c_str(), info.name.c_str(),
                static_cast<unsigned long long>(info.logical_bytes), static_cast<unsigned long long>(info.stored_bytes), info.parent.c_str(),
                info.label.c_str());
  store.remove("sweep", "loaded");
  store.gc();
  return 0;
} catch (const dvr::Error& e) {
  std::fprintf(stderr, "error (%s): %s\n", dvr::errc_name(e.code()), e.what());
  return 1;
}
