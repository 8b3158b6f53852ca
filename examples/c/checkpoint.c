/* Memory DVR from C: a time-step loop that checkpoints and restarts.
 *
 * A 1-D heat equation on N doubles (fixed ends, explicit Euler) runs for STEPS
 * steps and takes a snapshot "step-NNNNNN" every K steps. Started again on the
 * same store, it restarts from the newest intact snapshot (dvr_latest +
 * dvr_restore) instead of from step 0, so a run killed midway and restarted
 * ends with the same bytes as a run that was never interrupted.
 *
 *   dvr-example-c STORE_DIR STEPS [--every K] [--crash-at STEP]
 *
 * --crash-at STEP ends the process abruptly (_exit(3), no cleanup) right after
 * computing step STEP, to simulate a failure. The last line is
 * "checksum: <hex>", an FNV-1a hash of the final array's bytes.
 */
#define _POSIX_C_SOURCE 200809L

#include <dvr/dvr.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { N = 100000 };

/* State that must come back with the array: it is a region too. */
struct progress {
  int64_t step; /* steps completed */
};

static int fail(const char* what, dvr_status status) {
  fprintf(stderr, "dvr-example-c: %s failed (status %d): %s\n", what, (int)status, dvr_errmsg());
  return 1;
}

static long parse_count(const char* text, const char* what) {
  char* end = NULL;
  long v = strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 0) {
    fprintf(stderr, "dvr-example-c: %s must be a non-negative integer, not '%s'\n", what, text);
    exit(2);
  }
  return v;
}

static void initial_condition(double* u) {
  for (int i = 0; i < N; ++i)
    u[i] = (i > N / 4 && i < N / 2) ? 100.0 : 0.0;
}

static void step_once(double* u, double* next) {
  const double r = 0.25; /* alpha * dt / dx^2, stable for r <= 0.5 */
  next[0] = u[0];
  next[N - 1] = u[N - 1];
  for (int i = 1; i < N - 1; ++i)
    next[i] = u[i] + r * (u[i - 1] - 2.0 * u[i] + u[i + 1]);
  memcpy(u, next, sizeof(double) * N);
}

static uint64_t fnv1a(const void* data, size_t size) {
  const unsigned char* p = data;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < size; ++i)
    h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s STORE_DIR STEPS [--every K] [--crash-at STEP]\n", argv[0]);
    return 2;
  }
  const char* store_dir = argv[1];
  long steps = parse_count(argv[2], "STEPS");
  long every = 100, crash_at = -1;
  for (int i = 3; i < argc; ++i) {
    if (strcmp(argv[i], "--every") == 0 && i + 1 < argc) {
      every = parse_count(argv[++i], "--every");
    } else if (strcmp(argv[i], "--crash-at") == 0 && i + 1 < argc) {
      crash_at = parse_count(argv[++i], "--crash-at");
    } else {
      fprintf(stderr, "dvr-example-c: unknown argument '%s'\n", argv[i]);
      return 2;
    }
  }
  if (every == 0) every = 1;

  dvr_store* store = NULL;
  dvr_session* session = NULL;
  dvr_status st = dvr_store_open(store_dir, &store);
  if (st != DVR_OK) return fail("dvr_store_open", st);
  if ((st = dvr_session_open(store, "heat", &session)) != DVR_OK) return fail("dvr_session_open", st);

  /* The array lives in an SDK-owned region; the step counter is caller-owned. */
  double* u = NULL;
  struct progress progress = {0};
  if ((st = dvr_alloc(session, "u", sizeof(double) * N, (void**)&u)) != DVR_OK) return fail("dvr_alloc", st);
  if ((st = dvr_track(session, "progress", &progress, sizeof progress)) != DVR_OK) return fail("dvr_track", st);
  double* next = malloc(sizeof(double) * N);
  if (!next) {
    fprintf(stderr, "dvr-example-c: out of memory\n");
    return 1;
  }

  char latest[DVR_NAME_MAX + 1];
  st = dvr_latest(store, "heat", latest, sizeof latest);
  if (st == DVR_OK) {
    if ((st = dvr_restore(session, latest)) != DVR_OK) return fail("dvr_restore", st);
    printf("restarted from %s (step %lld)\n", latest, (long long)progress.step);
  } else if (st == DVR_E_NOT_FOUND) {
    initial_condition(u);
    printf("starting fresh\n");
  } else {
    return fail("dvr_latest", st);
  }

  while (progress.step < steps) {
    step_once(u, next);
    progress.step++;
    if (progress.step == crash_at) {
      printf("crashing at step %lld\n", (long long)progress.step);
      fflush(stdout);
      _exit(3);
    }
    if (progress.step % every == 0) {
      char name[32], label[64];
      snprintf(name, sizeof name, "step-%06lld", (long long)progress.step);
      snprintf(label, sizeof label, "heat equation after %lld steps", (long long)progress.step);
      if ((st = dvr_snapshot(session, name, label)) != DVR_OK) return fail("dvr_snapshot", st);
    }
  }

  printf("step %lld, u[N/2] = %.17g\n", (long long)progress.step, u[N / 2]);
  printf("checksum: %016llx\n", (unsigned long long)fnv1a(u, sizeof(double) * N));
  free(next);
  dvr_session_close(session); /* frees u */
  dvr_store_close(store);
  return 0;
}
