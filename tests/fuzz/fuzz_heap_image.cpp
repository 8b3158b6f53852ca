// libFuzzer target: the heap image of a process snapshot (proc/proc_heaps.hpp,
// parse_image) and its metadata (proc/metadata.hpp, decode_meta): both arrive
// with a process snapshot from another machine and must refuse damage with
// dvr::Error. An accepted heap image must survive format_image and a second
// parse unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "dvr/error.hpp"
#include "proc/metadata.hpp"
#include "proc/proc_heaps.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using dvr::detail::heaps::format_image;
  using dvr::detail::heaps::HeapImage;
  using dvr::detail::heaps::parse_image;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    (void)dvr::proc::impl::decode_meta(text, "fuzz");
  } catch (const dvr::Error&) {
  }
  HeapImage image;
  try {
    image = parse_image(text);
  } catch (const dvr::Error&) {
    return 0;
  }
  const std::string again = format_image(image);
  if (format_image(parse_image(again)) != again) std::abort();
  return 0;
}
