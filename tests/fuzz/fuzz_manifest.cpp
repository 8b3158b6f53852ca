// libFuzzer target: the manifest decoder (format/manifest.hpp, decode_manifest),
// which reads every snapshot's manifest file and must refuse any damage with
// dvr::Error, never crash or read out of bounds. What it accepts must encode
// and decode again to the same manifest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "dvr/error.hpp"
#include "format/manifest.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace dvr::detail;
  Manifest m;
  try {
    m = decode_manifest(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz input");
  } catch (const dvr::Error&) {
    return 0;  // refused: fine
  }
  // Accepted: it must survive a round trip unchanged in its encoding.
  std::string again = encode_manifest(m);
  Manifest m2 = decode_manifest(again, "re-encoded fuzz input");
  if (encode_manifest(m2) != again) std::abort();
  return 0;
}
