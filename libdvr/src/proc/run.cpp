// Starting a job that can be dumped, restored and cloned: proc::run, PID 1 of
// a PID namespace of its own (dvr/proc.hpp).
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/os.hpp"
#include "dvr/proc.hpp"
#include "proc/criu_runner.hpp"
#include "proc/processes.hpp"
#include "store/store_impl.hpp"

extern char** environ;

namespace dvr::proc {

namespace {

constexpr const char* kHeapPreloadFile = "libdvr_heap.so";
constexpr const char* kInitPreloadFile = "libdvr_init.so";
constexpr const char* kHeapRegion = "heap";

using impl::dir_of;
using impl::is_file;

// The file execvp would run for `name`.
std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string d;
  while (std::getline(dirs, d, ':')) {
    std::string f = (d.empty() ? std::string(".") : d) + "/" + name;
    if (is_file(f) && ::access(f.c_str(), X_OK) == 0) return f;
  }
  throw Error(Errc::not_found, "dvr run: '" + name + "' is not a program on PATH");
}

// Refuses what the loader will not preload into: static binaries and
// setuid/setgid programs. Scripts are fine (their interpreter gets the heap).
void check_preloadable(const std::string& name) {
  std::string file = find_program(name);
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) detail::throw_errno(errno, "dvr run: cannot find " + file);
  if (st.st_mode & (S_ISUID | S_ISGID))
    throw Error(Errc::unsupported, "dvr run --heap: " + file +
                                       " is setuid or setgid, and the loader preloads nothing into such programs; run it without --heap");
  detail::Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) detail::throw_errno(errno, "dvr run: cannot read " + file);
  Elf64_Ehdr eh{};
  ssize_t n = ::pread(fd.get(), &eh, sizeof eh, 0);
  if (n >= 2 && reinterpret_cast<const char*>(&eh)[0] == '#' && reinterpret_cast<const char*>(&eh)[1] == '!') return;
  if (n != static_cast<ssize_t>(sizeof eh) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64)
    throw Error(Errc::unsupported, "dvr run --heap: " + file + " is not a 64-bit ELF program or a script");
  for (unsigned k = 0; k < eh.e_phnum && k < 256; ++k) {
    Elf64_Phdr ph{};
    if (::pread(fd.get(), &ph, sizeof ph, static_cast<off_t>(eh.e_phoff + k * sizeof ph)) != static_cast<ssize_t>(sizeof ph)) break;
    if (ph.p_type == PT_INTERP) return;
  }
  throw Error(Errc::unsupported, "dvr run --heap: " + file +
                                     " is statically linked, so nothing can be preloaded into it; run it without --heap, or use a dynamically "
                                     "linked build");
}

// Waits for the heap's status file: "ok" once the program has its heap,
// "error: why" when it could not (the program then exits).
void wait_for_heap(pid_t job, const std::string& heap) {
  const std::string status = dir_of(heap) + "/." + kHeapRegion + ".status";
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(status);
    std::string line;
    if (in && std::getline(in, line)) {
      if (line == "ok") return;
      throw Error(Errc::io, "dvr run --heap: the program could not set its heap up: " + line.substr(line.rfind("error: ", 0) == 0 ? 7 : 0));
    }
    if (::kill(job, 0) != 0 && errno == ESRCH)
      throw Error(Errc::io, "dvr run --heap: the program exited before its heap was in place (see its output: --output FILE)");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(job, SIGKILL);
  throw Error(Errc::io, "dvr run --heap: the program did not set its heap up within 30 s (is " + heap_preload() +
                            " loaded into it?); it was killed");
}

}  // namespace

std::string heap_path(const std::string& store, const std::string& session) { return store + "/heaps/" + session + "/" + kHeapRegion; }

namespace {

// A preload library of ours: build/preload/ beside the dvr binary, or the
// installed lib/dvr/, or beside libdvr.so (a Python program: the running
// program is python). "" when not found.
std::string find_preload(const char* file) {
  const std::string self = impl::self_dir();
  std::vector<std::string> dirs = {self + "/preload", self + "/" DVR_HEAP_PRELOAD_RELDIR};
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&find_preload), &info) && info.dli_fname) {
    std::string lib = dir_of(info.dli_fname);
    dirs.push_back(lib + "/dvr");
    dirs.push_back(lib + "/../preload");
  }
  for (auto& d : dirs)
    if (is_file(d + "/" + file)) return d + "/" + file;
  return "";
}

