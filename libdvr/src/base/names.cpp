// Snapshot references: "SESSION/NAME" (dvr/store.hpp).
#include <string>
#include <utility>

#include "dvr/error.hpp"
#include "dvr/store.hpp"
#include "store/store_impl.hpp"

namespace dvr {

std::pair<std::string, std::string> split_ref(const std::string& ref) {
  const auto slash = ref.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == ref.size() || ref.find('/', slash + 1) != std::string::npos)
    throw Error(Errc::invalid_argument, "'" + ref + "' is not a snapshot reference; write SESSION/NAME (e.g. sweep/loaded) or proc/NAME");
  return {ref.substr(0, slash), ref.substr(slash + 1)};
}

bool is_valid_name(const std::string& name) noexcept { return detail::valid_name(name); }

}  // namespace dvr
