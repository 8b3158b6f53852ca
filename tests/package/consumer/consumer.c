/* An outside C program using the installed C API (dvr/dvr.h): snapshot a
 * buffer, change it, restore it, check it is bit-exact. Built by
 * consumer/CMakeLists.txt only when dvr/dvr.h is installed.
 *
 *   consumer_c STORE_DIR [EXPECTED_VERSION]
 */
#include <dvr/dvr.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIZE (1u << 20)

static int failed(const char* what) {
  fprintf(stderr, "consumer_c: %s: %s\n", what, dvr_errmsg());
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: consumer_c STORE_DIR [EXPECTED_VERSION]\n");
    return 2;
  }
  if (argc > 2 && strcmp(dvr_version(), argv[2]) != 0) {
    fprintf(stderr, "consumer_c: libdvr says version %s, expected %s\n", dvr_version(), argv[2]);
    return 1;
  }
  unsigned char* data = malloc(SIZE);
  unsigned char* original = malloc(SIZE);
  if (!data || !original) return 1;
  for (size_t i = 0; i < SIZE; ++i) data[i] = (unsigned char)(i * 7 + 3);
  memcpy(original, data, SIZE);

  dvr_store* store = NULL;
  dvr_session* s = NULL;
  if (dvr_store_open(argv[1], &store) != DVR_OK) return failed("dvr_store_open");
  if (dvr_session_open(store, "consumer-c", &s) != DVR_OK) return failed("dvr_session_open");
  if (dvr_track(s, "data", data, SIZE) != DVR_OK) return failed("dvr_track");
  if (dvr_snapshot(s, "base", "from C") != DVR_OK) return failed("dvr_snapshot");
  for (size_t i = 0; i < SIZE; i += 4096) data[i] ^= 0xff;
  if (dvr_restore(s, "base") != DVR_OK) return failed("dvr_restore");
  if (memcmp(data, original, SIZE) != 0) {
    fprintf(stderr, "consumer_c: restore was not bit-exact\n");
    return 1;
  }
  dvr_session_close(s);
  dvr_store_close(store);
  printf("consumer_c: dvr %s, snapshot and restore of %u bytes ok\n", dvr_version(), SIZE);
  free(data);
  free(original);
  return 0;
}
