// libdvr_heap.so — the heap of `dvr run --heap` (design: README.md here).
//
// Preloaded into an unmodified, dynamically linked program, it puts the
// program's heap into a DVR persistent heap: one store file mapped MAP_SHARED
// at a fixed address. CRIU records such a mapping by path and copies none of
// its pages; the CRIU plugin snapshots the file into the store, only the pages
// written since the last dump (userfaultfd write-protection, as sessions do).
//
//   malloc family, C++ new/delete: jemalloc 5.3 (libjemalloc.so.2, linked
//     here, so it interposes the C library's malloc), one arena whose extent
//     hooks hand out address space of the heap and punch holes in the file
//     for memory jemalloc purges.
//   mmap(MAP_PRIVATE|MAP_ANONYMOUS) the program makes itself: pages of the
//     heap (munmap punches them), except PROT_NONE reservations, MAP_FIXED,
//     huge pages and stacks, which go to the kernel as before.
//   fork(): the heap becomes copy-on-write private in the parent before the
//     child exists, so parent and child each see the memory of the moment of
//     the fork and the child never writes into the file; once no child maps
//     the file any more, the parent's changed pages go back into the file
//     (writers wait for the few milliseconds this takes) and the heap is
//     shared again.
//   exec: a program exec'd by a forked child runs without a heap; the heap's
//     own process exec'ing another program starts it with an empty heap (a
//     new file: the old one may be a snapshot's).
//   seal (asked by `dvr proc dump` through the control pipe): the heap is
//     mapped copy-on-write private over the file for good, and the file is
//     never written again; the store takes it as the dump's heap snapshot
//     without copying it (a heap pack), and CRIU dumps only the pages the
//     program wrote since. Freed memory is then given back by mapping fresh
//     anonymous memory over it, instead of punching the file.
//
// It talks to `dvr run` and the plugin through files beside the heap file
// HEAP (STORE/heaps/SESSION/REGION):
//   .REGION.status  "ok" once the heap is in place, or "error: why"
//   .REGION.shim    "dvr-heap-shim 2 / process START_TIME PID_NS /
//                   range ADDR BYTES / control WFD RFD PIPE_INO WAKE_FD /
//                   sealed INO": the process whose heap this is (the
//                   plugin compares the PID namespace: the start time a
//                   restored process reads of itself is shifted by its time
//                   namespace), that its writes are tracked (rewritten
//                   after a restore), the control pipe's ends (WFD takes
//                   requests, RFD gives answers; PIPE_INO identifies the
//                   request pipe in /proc/PID/fd, as does WAKE_FD, its other
//                   end, after a restore) and the inode of the file
//                   the heap is sealed over (0: not sealed)
// Everything here runs inside an arbitrary program, possibly before its main
// and inside fork handlers: no C++, no malloc of its own where jemalloc may
// hold a lock, raw system calls, static buffers.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jemalloc/jemalloc.h>
#include <linux/falloc.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define PAGE 4096ul

// jemalloc reads this before its first allocation: one arena (all threads
// share it; its thread caches keep them apart), no separate arena for huge
// allocations, so every extent comes from the hooks of arena 0.
// retain:false: jemalloc gives extents it no longer needs back (dalloc) and
// may merge extents of separate allocations, so freed heap space serves
// larger blocks later (with retain, extents from separate hook calls never
// merge and a bounded heap could not reuse freed space for a bigger block).
EXPORT const char* malloc_conf = "narenas:1,oversize_threshold:0,retain:false";

// ---- constants newer than Debian 12's kernel headers -------------------
#define FEATURE_WP_UNPOPULATED (1ull << 13)
#define FEATURE_WP_ASYNC (1ull << 15)
#define UFFD_USER_MODE_ONLY_ 1
#define PAGE_IS_WPALLOWED (1ull << 0)
#define PAGE_IS_FILE (1ull << 2)
#define PAGE_IS_PRESENT (1ull << 3)
#define PAGE_IS_SWAPPED (1ull << 4)
#define PM_SCAN_CHECK_WPASYNC (1ull << 1)
struct page_region {
  uint64_t start, end, categories;
};
struct pm_scan_arg {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
  uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define PAGEMAP_SCAN_ _IOWR('f', 16, struct pm_scan_arg)

// ---- state ---------------------------------------------------------------
static int g_active;        // this process owns the heap (not a forked child)
static int g_private;       // the heap is mapped copy-on-write private (after a fork)
static int g_no_reshare;    // private for good: the file system cannot write-protect, or sealed
static int g_sealed;        // private for good over a file that is never written again (a snapshot's)
static int g_fd = -1;       // the heap file
static uintptr_t g_base;    // where it is mapped
static uint64_t g_size;     // its size
static int g_uffd = -1;     // write tracking (asynchronous write-protection)
static char g_path[4096];   // the heap file
static char g_shim[4200], g_status[4200], g_note[4200];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_wake[2] = {-1, -1};  // wakes the watcher (after a fork) and takes dvr's requests ("S" + a sequence byte: seal)
static int g_answer[2] = {-1, -1};  // the watcher's answers ("K" sealed / "E" not, + the request's sequence byte)
static unsigned long g_forks, g_forks_checked;  // forks so far, and when the watcher last looked

// The free address space of the heap: sorted, disjoint [start, end) ranges.
// Freed space is punched (reads zero) except while the heap is private, when
// it waits in g_pending until the heap is shared again.
#define MAX_RANGES 65536
typedef struct {
  uintptr_t start, end;
} range_t;
static range_t g_free[MAX_RANGES];
static int g_nfree;
static range_t g_pending[MAX_RANGES];
static int g_npending;

static void say(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n > 0) (void)!write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

// Writes `text` to `path` atomically (a temporary name, then rename).
static void put_file(const char* path, const char* text) {
  char tmp[4300];
  snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)syscall(SYS_gettid));
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return;
  size_t len = strlen(text);
  int ok = write(fd, text, len) == (ssize_t)len;
  close(fd);
  if (!ok || rename(tmp, path) != 0) unlink(tmp);
}

