// `dvr completion bash`: a bash completion script made from the command tree,
// so that it always knows every command and option the binary has.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace dvr::cli {

/// The script: defines _dvr and registers it for `dvr` (complete -F). It
/// completes commands, subcommands and options (not values, except file
/// names, bash's default).
std::string bash_completion(const CLI::App& app);

}  // namespace dvr::cli
