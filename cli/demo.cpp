#include "demo.hpp"

#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli_util.hpp"
#include "output.hpp"

namespace dvr::cli {
namespace {

constexpr std::size_t kColumns = 64;

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double uniform(std::uint64_t& s) { return static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53; }

// A synthetic feature table standing in for a data set loaded and parsed from
// storage: each column has its own distribution (normal-ish, skewed, periodic),
// and every row gets a class label derived from its features.
void build_dataset(float* data, std::int32_t* labels, std::size_t rows) {
  for (std::size_t r = 0; r < rows; ++r) {
    std::uint64_t s = r * 0x2545F4914F6CDD1Dull + 12345;
    float* row = data + r * kColumns;
    double acc = 0;
    for (std::size_t c = 0; c < kColumns; ++c) {
      double irwin_hall = uniform(s) + uniform(s) + uniform(s) - 1.5;  // ~normal
      double v;
      switch (c % 4) {
        case 0:
          v = 10.0 + 3.0 * irwin_hall;
          break;
        case 1:
          v = std::exp(irwin_hall);
          break;  // skewed
        case 2:
          v = std::sin(static_cast<double>(r) * 0.001 * static_cast<double>(c + 1)) + 0.1 * irwin_hall;
          break;
        default:
          v = static_cast<double>(c) * irwin_hall;
          break;
      }
      row[c] = static_cast<float>(v);
      acc += v;
    }
    labels[r] = static_cast<std::int32_t>(acc) & 7;
  }
}

constexpr int kTrialPercent = 3;

// One trial of a sweep: a feature-engineering step on one slice of the data —
// rescale and perturb a random contiguous 3% of the rows and relabel them —
// then score it. Returns the score.
double run_trial(float* data, std::int32_t* labels, std::size_t rows, int trial) {
  std::uint64_t s = 0xC0FFEEull + static_cast<std::uint64_t>(trial);
  const std::size_t n = std::max<std::size_t>(1, rows * kTrialPercent / 100);
  const std::size_t first = splitmix(s) % (rows - n + 1);
  double factor = 1.0 + 0.05 * trial, score = 0;
  for (std::size_t r = first; r < first + n; ++r) {
    float* row = data + r * kColumns;
    for (std::size_t c = 0; c < kColumns; ++c)
      row[c] = static_cast<float>(row[c] * factor + 0.01 * (uniform(s) - 0.5));
    labels[r] = (labels[r] + trial) & 7;
    score += row[0];
  }
  return score / static_cast<double>(n);
}

std::uint64_t checksum(const float* data, std::size_t rows, const std::int32_t* labels) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, data, rows * kColumns * sizeof(float));
  XXH3_64bits_update(st, labels, rows * sizeof(std::int32_t));
  std::uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

}  // namespace