// /proc/self/stat field 22 and the PID namespace's inode: who we are, across
// PID reuse and `dvr run`'s PID namespaces (every job is PID 1).
static void identity(uint64_t* start_time, uint64_t* pid_ns) {
  char buf[2048];
  *start_time = *pid_ns = 0;
  int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n > 0) {
      buf[n] = 0;
      char* p = strrchr(buf, ')');
      for (int field = 2; p && field < 22; ++field)
        p = strchr(p + 1, ' ');
      if (p) *start_time = strtoull(p + 1, NULL, 10);
    }
  }
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) == 0) *pid_ns = st.st_ino;
}

// DVR_HEAP_OWNER=START_TIME:PID_NS of the heap's process, which a program it
// exec's finds in its environment (the same identity: the owner exec'd; another:
// a forked child did). The string is this buffer (putenv), fixed in length,
// so the watcher can bring it up to date in place after a restore (which
// changes the identity) without reallocating anyone's environment.
static char g_owner_env[96];
static void owner_text(char* out, size_t size, uint64_t t, uint64_t ns) {
  snprintf(out, size, "%020llu:%020llu", (unsigned long long)t, (unsigned long long)ns);
}

static void write_shim_file(void) {
  uint64_t t, ns;
  identity(&t, &ns);
  struct stat pipe_st = {0}, file_st = {0};
  if (g_wake[0] < 0 || fstat(g_wake[0], &pipe_st) != 0) pipe_st.st_ino = 0;
  if (!g_sealed || fstat(g_fd, &file_st) != 0) file_st.st_ino = 0;
  char text[512];
  snprintf(text, sizeof text, "dvr-heap-shim 2\nprocess %llu %llu\nrange %llu %llu\ncontrol %d %d %llu %d\nsealed %llu\n", (unsigned long long)t,
           (unsigned long long)ns, (unsigned long long)g_base, (unsigned long long)g_size, g_wake[1], g_answer[0],
           (unsigned long long)pipe_st.st_ino, g_wake[0], (unsigned long long)file_st.st_ino);
  put_file(g_shim, text);
}

// ---- the heap's address space ----------------------------------------------
static void free_insert(range_t* list, int* n, uintptr_t s, uintptr_t e) {
  int i = 0;
  while (i < *n && list[i].start < s)
    ++i;
  int merge_prev = i > 0 && list[i - 1].end == s, merge_next = i < *n && list[i].start == e;
  if (merge_prev && merge_next) {
    list[i - 1].end = list[i].end;
    memmove(&list[i], &list[i + 1], (size_t)(*n - i - 1) * sizeof *list);
    --*n;
  } else if (merge_prev) {
    list[i - 1].end = e;
  } else if (merge_next) {
    list[i].start = s;
  } else if (*n < MAX_RANGES) {
    memmove(&list[i + 1], &list[i], (size_t)(*n - i) * sizeof *list);
    list[i].start = s;
    list[i].end = e;
    ++*n;
  }  // else: the space is lost (a heap cut into 65536 pieces)
}

// First fit, aligned. 0 when the heap has no such room.
static uintptr_t space_alloc(size_t size, size_t align) {
  if (align < PAGE) align = PAGE;
  for (int i = 0; i < g_nfree; ++i) {
    uintptr_t s = (g_free[i].start + align - 1) & ~(uintptr_t)(align - 1);
    if (s < g_free[i].start || s + size > g_free[i].end || s + size < s) continue;
    uintptr_t e = s + size, fs = g_free[i].start, fe = g_free[i].end;
    // Remove [s, e) from the range: keep what is left on either side.
    if (fs == s && fe == e) {
      memmove(&g_free[i], &g_free[i + 1], (size_t)(g_nfree - i - 1) * sizeof *g_free);
      --g_nfree;
    } else if (fs == s) {
      g_free[i].start = e;
    } else if (fe == e) {
      g_free[i].end = s;
    } else {
      if (g_nfree == MAX_RANGES) continue;
      g_free[i].end = s;
      free_insert(g_free, &g_nfree, e, fe);
    }
    return s;
  }
  return 0;
}

