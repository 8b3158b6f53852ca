// heap_probe: an ordinary, unmodified C program that tests/proc/test_run_heap.py
// runs under `dvr run --heap`. It knows nothing of DVR: it allocates with the
// C library's interfaces (which libdvr_heap.so's jemalloc serves), reports
// what it got on stdout, one "KEY VALUE..." line at a time (flushed), and
// waits for the test between steps: `wait NAME` polls for the file CTL/NAME.
//
//   heap_probe alloc CTL    malloc family, operator new (looked up at run
//                           time: jemalloc's, as a C++ program would get it),
//                           anonymous mmap; patterns written, checked, then 4
//                           threads allocating and freeing at once
//   heap_probe purge CTL    512 MiB touched, freed, arena.0.purge
//   heap_probe fork CTL     fork: child and parent see their own memory
//   heap_probe exec CTL     a forked child execs /bin/cat /proc/self/maps; the
//                           probe then execs itself (reexec)
//   heap_probe enomem CTL [BLOCK_KIB]  allocations past the heap's end fail,
//                           the program goes on; the freed heap serves a big block
//   heap_probe hold CTL MIB MIB of data, a checksum of it, then waits
//   heap_probe sealed CTL   64 MiB kept; after `wait go` (the test dumps the
//                           process first, which seals its heap) allocates,
//                           callocs, maps and frees far more than the heap
//                           holds, on 4 threads too, checks every block and
//                           that the kept bytes are intact, then waits
//   heap_probe sleep CTL    just waits (the refused static build)
//
// Build: cc -O1 -pthread -o heap_probe heap_probe.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024ul * 1024ul)

static const char* g_ctl = ".";
static char g_self[4096];

static void out(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void out(const char* fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n > sizeof buf - 2) n = sizeof buf - 2;
  buf[n++] = '\n';
  // One write per line: parent and child share the output file.
  (void)!write(1, buf, (size_t)n);
}

