// dvr-bench-job: the process that bench/proc_bench.py dumps. It holds --mib MiB
// of data, in anonymous memory or in a DVR persistent heap (--heap STORE),
// filled and pre-faulted, then idles. SIGUSR1 changes 1% of its pages (one in
// every hundred); each time its data is ready it writes "ready GEN" to --status.
// With --snapshot 1 the heap job snapshots its heap once loaded, as a DVR
// application would (its session then tracks writes since that snapshot).
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "dvr/dvr.hpp"

static volatile sig_atomic_t g_change = 0;

static void ready(const std::string& status, unsigned gen) {
  std::string tmp = status + ".tmp";
  if (FILE* f = std::fopen(tmp.c_str(), "w")) {
    std::fprintf(f, "ready %u\n", gen);
    std::fclose(f);
    std::rename(tmp.c_str(), status.c_str());
  }
}

int main(int argc, char** argv) {
  std::size_t mib = 64;
  std::string heap_store, status;
  bool snapshot = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--mib")
      mib = std::stoul(argv[i + 1]);
    else if (a == "--heap")
      heap_store = argv[i + 1];
    else if (a == "--status")
      status = argv[i + 1];
    else if (a == "--snapshot")
      snapshot = std::string(argv[i + 1]) == "1";
  }
  if (status.empty()) {
    std::fprintf(stderr, "usage: dvr-bench-job --status FILE [--mib N] [--heap STORE [--snapshot 1]]\n");
    return 2;
  }
  const std::size_t n = mib << 20;
  std::unique_ptr<dvr::Session> session;
  auto* p = static_cast<std::uint64_t*>(MAP_FAILED);
  if (!heap_store.empty()) {
    session = std::make_unique<dvr::Session>(dvr::Store::open(heap_store), snapshot ? "bench-app" : "bench-job");
    p = static_cast<std::uint64_t*>(session->alloc("data", n, {.persistent = true}).data());
  } else {
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return 1;
    p = static_cast<std::uint64_t*>(m);
  }
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (std::size_t i = 0; i < n / 8; ++i) {
    x += 0x9E3779B97F4A7C15ull;
    p[i] = x ^ (x >> 29);
  }
  if (session && snapshot) session->snapshot("loaded", {.replace = true});
  signal(SIGUSR1, [](int) { g_change = 1; });
  unsigned gen = 0;
  ready(status, gen);
  for (;;) {
    if (g_change) {
      g_change = 0;
      ++gen;
      for (std::size_t page = gen % 100; page < n / 4096; page += 100)
        p[page * 512 + gen % 512] += gen;
      ready(status, gen);
    }
    ::usleep(2000);
  }
}