// Exactly [s, s + size) when it is free (jemalloc asks to grow in place).
static int space_take(uintptr_t s, size_t size) {
  for (int i = 0; i < g_nfree; ++i)
    if (g_free[i].start <= s && s + size <= g_free[i].end) {
      uintptr_t fs = g_free[i].start, fe = g_free[i].end;
      memmove(&g_free[i], &g_free[i + 1], (size_t)(g_nfree - i - 1) * sizeof *g_free);
      --g_nfree;
      if (fs < s) free_insert(g_free, &g_nfree, fs, s);
      if (s + size < fe) free_insert(g_free, &g_nfree, s + size, fe);
      return 1;
    }
  return 0;
}

static void* sys_mmap(void* a, size_t l, int p, int f, int fd, off_t o) { return (void*)syscall(SYS_mmap, a, l, p, f, fd, o); }

// Whether memory can be given back and handed out again now: while the heap
// is shared (punched out of the file), or sealed (fresh anonymous memory
// mapped over it). Not while it is private for a fork: a private mapping
// would show the file again, which must stay the memory of the fork.
static int heap_reusable(void) { return !g_private || g_sealed; }

// Gives memory back (it reads zero afterwards): punched out of the file while
// the heap is shared; once sealed, the file is a snapshot's and is never
// written, so fresh anonymous memory is mapped over the range instead (or,
// should the kernel refuse another mapping, the range is zeroed).
static void punch(uintptr_t s, size_t len) {
  if (g_sealed) {
    if (sys_mmap((void*)s, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) memset((void*)s, 0, len);
    return;
  }
  (void)!fallocate(g_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(s - g_base), (off_t)len);
}

static void space_free(uintptr_t s, size_t len) {
  if (!heap_reusable()) {
    free_insert(g_pending, &g_npending, s, s + len);
    return;
  }
  punch(s, len);
  free_insert(g_free, &g_nfree, s, s + len);
}

static int in_heap(uintptr_t s, size_t len) { return g_base && s >= g_base && s + len <= g_base + g_size && s + len >= s; }

// ---- jemalloc's extent hooks -----------------------------------------------
static extent_hooks_t* g_default_hooks;  // arena 0's before ours (for extents made before us)

static void* hook_alloc(extent_hooks_t* h, void* new_addr, size_t size, size_t alignment, bool* zero, bool* commit, unsigned arena) {
  (void)h;
  (void)arena;
  pthread_mutex_lock(&g_lock);
  uintptr_t p = 0;
  if (new_addr) {
    if (in_heap((uintptr_t)new_addr, size) && space_take((uintptr_t)new_addr, size)) p = (uintptr_t)new_addr;
  } else {
    p = space_alloc(size, alignment);
  }
  pthread_mutex_unlock(&g_lock);
  if (!p) return NULL;  // out of heap: malloc returns NULL, errno ENOMEM
  *zero = true;         // free space is punched: it reads zero
  *commit = true;
  return (void*)p;
}

// An extent jemalloc no longer needs: its space goes back to the heap's free
// list (punched: it reads zero when handed out again).
static bool hook_dalloc(extent_hooks_t* h, void* addr, size_t size, bool committed, unsigned arena) {
  (void)h;
  if (!in_heap((uintptr_t)addr, size))
    return g_default_hooks && g_default_hooks->dalloc ? g_default_hooks->dalloc(g_default_hooks, addr, size, committed, arena) : true;
  pthread_mutex_lock(&g_lock);
  space_free((uintptr_t)addr, size);
  pthread_mutex_unlock(&g_lock);
  return false;
}

static void hook_destroy(extent_hooks_t* h, void* addr, size_t size, bool committed, unsigned arena) {
  (void)committed;
  if (!in_heap((uintptr_t)addr, size)) {
    if (g_default_hooks && g_default_hooks->destroy) g_default_hooks->destroy(g_default_hooks, addr, size, committed, arena);
    return;
  }
  (void)h;
  pthread_mutex_lock(&g_lock);
  space_free((uintptr_t)addr, size);
  pthread_mutex_unlock(&g_lock);
}

static bool hook_commit(extent_hooks_t* h, void* addr, size_t size, size_t offset, size_t length, unsigned arena) {
  (void)h, (void)addr, (void)size, (void)offset, (void)length, (void)arena;
  return false;  // heap memory is always usable
}

// Purging and decommitting both punch the pages out of the file (they read
// zero afterwards); refused while the heap is private (or outside it).
static bool purge(void* addr, size_t offset, size_t length) {
  uintptr_t s = (uintptr_t)addr + offset;
  if (!in_heap(s, length)) return true;
  pthread_mutex_lock(&g_lock);
  int ok = heap_reusable();
  if (ok) punch(s, length);
  pthread_mutex_unlock(&g_lock);
  return !ok;
}

static bool hook_decommit(extent_hooks_t* h, void* addr, size_t size, size_t offset, size_t length, unsigned arena) {
  (void)h, (void)size, (void)arena;
  return purge(addr, offset, length);
}

static bool hook_purge_forced(extent_hooks_t* h, void* addr, size_t size, size_t offset, size_t length, unsigned arena) {
  (void)h, (void)size, (void)arena;
  if (!in_heap((uintptr_t)addr + offset, length)) {
    if (g_default_hooks && g_default_hooks->purge_forced)
      return g_default_hooks->purge_forced(g_default_hooks, addr, size, offset, length, arena);
    return true;
  }
  return purge(addr, offset, length);
}

static bool hook_split(extent_hooks_t* h, void* addr, size_t size, size_t a, size_t b, bool committed, unsigned arena) {
  (void)h, (void)addr, (void)size, (void)a, (void)b, (void)committed, (void)arena;
  return false;
}

static bool hook_merge(extent_hooks_t* h, void* a, size_t sa, void* b, size_t sb, bool committed, unsigned arena) {
  (void)h, (void)committed, (void)arena;
  // Never across the heap's edge (an extent made before the hooks may lie
  // right next to it).
  return in_heap((uintptr_t)a, sa) != in_heap((uintptr_t)b, sb);
}

static extent_hooks_t g_hooks = {hook_alloc, hook_dalloc, hook_destroy, hook_commit, hook_decommit, NULL, hook_purge_forced, hook_split, hook_merge};

// ---- the heap's mappings -----------------------------------------------------

// Calls fn(start, end, prot) for each mapping of /proc/self/maps inside the
// heap (the heap is one file mapping, cut where the program changed a page's
// protection). Static buffers: runs in fork handlers.
static char g_maps[1 << 16];
static int each_heap_vma(void (*fn)(uintptr_t, uintptr_t, int)) {
  int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t have = 0;
  for (;;) {
    ssize_t n = read(fd, g_maps + have, sizeof g_maps - 1 - have);
    if (n <= 0) break;
    have += (size_t)n;
    g_maps[have] = 0;
    char* line = g_maps;
    char* nl;
    while ((nl = strchr(line, '\n'))) {
      *nl = 0;
      unsigned long lo, hi;
      char perms[8];
      if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && lo >= g_base && hi <= g_base + g_size) {
        int prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) | (perms[2] == 'x' ? PROT_EXEC : 0);
        fn(lo, hi, prot);
      }
      line = nl + 1;
    }
    have = (size_t)(g_maps + have - line);
    memmove(g_maps, line, have);
  }
  close(fd);
  return 0;
}