// libdvr_init.so (preload/dvr_init.c): makes the job, PID 1 of its
// namespace, end on SIGTERM/SIGINT/SIGHUP/SIGQUIT as the program would.
// $DVR_INIT_PRELOAD names another file; set but empty, none is preloaded.
std::string init_preload() {
  if (const char* e = std::getenv("DVR_INIT_PRELOAD")) return *e && is_file(e) ? e : "";
  return find_preload(kInitPreloadFile);
}

}  // namespace

std::string heap_preload() {
  if (const char* e = std::getenv("DVR_HEAP_PRELOAD"); e && *e) return is_file(e) ? e : "";
  return find_preload(kHeapPreloadFile);
}

namespace {
pid_t run_job(const std::vector<std::string>& argv, const RunOptions& options, std::string& heap);
}  // namespace

pid_t run(const std::vector<std::string>& argv, const RunOptions& options) {
  // A job that did not start leaves no heap behind: a second try with the
  // same --heap-session would find it ("already has a heap").
  std::string heap;
  pid_t job = 0;
  try {
    job = run_job(argv, options, heap);
  } catch (...) {
    if (!heap.empty()) {
      const std::string dir = dir_of(heap);
      ::unlink(heap.c_str());
      ::unlink((dir + "/." + kHeapRegion + ".status").c_str());
      ::unlink((dir + "/." + kHeapRegion + ".shim").c_str());  // what the shim wrote for dvr to find it
      ::rmdir(dir.c_str());  // only when nothing else is in it
    }
    throw;
  }
  return job;
}