static void wait_for(const char* name) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", g_ctl, name);
  out("wait %s", name);
  while (access(path, F_OK) != 0) {
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

static void idle(void) {
  out("idle");
  for (;;)
    pause();
}

// A region filled with its tag repeated (16 bytes), so that the test can find
// it in the heap file; check() verifies it in memory.
static void fill(void* p, size_t n, const char* tag) {
  char t[16];
  memset(t, '.', sizeof t);
  memcpy(t, tag, strlen(tag) < 16 ? strlen(tag) : 16);
  for (size_t i = 0; i < n; i += 16)
    memcpy((char*)p + i, t, n - i < 16 ? n - i : 16);
}

static int check(const void* p, size_t n, const char* tag) {
  char t[16];
  memset(t, '.', sizeof t);
  memcpy(t, tag, strlen(tag) < 16 ? strlen(tag) : 16);
  for (size_t i = 0; i < n; i += 16)
    if (memcmp((const char*)p + i, t, n - i < 16 ? n - i : 16) != 0) return 0;
  return 1;
}

static int all_zero(const void* p, size_t n) {
  const unsigned char* c = p;
  for (size_t i = 0; i < n; ++i)
    if (c[i]) return 0;
  return 1;
}

// "region NAME ADDR SIZE TAG": the block and the tag it is filled with.
static void region(const char* name, void* p, size_t n, const char* tag) {
  out("region %s %#lx %zu %s", name, (unsigned long)(uintptr_t)p, n, tag ? tag : "-");
}

// ---- alloc -------------------------------------------------------------------
#define THREADS 4
#define ROUNDS 20000
#define LIVE 64
static uintptr_t g_heap_lo = 0x200000000000ul, g_heap_hi;

struct thread_result {
  int index, bad, outside_big, big;
};

static void* allocator_thread(void* arg) {
  struct thread_result* r = arg;
  unsigned seed = 12345u + (unsigned)r->index;
  unsigned char tag = (unsigned char)(0x41 + r->index);
  struct {
    unsigned char* p;
    size_t n;
    unsigned char v;
  } live[LIVE] = {{0}};
  for (int round = 0; round < ROUNDS; ++round) {
    int k = rand_r(&seed) % LIVE;
    if (live[k].p) {
      for (size_t i = 0; i < live[k].n; i += 61)
        if (live[k].p[i] != live[k].v) r->bad++;
      if (live[k].p[live[k].n - 1] != live[k].v) r->bad++;
      free(live[k].p);
      live[k].p = NULL;
    }
    size_t n = (round % 500 == 0) ? 2 * MIB + (size_t)(rand_r(&seed) % 4096) : 1 + (size_t)(rand_r(&seed) % 65536);
    unsigned char* p = (round % 7 == 0) ? calloc(1, n) : malloc(n);
    if (!p) {
      r->bad++;
      continue;
    }
    if (round % 7 == 0 && !all_zero(p, n)) r->bad++;
    if (n >= MIB) {
      r->big++;
      if ((uintptr_t)p < g_heap_lo || (uintptr_t)p + n > g_heap_hi) r->outside_big++;
    }
    unsigned char v = (unsigned char)(tag + round);
    memset(p, v, n);
    live[k].p = p;
    live[k].n = n;
    live[k].v = v;
  }
  for (int k = 0; k < LIVE; ++k)
    free(live[k].p);
  return NULL;
}

static void mode_alloc(void) {
  const char* env_size = getenv("DVR_HEAP_SIZE");
  g_heap_hi = g_heap_lo + (env_size ? strtoull(env_size, NULL, 10) : 0);
  int bad = 0;
#define EXPECT(cond, what)                   \
  do {                                       \
    if (!(cond)) {                           \
      out("bad %s", what);                   \
      ++bad;                                 \
    }                                        \
  } while (0)

  // A few small ones first (may come from before the heap was in place).
  void* tiny = malloc(24);
  region("tiny", tiny, 24, NULL);

  size_t n_malloc = 64 * MIB;
  char* m = malloc(n_malloc);
  EXPECT(m, "malloc");
  fill(m, n_malloc, "MALLOC-64M");
  region("malloc", m, n_malloc, "MALLOC-64M");
  EXPECT(malloc_usable_size(m) >= n_malloc, "malloc_usable_size");
  out("usable malloc %zu", malloc_usable_size(m));

  // calloc of fresh memory, and of memory just freed dirty.
  char* c = calloc(16, 4 * MIB);
  EXPECT(c && all_zero(c, 64 * MIB), "calloc zero");
  fill(c, 64 * MIB, "CALLOC-64M");
  region("calloc", c, 64 * MIB, "CALLOC-64M");
  char* dirty = malloc(32 * MIB);
  EXPECT(dirty, "malloc dirty");
  memset(dirty, 0xab, 32 * MIB);
  free(dirty);
  char* c2 = calloc(1, 32 * MIB);
  EXPECT(c2 && all_zero(c2, 32 * MIB), "calloc after free zero");
  out("calloc_reused %d", c2 == dirty);
  fill(c2, 32 * MIB, "CALLOC-REUSED");
  region("calloc2", c2, 32 * MIB, "CALLOC-REUSED");
  char* csmall = calloc(1000, 40);  // small size class, slab memory
  EXPECT(csmall && all_zero(csmall, 40000), "small calloc zero");

  // realloc: grows to 300 MiB keeping the first MiB, then shrinks.
  char* r = malloc(MIB);
  EXPECT(r, "malloc for realloc");
  fill(r, MIB, "REALLOC-HEAD");
  size_t n_huge = 300 * MIB;
  char* r2 = realloc(r, n_huge);
  EXPECT(r2, "huge realloc");
  EXPECT(r2 && check(r2, MIB, "REALLOC-HEAD"), "realloc kept the first MiB");
  fill(r2 + MIB, n_huge - MIB, "REALLOC-TAIL");
  EXPECT(check(r2 + MIB, n_huge - MIB, "REALLOC-TAIL"), "huge realloc content");
  region("realloc_head", r2, MIB, "REALLOC-HEAD");
  region("realloc", r2 + MIB, n_huge - MIB, "REALLOC-TAIL");

  // The aligned ones.
  void* pm = NULL;
  int rc = posix_memalign(&pm, MIB, 8 * MIB);
  EXPECT(rc == 0 && pm && ((uintptr_t)pm & (MIB - 1)) == 0, "posix_memalign");
  fill(pm, 8 * MIB, "POSIX-MEMALIGN");
  region("posix_memalign", pm, 8 * MIB, "POSIX-MEMALIGN");
  void* aa = aligned_alloc(64 * 1024, 4 * MIB);
  EXPECT(aa && ((uintptr_t)aa & (64 * 1024 - 1)) == 0, "aligned_alloc");
  fill(aa, 4 * MIB, "ALIGNED-ALLOC");
  region("aligned_alloc", aa, 4 * MIB, "ALIGNED-ALLOC");
  void* ma = memalign(2 * MIB, 16 * MIB);
  EXPECT(ma && ((uintptr_t)ma & (2 * MIB - 1)) == 0, "memalign");
  fill(ma, 16 * MIB, "MEMALIGN");
  region("memalign", ma, 16 * MIB, "MEMALIGN");
  void* va = valloc(12 * MIB);
  EXPECT(va && ((uintptr_t)va & 4095) == 0, "valloc");
  fill(va, 12 * MIB, "VALLOC");
  region("valloc", va, 12 * MIB, "VALLOC");
  EXPECT(malloc_usable_size(va) >= 12 * MIB, "malloc_usable_size valloc");

  // C++ operator new / new[] / delete, as a C++ program links them.
  void* (*op_new)(size_t) = (void* (*)(size_t))dlsym(RTLD_DEFAULT, "_Znwm");
  void* (*op_new_arr)(size_t) = (void* (*)(size_t))dlsym(RTLD_DEFAULT, "_Znam");
  void (*op_delete)(void*) = (void (*)(void*))dlsym(RTLD_DEFAULT, "_ZdlPv");
  void (*op_delete_arr)(void*) = (void (*)(void*))dlsym(RTLD_DEFAULT, "_ZdaPv");
  void* cxx = NULL;
  void* cxx_arr = NULL;
  if (op_new && op_delete && op_new_arr && op_delete_arr) {
    Dl_info info;
    if (dladdr((void*)op_new, &info) && info.dli_fname) out("operator_new_from %s", info.dli_fname);
    cxx = op_new(48 * MIB);
    fill(cxx, 48 * MIB, "CXX-NEW");
    region("new", cxx, 48 * MIB, "CXX-NEW");
    cxx_arr = op_new_arr(6 * MIB);
    fill(cxx_arr, 6 * MIB, "CXX-NEW-ARRAY");
    region("new_array", cxx_arr, 6 * MIB, "CXX-NEW-ARRAY");
  } else {
    out("operator_new_from none");
  }

  // The program's own anonymous mmap: in the heap. PROT_NONE reservations and
  // shared mappings are the kernel's.
  size_t n_map = 32 * MIB;
  char* mm = mmap(NULL, n_map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT(mm != MAP_FAILED, "mmap");
  EXPECT(mm != MAP_FAILED && all_zero(mm, n_map), "mmap zero");
  fill(mm, n_map, "ANON-MMAP");
  region("mmap", mm, n_map, "ANON-MMAP");
  char* none = mmap(NULL, MIB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  EXPECT(none != MAP_FAILED, "mmap PROT_NONE");
  region("mmap_prot_none", none, MIB, NULL);
  char* shared = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT(shared != MAP_FAILED, "mmap MAP_SHARED");
  region("mmap_shared", shared, MIB, NULL);

  // Everything still holds its own pattern (no two blocks overlap).
  EXPECT(check(m, n_malloc, "MALLOC-64M"), "malloc content");
  EXPECT(check(c, 64 * MIB, "CALLOC-64M"), "calloc content");
  EXPECT(check(c2, 32 * MIB, "CALLOC-REUSED"), "calloc2 content");
  EXPECT(check(pm, 8 * MIB, "POSIX-MEMALIGN"), "posix_memalign content");
  EXPECT(check(aa, 4 * MIB, "ALIGNED-ALLOC"), "aligned_alloc content");
  EXPECT(check(ma, 16 * MIB, "MEMALIGN"), "memalign content");
  EXPECT(check(va, 12 * MIB, "VALLOC"), "valloc content");
  EXPECT(!cxx || check(cxx, 48 * MIB, "CXX-NEW"), "new content");
  EXPECT(!cxx_arr || check(cxx_arr, 6 * MIB, "CXX-NEW-ARRAY"), "new[] content");
  EXPECT(check(mm, n_map, "ANON-MMAP"), "mmap content");
  EXPECT(check(r2, MIB, "REALLOC-HEAD") && check(r2 + MIB, n_huge - MIB, "REALLOC-TAIL"), "huge realloc content");
  out("checked bad=%d", bad);
  wait_for("inspected");

  char* r3 = realloc(r2, 2 * MIB);  // shrinks (in place, or a copy)
  EXPECT(r3 && check(r3, MIB, "REALLOC-HEAD") && check(r3 + MIB, MIB, "REALLOC-TAIL"), "realloc shrink kept content");
  region("realloc_shrunk", r3, 2 * MIB, NULL);

  free(m);
  free(c);
  free(c2);
  free(csmall);
  free(r3);
  free(pm);
  free(aa);
  free(ma);
  free(va);
  free(tiny);
  if (cxx) op_delete(cxx);
  if (cxx_arr) op_delete_arr(cxx_arr);
  EXPECT(munmap(mm, n_map) == 0, "munmap");
  EXPECT(munmap(none, MIB) == 0, "munmap PROT_NONE");
  EXPECT(munmap(shared, MIB) == 0, "munmap shared");
  // The munmapped range is free space again: a new mapping reads zero.
  char* mm2 = mmap(NULL, n_map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT(mm2 != MAP_FAILED && all_zero(mm2, n_map), "mmap after munmap zero");
  region("mmap_again", mm2, n_map, NULL);
  munmap(mm2, n_map);

  pthread_t th[THREADS];
  struct thread_result res[THREADS];
  memset(res, 0, sizeof res);
  for (int i = 0; i < THREADS; ++i) {
    res[i].index = i;
    if (pthread_create(&th[i], NULL, allocator_thread, &res[i]) != 0) EXPECT(0, "pthread_create");
  }
  int tbad = 0, outside = 0, big = 0;
  for (int i = 0; i < THREADS; ++i) {
    pthread_join(th[i], NULL);
    tbad += res[i].bad;
    outside += res[i].outside_big;
    big += res[i].big;
  }
  out("threads %d rounds=%d bad=%d big=%d outside_big=%d", THREADS, ROUNDS, tbad, big, outside);
  out("done bad=%d", bad);
  idle();
}

// ---- purge -------------------------------------------------------------------
static void mode_purge(void) {
  enum { SMALL = 256 };
  char* big = malloc(256 * MIB);
  char* pieces[SMALL];
  int ok = big != NULL;
  if (big) memset(big, 0x5a, 256 * MIB);
  for (int i = 0; i < SMALL; ++i) {
    pieces[i] = malloc(MIB);
    if (!pieces[i]) ok = 0;
    else memset(pieces[i], 0x33 + i, MIB);
  }
  region("big", big, 256 * MIB, NULL);
  out("touched ok=%d", ok);
  wait_for("free");
  free(big);
  for (int i = 0; i < SMALL; ++i)
    free(pieces[i]);
  int (*mallctl_fn)(const char*, void*, size_t*, void*, size_t) =
      (int (*)(const char*, void*, size_t*, void*, size_t))dlsym(RTLD_DEFAULT, "mallctl");
  int rc = mallctl_fn ? mallctl_fn("arena.0.purge", NULL, NULL, NULL, 0) : -1;
  out("purged rc=%d", rc);
  idle();
}

// ---- fork --------------------------------------------------------------------
static void mode_fork(void) {
  size_t n = 64 * MIB;
  char* a = malloc(n);  // written before the fork
  char* b = malloc(n);  // written by the parent while the child lives
  if (!a || !b) {
    out("bad malloc");
    idle();
  }
  fill(a, n, "PARENT-BEFORE");
  fill(b, n, "PARENT-B-OLD");
  region("a", a, n, "PARENT-BEFORE");
  region("b", b, n, "PARENT-B-OLD");
  wait_for("fork");
  pid_t child = fork();
  if (child < 0) {
    out("bad fork");
    idle();
  }
  if (child == 0) {
    out("child pid=%d sees_parent=%d", (int)getpid(), check(a, n, "PARENT-BEFORE"));
    fill(a, n, "CHILD-WROTE-A");
    fill(b, n, "CHILD-WROTE-B");
    // Memory the child allocates itself is its own (not the heap's).
    char* own = malloc(8 * MIB);
    if (own) fill(own, 8 * MIB, "CHILD-OWN");
    out("child wrote ok=%d own=%#lx", check(a, n, "CHILD-WROTE-A") && check(b, n, "CHILD-WROTE-B"),
        (unsigned long)(uintptr_t)own);
    wait_for("child-exit");
    _exit(0);
  }
  // While the child runs: the parent rewrites b (its private copy).
  fill(b, n, "PARENT-DURING");
  out("parent wrote_during ok=%d", check(b, n, "PARENT-DURING"));
  int st = 0;
  pid_t w = waitpid(child, &st, 0);
  out("child exited=%d status=%d", w == child, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  out("parent intact a=%d b=%d", check(a, n, "PARENT-BEFORE"), check(b, n, "PARENT-DURING"));
  wait_for("write-after");
  fill(a, n, "PARENT-AFTER");
  out("parent wrote_after ok=%d", check(a, n, "PARENT-AFTER"));
  idle();
}

// ---- exec --------------------------------------------------------------------
static void mode_exec(void) {
  size_t n = 16 * MIB;
  char* a = malloc(n);
  if (!a) {
    out("bad malloc");
    idle();
  }
  fill(a, n, "BEFORE-EXEC");
  region("a", a, n, "BEFORE-EXEC");
  char maps[4200];
  snprintf(maps, sizeof maps, "%s/child.maps", g_ctl);
  pid_t child = fork();
  if (child == 0) {
    int fd = open(maps, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) _exit(126);
    dup2(fd, 1);
    close(fd);
    execl("/bin/cat", "cat", "/proc/self/maps", (char*)NULL);
    _exit(127);
  }
  int st = 0;
  waitpid(child, &st, 0);
  out("cat exited status=%d", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  wait_for("reexec");
  char addr[64];
  snprintf(addr, sizeof addr, "%#lx", (unsigned long)(uintptr_t)a);
  execl(g_self, g_self, "reexec", g_ctl, addr, (char*)NULL);
  out("bad exec %s", strerror(errno));
  idle();
}

static void mode_reexec(const char* old) {
  unsigned long a = strtoul(old, NULL, 16);
  out("reexec pid=%d", (int)getpid());
  // The old program's block: in the heap's range, which this program maps
  // again, emptied: none of the old program's bytes are left (this
  // program's own first allocations may lie there by now).
  const char* pat = "BEFORE-EXEC";
  int gone = !memmem((void*)0x200000000000ul, 16 * MIB, pat, strlen(pat)) && !memmem((void*)a, 16 * MIB, pat, strlen(pat));
  out("reexec old_data_gone=%d", gone);
  char* p = malloc(16 * MIB);
  if (p) fill(p, 16 * MIB, "AFTER-EXEC");
  region("after", p, 16 * MIB, "AFTER-EXEC");
  idle();
}

// ---- enomem ------------------------------------------------------------------
// Past the heap's end malloc and mmap fail with ENOMEM; the program fills the
// heap with BLOCK_KIB blocks until malloc says no, frees them all and goes on:
// a small block, then a block of half the heap (right away, and after
// arena.0.purge).
static void mode_enomem(size_t block) {
  errno = 0;
  void* huge = malloc(1024 * MIB);
  out("malloc_1g ptr=%#lx errno=%d", (unsigned long)(uintptr_t)huge, errno);
  errno = 0;
  void* map = mmap(NULL, 1024 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  out("mmap_1g failed=%d errno=%d", map == MAP_FAILED, errno);
  if (huge) free(huge);
  if (map != MAP_FAILED) munmap(map, 1024 * MIB);
  const char* env_size = getenv("DVR_HEAP_SIZE");
  size_t heap = env_size ? strtoull(env_size, NULL, 10) : 0;
  static char* blocks[65536];
  int got = 0;
  size_t in_heap = 0;
  while (got < 65536) {
    char* p = malloc(block);
    if (!p) break;
    memset(p, 0x77, block);
    if ((uintptr_t)p >= 0x200000000000ul && (uintptr_t)p + block <= 0x200000000000ul + heap) in_heap++;
    blocks[got++] = p;
  }
  out("filled blocks=%d in_heap=%zu errno=%d", got, in_heap, errno);
  for (int i = 0; i < got; ++i)
    free(blocks[i]);
  char* small = malloc(block);
  if (small) memset(small, 1, block);
  region("small", small, block, NULL);
  out("continues ok=%d", small != NULL);
  free(small);
  size_t half = heap / 2;
  char* big = malloc(half);
  out("reuse_half ok=%d", big != NULL);
  if (!big) {
    int (*mallctl_fn)(const char*, void*, size_t*, void*, size_t) =
        (int (*)(const char*, void*, size_t*, void*, size_t))dlsym(RTLD_DEFAULT, "mallctl");
    int rc = mallctl_fn ? mallctl_fn("arena.0.purge", NULL, NULL, NULL, 0) : -1;
    big = malloc(half);
    out("purge rc=%d", rc);
  }
  if (big) memset(big, 2, half);
  region("half", big, half, NULL);
  out("reuse_half_after_purge ok=%d", big != NULL);
  idle();
}

// ---- hold --------------------------------------------------------------------
static void mode_hold(size_t mib) {
  size_t n = mib * MIB;
  unsigned char* p = malloc(n);
  if (!p) {
    out("bad malloc");
    idle();
  }
  uint64_t x = 0x9e3779b97f4a7c15ull, sum = 0;
  for (size_t i = 0; i < n; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    memcpy(p + i, &x, 8);
    sum += x;
  }
  region("data", p, n, NULL);
  out("sum %016llx", (unsigned long long)sum);
  idle();
}

// ---- sealed -----------------------------------------------------------------
// After its heap was sealed (by a dump), the program goes on as before: freed
// memory is handed out again (zeroed where calloc and mmap promise zero), so
// it can allocate over and over what the heap could hold only once.
static void mode_sealed(void) {
  const char* env_size = getenv("DVR_HEAP_SIZE");
  size_t heap = env_size ? strtoull(env_size, NULL, 10) : 0;
  g_heap_hi = g_heap_lo + heap;
  char* keep = malloc(64 * MIB);
  if (!keep) {
    out("bad malloc");
    idle();
  }
  fill(keep, 64 * MIB, "KEPT-BEFORE");
  region("kept", keep, 64 * MIB, "KEPT-BEFORE");
  wait_for("go");
  size_t total = 0;
  int rounds = 0, bad = 0, in_heap = 0;
  while (total < 6 * heap && rounds < 1000) {
    char* a = malloc(heap / 4);
    char* z = calloc(1, heap / 8);
    void* m = mmap(NULL, heap / 16, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!a || !z || m == MAP_FAILED) {
      out("bad round %d a=%d z=%d m=%d", rounds, a != NULL, z != NULL, m != MAP_FAILED);
      ++bad;
      break;
    }
    if (!all_zero(z, heap / 8)) ++bad;
    if (!all_zero(m, heap / 16)) ++bad;
    in_heap += (uintptr_t)a >= g_heap_lo && (uintptr_t)a + heap / 4 <= g_heap_hi;
    char tag[16];
    snprintf(tag, sizeof tag, "ROUND-%d", rounds);
    fill(a, heap / 4, tag);
    memset(z, 0x5a, heap / 8);
    memset(m, 0xa5, heap / 16);
    if (!check(a, heap / 4, tag)) ++bad;
    free(a);
    free(z);
    munmap(m, heap / 16);
    total += heap / 4 + heap / 8 + heap / 16;
    ++rounds;
  }
  struct thread_result r[THREADS];
  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; ++i) {
    memset(&r[i], 0, sizeof r[i]);
    r[i].index = i;
    pthread_create(&th[i], NULL, allocator_thread, &r[i]);
  }
  int thread_bad = 0;
  for (int i = 0; i < THREADS; ++i) {
    pthread_join(th[i], NULL);
    thread_bad += r[i].bad;
  }
  out("churn rounds=%d mib=%zu bad=%d in_heap=%d threads_bad=%d kept_ok=%d", rounds, total / MIB, bad, in_heap, thread_bad,
      check(keep, 64 * MIB, "KEPT-BEFORE"));
  idle();
}

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IONBF, 0);
  if (argc < 3) {
    fprintf(stderr, "usage: heap_probe MODE CTL [ARG]\n");
    return 2;
  }
  ssize_t len = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
  if (len > 0) g_self[len] = 0;
  g_ctl = argv[2];
  const char* mode = argv[1];
  out("start %s pid=%d", mode, (int)getpid());
  if (!strcmp(mode, "alloc")) mode_alloc();
  if (!strcmp(mode, "purge")) mode_purge();
  if (!strcmp(mode, "fork")) mode_fork();
  if (!strcmp(mode, "exec")) mode_exec();
  if (!strcmp(mode, "reexec") && argc > 3) mode_reexec(argv[3]);
  if (!strcmp(mode, "enomem")) mode_enomem(argc > 3 ? strtoul(argv[3], NULL, 10) * 1024 : MIB);
  if (!strcmp(mode, "hold") && argc > 3) mode_hold(strtoul(argv[3], NULL, 10));
  if (!strcmp(mode, "sealed")) mode_sealed();
  if (!strcmp(mode, "sleep")) idle();
  fprintf(stderr, "heap_probe: unknown mode %s\n", mode);
  return 2;
}