static int g_remap_flags, g_remap_failed, g_remap_fd = -1;  // g_remap_fd -1: g_fd
static void remap_one(uintptr_t lo, uintptr_t hi, int prot) {
  const int fd = g_remap_fd >= 0 ? g_remap_fd : g_fd;
  if (sys_mmap((void*)lo, hi - lo, prot, g_remap_flags | MAP_FIXED, fd, (off_t)(lo - g_base)) == MAP_FAILED) g_remap_failed = 1;
}

static int track_range(void) {
  if (g_uffd < 0) return 0;
  struct uffdio_register reg = {.range = {g_base, g_size}, .mode = UFFDIO_REGISTER_MODE_WP};
  if (ioctl(g_uffd, UFFDIO_REGISTER, &reg) != 0) return 0;
  struct uffdio_writeprotect wp = {.range = reg.range, .mode = UFFDIO_WRITEPROTECT_MODE_WP};
  if (ioctl(g_uffd, UFFDIO_WRITEPROTECT, &wp) != 0) return 0;
  return 1;
}

// Whether the heap is registered for tracking here (not after a restore).
static int tracked(void) {
  int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (pm < 0) return 0;
  struct pm_scan_arg a = {.size = sizeof a, .flags = PM_SCAN_CHECK_WPASYNC, .start = g_base, .end = g_base + PAGE};
  a.category_mask = PAGE_IS_WPALLOWED;
  long r = ioctl(pm, PAGEMAP_SCAN_, &a);
  close(pm);
  return r >= 0;
}

// fork: the parent's heap becomes private before the child exists. The write
// marks go with the shared mapping, so the tracking note no longer holds.
static void before_fork(void) {
  pthread_mutex_lock(&g_lock);
  if (!g_active || g_private) return;
  unlink(g_note);
  g_remap_flags = MAP_PRIVATE;
  g_remap_failed = 0;
  if (each_heap_vma(remap_one) != 0 || g_remap_failed) say("dvr heap: cannot make the heap private for fork(): %s\n", strerror(errno));
  g_private = 1;
}

static void after_fork_parent(void) {
  ++g_forks;
  pthread_mutex_unlock(&g_lock);
  if (g_wake[1] >= 0) (void)!write(g_wake[1], "f", 1);
}