int run_demo(Store& store, const DemoOptions& o) {
  const std::size_t rows = std::max<std::size_t>(1, o.size / (kColumns * sizeof(float)));
  const std::size_t data_bytes = rows * kColumns * sizeof(float);
  auto say = [&](const std::string& line) {
    if (!o.json) std::cout << line << std::flush;
  };

  say("Memory DVR demo\nstore:    " + printable(store.path()) + " (" + medium_name(store.medium()) +
      (store.medium() == Medium::dram ? ": survives process crashes, not reboots" : "") + ")\n");
  say("data set: " + format_bytes(static_cast<double>(data_bytes)) + " float32 feature table (" + std::to_string(rows) + " rows × " +
      std::to_string(kColumns) + ") + " + format_bytes(static_cast<double>(rows * 4)) + " labels\n");

  // The feature table is caller-owned memory (tracked); the labels live in an
  // SDK-owned region (alloc).
  std::unique_ptr<float[]> data(new float[rows * kColumns]);
  Session session(store, "demo");
  session.track("features", data.get(), data_bytes);
  auto* labels = static_cast<std::int32_t*>(session.alloc("labels", rows * sizeof(std::int32_t)).data());
  say("tracking: " + std::string(tracking_name(session.tracking("features"))) +
      (session.tracking_note().empty() ? "" : " (" + session.tracking_note() + ")") + " — a restore copies back only what the trial changed\n\n");

  double t0 = seconds_now();
  build_dataset(data.get(), labels, rows);
  double first_build = seconds_now() - t0;
  t0 = seconds_now();
  build_dataset(data.get(), labels, rows);
  double rebuild = seconds_now() - t0;
  const std::uint64_t baseline = checksum(data.get(), rows, labels);
  say("  build data set (first load)      " + format_seconds(first_build) + "\n");
  say("  rebuild in place (the peer)      " + format_seconds(rebuild) + "\n");

  t0 = seconds_now();
  ProgressReporter progress("snapshot", o.json ? ProgressMode::none : o.progress);
  SnapshotInfo snap = session.snapshot("loaded", {.label = "demo data set", .replace = true, .progress = progress.callback()});
  progress.finish();
  double snapshot_s = seconds_now() - t0;
  say("  snapshot demo/loaded             " + format_seconds(snapshot_s) + "   (" + format_bytes(static_cast<double>(snap.stored_bytes)) +
      " written)\n");
  t0 = seconds_now();
  SnapshotInfo again = session.snapshot("loaded-again", {.label = "unchanged: deduplicated", .replace = true});
  double again_s = seconds_now() - t0;
  say("  snapshot again, data unchanged   " + format_seconds(again_s) + "   (" + format_bytes(static_cast<double>(again.stored_bytes)) +
      " written: identical chunks are stored once)\n\n");

  std::vector<double> restores;
  bool all_ok = true;
  for (int t = 1; t <= o.trials; ++t) {
    double score = run_trial(data.get(), labels, rows, t);
    bool changed = checksum(data.get(), rows, labels) != baseline;
    t0 = seconds_now();
    session.restore("loaded");
    double r = seconds_now() - t0;
    restores.push_back(r);
    bool ok = checksum(data.get(), rows, labels) == baseline;
    all_ok = all_ok && ok && changed;
    char line[160];
    std::snprintf(line, sizeof line, "  trial %d: rescaled %d%% of the rows (score %.3f), restore %s, checksum %s\n", t, kTrialPercent, score,
                  format_seconds(r).c_str(), ok ? "ok" : "MISMATCH");
    say(line);
  }
  double sum = 0, best = restores.front();
  for (double r : restores) {
    sum += r;
    best = std::min(best, r);
  }
  double mean = sum / static_cast<double>(restores.size());
  double speedup = rebuild / mean;
  GcReport gc = store.gc();  // drop data of earlier demo runs that was replaced

  if (o.json) {
    json doc = document();
    doc["data_bytes"] = data_bytes;
    doc["rows"] = rows;
    doc["store"] = jstr(store.path());
    doc["medium"] = medium_name(store.medium());
    doc["first_build_s"] = first_build;
    doc["rebuild_s"] = rebuild;
    doc["snapshot_s"] = snapshot_s;
    doc["snapshot_again_s"] = again_s;
    doc["snapshot_again_bytes"] = again.stored_bytes;
    doc["restore_mean_s"] = mean;
    doc["restore_best_s"] = best;
    doc["speedup"] = speedup;
    doc["tracking"] = tracking_name(session.tracking("features"));
    doc["checksums_ok"] = all_ok;
    print_json(doc);
  } else {
    std::printf("\n  %-34s %s\n", "rebuild the data set", format_seconds(rebuild).c_str());
    std::printf("  %-34s %s\n", "snapshot", format_seconds(snapshot_s).c_str());
    std::printf("  %-34s %s (best %s)\n", "restore (mean of trials)", format_seconds(mean).c_str(), format_seconds(best).c_str());
    std::printf("  %-34s %.1fx faster than rebuilding\n", "speed-up", speedup);
    std::printf(
        "\n%s. The snapshots stay in the store (gc reclaimed %s of older runs):\n"
        "  dvr ls demo    dvr info demo/loaded    dvr verify\n",
        all_ok ? "All restores were bit-exact" : "A CHECKSUM DID NOT MATCH",
        format_bytes(static_cast<double>(gc.bytes_before > gc.bytes_after ? gc.bytes_before - gc.bytes_after : 0)).c_str());
  }
  return all_ok ? 0 : 1;
}

}  // namespace dvr::cli