namespace {
// run() without the clean-up: `heap` is set once the heap file exists.
pid_t run_job(const std::vector<std::string>& argv, const RunOptions& options, std::string& heap) {
  if (argv.empty()) throw Error(Errc::invalid_argument, "dvr run needs a command: dvr run -- CMD [ARGS...]");
  // The job starts in our working directory unless told otherwise; one that
  // was removed would make every dump fail ("Can't create a directory").
  if (options.cwd.empty()) {
    char buf[4096];
    if (!::getcwd(buf, sizeof buf) && errno == ENOENT)
      throw Error(Errc::invalid_argument, "dvr run: the working directory was removed, and CRIU cannot dump a job that runs in it; "
                                          "cd to an existing directory or give --cwd DIR");
  }
  // The job's environment: ours, plus the heap's when it has one.
  std::vector<std::string> env_strings;
  if (options.heap_bytes > 0) {
    if (options.heap_store.empty() || options.heap_session.empty())
      throw Error(Errc::invalid_argument, "dvr run --heap needs a store and a heap session");
    detail::check_name("session", options.heap_session);
    check_preloadable(argv[0]);
    std::string shim = heap_preload();
    if (shim.empty())
      throw Error(Errc::unsupported, std::string("dvr run --heap: ") + kHeapPreloadFile +
                                         " was not found (build with libjemalloc-dev installed, or set DVR_HEAP_PRELOAD)");
    const std::uint64_t bytes = (options.heap_bytes + 4095) & ~std::uint64_t(4095);
    Store store = Store::open(options.heap_store, {.create = false});
    const std::string path = heap_path(store.path(), options.heap_session);
    detail::make_private_dir(store.path() + "/heaps");
    detail::make_private_dir(dir_of(path));
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0 && errno == EEXIST)
      throw Error(Errc::already_exists, "dvr run --heap: session '" + options.heap_session + "' already has a heap (" + path +
                                            "); choose another --heap-session, or remove it when no job uses it");
    if (fd < 0) detail::throw_errno(errno, "dvr run --heap: cannot create heap file " + path);
    heap = path;  // ours from here: removed if the job does not start
    int rc = ::ftruncate(fd, static_cast<off_t>(bytes));
    int err = errno;
    ::close(fd);
    if (rc != 0) detail::throw_errno(err, "dvr run --heap: cannot size heap file " + heap);
    std::string preload = shim + " libjemalloc.so.2";
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (kv.rfind("LD_PRELOAD=", 0) == 0)
        preload += " " + kv.substr(11);
      else if (kv.rfind("DVR_HEAP_", 0) != 0)
        env_strings.push_back(kv);
    }
    if (std::string init = init_preload(); !init.empty()) preload += " " + init;
    char addr[32];
    std::snprintf(addr, sizeof addr, "%llx", static_cast<unsigned long long>(kHeapAddress));
    env_strings.push_back("LD_PRELOAD=" + preload);
    env_strings.push_back("DVR_HEAP_FILE=" + heap);
    env_strings.push_back("DVR_HEAP_SIZE=" + std::to_string(bytes));
    env_strings.push_back(std::string("DVR_HEAP_ADDR=") + addr);
  } else {
    std::string preload = init_preload();
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (kv.rfind("LD_PRELOAD=", 0) == 0 && !preload.empty())
        preload = kv.substr(11) + " " + preload;
      else
        env_strings.push_back(kv);
    }
    if (!preload.empty()) env_strings.push_back("LD_PRELOAD=" + preload);
  }
  std::vector<char*> envp;
  for (auto& e : env_strings)
    envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int out_fd = -1;
  if (!options.output.empty()) {
    out_fd = ::open(options.output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (out_fd < 0) detail::throw_errno(errno, "cannot open output file " + options.output);
  }
  int report[2];  // the job's PID, or errno of what failed
  if (::pipe2(report, O_CLOEXEC) != 0) {
    int e = errno;
    if (out_fd >= 0) ::close(out_fd);
    detail::throw_errno(e, "cannot create a pipe");
  }
  std::vector<char*> args;
  for (auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t middle = ::fork();
  if (middle < 0) {
    int e = errno;
    ::close(report[0]);
    ::close(report[1]);
    if (out_fd >= 0) ::close(out_fd);
    detail::throw_errno(e, "cannot start " + argv[0]);
  }
  if (middle == 0) {
    ::close(report[0]);
    auto fail = [&](int stage) {
      long msg[2] = {-stage, errno};
      (void)!::write(report[1], msg, sizeof msg);
      ::_exit(1);
    };
    if (::unshare(CLONE_NEWPID) != 0) fail(1);
    pid_t job = ::fork();
    if (job < 0) fail(2);
    if (job == 0) {
      // PID 1 of the new namespace, leader of a session of its own.
      ::setsid();
      int null = ::open("/dev/null", O_RDWR);
      if (null < 0) fail(3);
      ::dup2(null, 0);
      ::dup2(out_fd >= 0 ? out_fd : null, 1);
      ::dup2(out_fd >= 0 ? out_fd : null, 2);
      if (null > 2) ::close(null);
      if (!options.cwd.empty() && ::chdir(options.cwd.c_str()) != 0) fail(4);
      // Nothing else of ours stays open in the job (report[1] closes on exec).
      if (report[1] > 3) ::syscall(SYS_close_range, 3u, static_cast<unsigned>(report[1] - 1), 0u);
      ::syscall(SYS_close_range, static_cast<unsigned>(report[1] + 1), ~0u, 0u);
      ::execvpe(args[0], args.data(), envp.data());
      fail(5);
    }
    long msg[2] = {job, 0};
    (void)!::write(report[1], msg, sizeof msg);
    ::_exit(0);
  }
  ::close(report[1]);
  if (out_fd >= 0) ::close(out_fd);
  // Two messages may come: the job's PID from the middle process, then (only
  // if exec failed) the job's own failure.
  long first[2] = {0, 0}, second[2] = {0, 0};
  auto read_msg = [&](long* msg) {
    ssize_t n;
    while ((n = ::read(report[0], msg, 2 * sizeof(long))) < 0 && errno == EINTR) {
    }
    return n;
  };
  ssize_t n1 = read_msg(first);
  ssize_t n2 = n1 == sizeof first && first[0] > 0 ? read_msg(second) : 0;
  ::close(report[0]);
  int status = 0;
  ::waitpid(middle, &status, 0);
  auto failure = [&](long stage, long err) {
    std::string w = stage == 1   ? "create a PID namespace (needs root or CAP_SYS_ADMIN)"
                    : stage == 3 ? "open /dev/null"
                    : stage == 4 ? "change to directory " + options.cwd
                    : stage == 5 ? "run '" + argv[0] + "'"
                                 : "start the job";
    throw Error(err == ENOENT                   ? Errc::not_found
                : err == EPERM || err == EACCES ? Errc::permission
                                                : Errc::io,
                "dvr run: cannot " + w + ": " + std::strerror(static_cast<int>(err)));
  };
  if (n1 != sizeof first) throw Error(Errc::io, "dvr run: the job could not be started");
  if (first[0] <= 0) failure(-first[0], first[1]);
  if (n2 == sizeof second) failure(-second[0], second[1]);
  const pid_t job = static_cast<pid_t>(first[0]);
  if (!heap.empty()) {
    try {
      wait_for_heap(job, heap);
    } catch (...) {
      // The heap is removed only once the program is gone (it maps it).
      ::kill(job, SIGKILL);
      impl::wait_exited({job}, std::chrono::milliseconds(5000));  // a zombie maps nothing any more
      throw;
    }
  }
  return job;
}
}  // namespace

}  // namespace dvr::proc