static void after_fork_child(void) {
  pthread_mutex_init(&g_lock, NULL);
  if (!g_active) return;
  // Not the heap's process: the private copy is the child's own memory, its
  // own mmap calls go to the kernel, and nothing is given back to the file.
  g_active = 0;
  g_uffd = -1;
  g_wake[0] = g_wake[1] = -1;
  g_answer[0] = g_answer[1] = -1;
}

// ---- the watcher thread ---------------------------------------------------
// Whether a descendant of ours maps the heap file (checked by its path in
// /proc/PID/maps; children inherit our mount namespace).
static char g_cmaps[1 << 16];
static int maps_heap(long pid) {
  char p[64];
  snprintf(p, sizeof p, "/proc/%ld/maps", pid);
  int fd = open(p, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  size_t plen = strlen(g_path), keep = 0;
  int found = 0;
  ssize_t n;
  while (!found && (n = read(fd, g_cmaps + keep, sizeof g_cmaps - 1 - keep)) > 0) {
    size_t have = keep + (size_t)n;
    g_cmaps[have] = 0;
    found = memmem(g_cmaps, have, g_path, plen) != NULL;
    keep = have > plen ? plen : have;
    memmove(g_cmaps, g_cmaps + have - keep, keep);
  }
  close(fd);
  return found;
}

// `pid` 0: this process, as /proc/self (inside a `dvr run` job getpid() is 1
// of its own PID namespace, while /proc is the host's).
static int descendants_map_heap(long pid, int depth) {
  if (depth > 16) return 1;
  char dir[64], buf[4096];
  if (pid)
    snprintf(dir, sizeof dir, "/proc/%ld/task", pid);
  else
    snprintf(dir, sizeof dir, "/proc/self/task");
  int d = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d < 0) return 0;
  char ents[4096];
  long nread;
  int found = 0;
  while (!found && (nread = syscall(SYS_getdents64, d, ents, sizeof ents)) > 0) {
    for (long off = 0; off < nread && !found;) {
      struct {
        uint64_t ino;
        int64_t off;
        unsigned short reclen;
        unsigned char type;
        char name[];
      }* e = (void*)(ents + off);
      off += e->reclen;
      if (e->name[0] < '0' || e->name[0] > '9') continue;
      char p[128];
      snprintf(p, sizeof p, "%s/%s/children", dir, e->name);
      int fd = open(p, O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      ssize_t n = read(fd, buf, sizeof buf - 1);
      close(fd);
      if (n <= 0) continue;
      buf[n] = 0;
      for (char* s = buf; *s && !found;) {
        char* end;
        long child = strtol(s, &end, 10);
        if (end == s) break;
        found = maps_heap(child) || descendants_map_heap(child, depth + 1);
        s = end;
      }
    }
  }
  close(d);
  return found;
}

// The anonymous (copy-on-write) pages of the private heap, appended to
// g_anon: present ones, and with `swapped` those in swap. Before the gate is
// up both; after it only present ones, because the gate's markers on
// untouched pages read as swap entries too.
static range_t g_anon[MAX_RANGES];
static int g_nanon;
static int find_private_pages(int swapped) {
  int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (pm < 0) return 0;
  static struct page_region vec[512];
  uint64_t start = g_base;
  int ok = 1;
  while (ok && start < g_base + g_size) {
    struct pm_scan_arg a = {.size = sizeof a, .start = start, .end = g_base + g_size, .vec = (uint64_t)vec, .vec_len = 512};
    a.category_inverted = PAGE_IS_FILE;
    a.category_mask = PAGE_IS_FILE;
    a.category_anyof_mask = PAGE_IS_PRESENT | (swapped ? PAGE_IS_SWAPPED : 0);
    a.return_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
    long n = ioctl(pm, PAGEMAP_SCAN_, &a);
    if (n < 0) ok = 0;
    for (long i = 0; i < n && ok; ++i) {
      if (g_nanon == MAX_RANGES) ok = 0;
      else g_anon[g_nanon++] = (range_t){vec[i].start, vec[i].end};
    }
    if (!ok || a.walk_end <= start) break;
    start = a.walk_end;
  }
  close(pm);
  return ok;
}

static int write_back_private_pages(void) {
  for (int i = 0; i < g_nanon; ++i) {
    uint64_t s = g_anon[i].start, e = g_anon[i].end;
    while (s < e) {
      ssize_t w = pwrite(g_fd, (void*)s, e - s, (off_t)(s - g_base));
      if (w <= 0) return 0;
      s += (uint64_t)w;
    }
  }
  return 1;
}

// The heap becomes shared again: writers wait on a second userfaultfd
// (synchronous write-protection, never answered) while the private pages go
// into the file and the file is mapped shared over them; closing that
// userfaultfd lets them go on, into the shared mapping.
static void reshare(void) {
  g_nanon = 0;
  if (!find_private_pages(1)) return;
  // Not UFFD_USER_MODE_ONLY: the kernel's own writes into the heap (a read(2)
  // or epoll_wait into a heap buffer) must wait at the gate too; with a
  // user-mode-only userfaultfd they would fail with EFAULT. Without the
  // privilege for that (a program that dropped root), the heap stays private.
  int gate = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  struct uffdio_api api = {.api = UFFD_API, .features = FEATURE_WP_UNPOPULATED};
  struct uffdio_register reg = {.range = {g_base, g_size}, .mode = UFFDIO_REGISTER_MODE_WP};
  struct uffdio_writeprotect wp = {.range = reg.range, .mode = UFFDIO_WRITEPROTECT_MODE_WP};
  if (gate < 0 || ioctl(gate, UFFDIO_API, &api) != 0 || ioctl(gate, UFFDIO_REGISTER, &reg) != 0 || ioctl(gate, UFFDIO_WRITEPROTECT, &wp) != 0) {
    if (gate >= 0) close(gate);
    g_no_reshare = 1;  // e.g. a heap on a disk file system: it stays private
    return;
  }
  if (!find_private_pages(0) || !write_back_private_pages()) {
    close(gate);  // nothing changed: still private, try again later
    return;
  }
  g_remap_flags = MAP_SHARED;
  g_remap_failed = 0;
  each_heap_vma(remap_one);
  close(gate);
  if (g_remap_failed) {
    say("dvr heap: cannot map the heap shared again: %s\n", strerror(errno));
    g_no_reshare = 1;
    return;
  }
  g_private = 0;
  for (int i = 0; i < g_npending; ++i) {
    punch(g_pending[i].start, g_pending[i].end - g_pending[i].start);
    free_insert(g_free, &g_nfree, g_pending[i].start, g_pending[i].end);
  }
  g_npending = 0;
  if (track_range()) write_shim_file();
}

// Sealing (asked by `dvr proc dump`, README.md here): the heap becomes private
// for good over its file, which is never written again; the store takes the
// file as it is as the heap's snapshot, and CRIU dumps only the pages the
// program writes after this (copy-on-write). Under g_lock. 1: sealed now or
// before; 0: not (still shared, or private as after a fork, which the
// watcher undoes as it does after a fork).
static int seal(void) {
  if (!g_active) return 0;
  if (g_sealed) return 1;
  // Never written again: read-only from here on. Mapped from a read-only
  // file, the heap is one CRIU (which opens a mapping's file as the mapping
  // holds it) reopens read-only in a restored or cloned process.
  char self[64];
  snprintf(self, sizeof self, "/proc/self/fd/%d", g_fd);
  int ro = open(self, O_RDONLY | O_CLOEXEC);
  if (ro < 0) return 0;
  if (!g_private) {
    unlink(g_note);  // the write marks go with the shared mapping
    g_remap_flags = MAP_PRIVATE;
    g_remap_failed = 0;
    g_remap_fd = ro;
    int listed = each_heap_vma(remap_one) == 0;
    g_remap_fd = -1;
    g_private = 1;  // (in part, if it failed: the watcher shares it again, as after a fork)
    if (!listed || g_remap_failed) {
      close(ro);
      return 0;
    }
  }
  // (Private since a fork: the pages written since are in the private
  // mapping, which stays as it is, over the file as opened before.)
  const int dup_ok = dup3(ro, g_fd, O_CLOEXEC) >= 0;
  close(ro);
  if (!dup_ok) return 0;
  g_sealed = 1;
  g_no_reshare = 1;
  // Space freed while the heap was private for a fork can be handed out
  // again: it becomes fresh anonymous memory (punch()).
  for (int i = 0; i < g_npending; ++i) {
    punch(g_pending[i].start, g_pending[i].end - g_pending[i].start);
    free_insert(g_free, &g_nfree, g_pending[i].start, g_pending[i].end);
  }
  g_npending = 0;
  write_shim_file();
  return 1;
}

// Requests on the wake pipe: "f" (a fork happened: look now) and "S" + a
// sequence byte (seal, answered on the answer pipe with "K"/"E" and that
// byte). `*carry` holds an "S" whose byte has not arrived yet.
static void handle_requests(const char* b, ssize_t n, int* carry) {
  for (ssize_t i = 0; i < n; ++i) {
    if (!*carry) {
      *carry = b[i] == 'S';
      continue;
    }
    *carry = 0;
    pthread_mutex_lock(&g_lock);
    char answer[2] = {seal() ? 'K' : 'E', b[i]};
    pthread_mutex_unlock(&g_lock);
    if (g_answer[1] >= 0) (void)!write(g_answer[1], answer, 2);
  }
}

static void* watcher(void* arg) {
  (void)arg;
  prctl(PR_SET_NAME, "dvr-heap", 0, 0, 0);
  uint64_t me_t, me_ns;
  identity(&me_t, &me_ns);
  int carry = 0;
  for (;;) {
    // Sleep, or wake early after a fork or for a request.
    struct timeval tv = {0, g_private && !g_no_reshare ? 50 * 1000 : 500 * 1000};
    fd_set rd;
    FD_ZERO(&rd);
    if (g_wake[0] >= 0) FD_SET(g_wake[0], &rd);
    if (select(g_wake[0] + 1, &rd, NULL, NULL, &tv) > 0) {
      char b[64];
      ssize_t n = read(g_wake[0], b, sizeof b);
      if (n > 0) handle_requests(b, n, &carry);
    }
    // Checked without the lock (it reads /proc for a while); a fork in
    // between is seen below, under the lock, by a child we did not check.
    int busy = g_private && !g_no_reshare && descendants_map_heap(0, 0);
    pthread_mutex_lock(&g_lock);
    if (g_private && !g_no_reshare && !busy && g_forks == g_forks_checked) reshare();
    g_forks_checked = g_forks;
    // After a restore (CRIU gives us a fresh userfaultfd, nothing
    // registered) or a PID change: track again (a shared heap), say who we
    // are now.
    uint64_t t, ns;
    identity(&t, &ns);
    const int moved = t != me_t || ns != me_ns;
    me_t = t;
    me_ns = ns;
    const int renewed = !g_private && (moved || !tracked()) && track_range();
    if (renewed || moved) write_shim_file();
    if (moved && g_owner_env[0]) {
      char me[64];
      owner_text(me, sizeof me, t, ns);
      memcpy(g_owner_env + strlen("DVR_HEAP_OWNER="), me, strlen(me));  // same length: in place
    }
    pthread_mutex_unlock(&g_lock);
  }
  return NULL;
}

// ---- the program's own anonymous mappings ----------------------------------
EXPORT void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  int ours = g_active && heap_reusable() && (flags & MAP_ANONYMOUS) && (flags & MAP_TYPE) == MAP_PRIVATE &&
             !(flags & (MAP_FIXED | MAP_FIXED_NOREPLACE | MAP_HUGETLB | MAP_GROWSDOWN | MAP_STACK)) && (prot & PROT_WRITE) && len > 0;
  if (!ours) return sys_mmap(addr, len, prot, flags, fd, off);
  size_t size = (len + PAGE - 1) & ~(PAGE - 1);
  pthread_mutex_lock(&g_lock);
  uintptr_t p = heap_reusable() ? space_alloc(size, PAGE) : 0;
  pthread_mutex_unlock(&g_lock);
  if (!p) {
    errno = ENOMEM;
    return MAP_FAILED;
  }
  if (prot != (PROT_READ | PROT_WRITE)) mprotect((void*)p, size, prot);
  return (void*)p;
}
EXPORT void* mmap64(void* addr, size_t len, int prot, int flags, int fd, off_t off) __attribute__((alias("mmap")));

EXPORT int munmap(void* addr, size_t len) {
  uintptr_t s = (uintptr_t)addr;
  size_t size = (len + PAGE - 1) & ~(PAGE - 1);
  if (!g_active || !in_heap(s, size) || (s & (PAGE - 1))) {
    if (g_base && s < g_base + g_size && s + size > g_base) {
      errno = EINVAL;  // part of the heap and part outside: refuse rather than unmap the heap
      return -1;
    }
    return (int)syscall(SYS_munmap, addr, len);
  }
  mprotect(addr, size, PROT_READ | PROT_WRITE);
  pthread_mutex_lock(&g_lock);
  space_free(s, size);
  pthread_mutex_unlock(&g_lock);
  return 0;
}

EXPORT void* mremap(void* old, size_t old_len, size_t new_len, int flags, ...) {
  void* fixed = NULL;
  if (flags & MREMAP_FIXED) {
    va_list ap;
    va_start(ap, flags);
    fixed = va_arg(ap, void*);
    va_end(ap);
  }
  uintptr_t s = (uintptr_t)old;
  size_t os = (old_len + PAGE - 1) & ~(PAGE - 1), ns = (new_len + PAGE - 1) & ~(PAGE - 1);
  if (!g_active || !in_heap(s, os)) return (void*)syscall(SYS_mremap, old, old_len, new_len, flags, fixed);
  if ((flags & MREMAP_FIXED) || ns == 0) {
    errno = EINVAL;
    return MAP_FAILED;
  }
  if (ns <= os) {
    if (ns < os) munmap((void*)(s + ns), os - ns);
    return old;
  }
  pthread_mutex_lock(&g_lock);
  int grown = heap_reusable() && space_take(s + os, ns - os);
  uintptr_t p = grown || !heap_reusable() || !(flags & MREMAP_MAYMOVE) ? 0 : space_alloc(ns, PAGE);
  pthread_mutex_unlock(&g_lock);
  if (grown) return old;
  if (!p) {
    errno = ENOMEM;
    return MAP_FAILED;
  }
  memcpy((void*)p, old, os);
  munmap(old, os);
  return (void*)p;
}

EXPORT int madvise(void* addr, size_t len, int advice) {
  uintptr_t s = (uintptr_t)addr;
  size_t size = (len + PAGE - 1) & ~(PAGE - 1);
  if (!g_active || !in_heap(s, size) || (advice != MADV_DONTNEED && advice != MADV_FREE && advice != MADV_REMOVE))
    return (int)syscall(SYS_madvise, addr, len, advice);
  // Anonymous memory reads zero after these; so does the heap.
  pthread_mutex_lock(&g_lock);
  if (!heap_reusable()) {
    if (advice != MADV_FREE) memset(addr, 0, size);
  } else {
    punch(s, size);
  }
  pthread_mutex_unlock(&g_lock);
  return 0;
}

// ---- start -------------------------------------------------------------------
static void fail(const char* fmt, ...) {
  char why[1024], text[1100];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  snprintf(text, sizeof text, "error: %s\n", why);
  put_file(g_status, text);
  say("dvr heap: %s\n", why);
  _exit(127);
}

__attribute__((constructor)) static void start(void) {
  const char* file = getenv("DVR_HEAP_FILE");
  const char* size = getenv("DVR_HEAP_SIZE");
  const char* addr = getenv("DVR_HEAP_ADDR");
  if (!file || !size || !addr) return;
  uint64_t t, ns;
  identity(&t, &ns);
  char me[64];
  owner_text(me, sizeof me, t, ns);
  const char* owner = getenv("DVR_HEAP_OWNER");
  if (owner && strcmp(owner, me) != 0) return;  // exec'd by a forked child: no heap here
  snprintf(g_path, sizeof g_path, "%s", file);
  const char* slash = strrchr(g_path, '/');
  if (!slash) return;
  int dir = (int)(slash - g_path);
  snprintf(g_status, sizeof g_status, "%.*s/.%s.status", dir, g_path, slash + 1);
  snprintf(g_shim, sizeof g_shim, "%.*s/.%s.shim", dir, g_path, slash + 1);
  snprintf(g_note, sizeof g_note, "%.*s/.%s.track", dir, g_path, slash + 1);
  g_size = strtoull(size, NULL, 10);
  g_base = (uintptr_t)strtoull(addr, NULL, 16);
  if (!g_size || (g_size & (PAGE - 1)) || !g_base || (g_base & (PAGE - 1))) fail("DVR_HEAP_SIZE / DVR_HEAP_ADDR are not page-aligned numbers");
  if (owner) {
    // The owner exec'd another program: the old one's heap means nothing to
    // it, and its file may be a snapshot's (sealed), so a new empty file takes
    // the name rather than the old one being emptied.
    char fresh[4300];
    snprintf(fresh, sizeof fresh, "%s.exec-%llu-%llu", g_path, (unsigned long long)t, (unsigned long long)ns);
    g_fd = open(fresh, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (g_fd < 0) fail("cannot create a new heap file %s: %s", fresh, strerror(errno));
    if (rename(fresh, g_path) != 0) {
      unlink(fresh);
      fail("cannot put a new heap file at %s: %s", g_path, strerror(errno));
    }
  } else {
    g_fd = open(g_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (g_fd < 0) fail("cannot open heap file %s: %s", g_path, strerror(errno));
  }
  if (ftruncate(g_fd, (off_t)g_size) != 0) fail("cannot size heap file %s: %s", g_path, strerror(errno));
  unlink(g_note);
  void* m = sys_mmap((void*)g_base, g_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, g_fd, 0);
  if (m == MAP_FAILED || (uintptr_t)m != g_base)
    fail("cannot map the heap at %#lx (%llu bytes): %s", (unsigned long)g_base, (unsigned long long)g_size, strerror(errno));
  g_free[0].start = g_base;
  g_free[0].end = g_base + g_size;
  g_nfree = 1;
  snprintf(g_owner_env, sizeof g_owner_env, "DVR_HEAP_OWNER=%s", me);
  putenv(g_owner_env);
  // Write tracking: asynchronous write-protection, as sessions use. Without
  // it (older kernels) every dump compares the heap page by page.
  g_uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY_);
  if (g_uffd >= 0) {
    struct uffdio_api api = {.api = UFFD_API, .features = FEATURE_WP_ASYNC | FEATURE_WP_UNPOPULATED};
    if (ioctl(g_uffd, UFFDIO_API, &api) != 0) {
      close(g_uffd);
      g_uffd = -1;
    }
  }
  g_active = 1;
  // From here on jemalloc takes its extents from the heap.
  size_t len = sizeof g_default_hooks;
  extent_hooks_t* ours = &g_hooks;
  if (mallctl("arena.0.extent_hooks", &g_default_hooks, &len, &ours, sizeof ours) != 0) fail("jemalloc refused the heap's extent hooks");
  if (pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) != 0) g_wake[0] = g_wake[1] = -1;
  if (pipe2(g_answer, O_CLOEXEC | O_NONBLOCK) != 0) g_answer[0] = g_answer[1] = -1;
  pthread_atfork(before_fork, after_fork_parent, after_fork_child);
  int is_tracked = track_range();
  write_shim_file();
  pthread_t th;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&th, &at, watcher, NULL) != 0) fail("cannot start the heap's watcher thread");
  char status[256];
  snprintf(status, sizeof status, "ok\ntracking %s\n", is_tracked ? "on" : "off");
  put_file(g_status, status);
}
