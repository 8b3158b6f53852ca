// Bash completion from the CLI11 command tree (completion.hpp).
#include "completion.hpp"

#include <functional>
#include <sstream>

namespace dvr::cli {

namespace {

// "path" → the words that may follow it: its subcommands and options.
void collect(const CLI::App& app, const std::string& path, std::vector<std::pair<std::string, std::string>>& out) {
  std::string words;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    words += (words.empty() ? "" : " ") + sub->get_name();
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_group().empty()) continue;  // hidden
    for (auto& l : opt->get_lnames())
      words += (words.empty() ? "--" : " --") + l;
    for (auto& s : opt->get_snames())
      words += (words.empty() ? "-" : " -") + s;
  }
  // The global options (fallthrough) are valid after any command.
  out.emplace_back(path, words);
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    collect(*sub, path.empty() ? sub->get_name() : path + " " + sub->get_name(), out);
}

}  // namespace

std::string bash_completion(const CLI::App& app) {
  std::vector<std::pair<std::string, std::string>> paths;
  collect(app, "", paths);
  std::string globals;
  for (const CLI::Option* opt : app.get_options())
    if (!opt->get_group().empty())
      for (auto& l : opt->get_lnames())
        globals += " --" + l;
  std::ostringstream s;
  s << "# bash completion for dvr (Memory DVR); made by `dvr completion bash`.\n"
       "# Source it, or install it as /usr/share/bash-completion/completions/dvr.\n"
       "_dvr() {\n"
       "  local cur=\"${COMP_WORDS[COMP_CWORD]}\" path=\"\" next w i\n"
       "  for ((i = 1; i < COMP_CWORD; i++)); do\n"
       "    w=\"${COMP_WORDS[i]}\"\n"
       "    [[ $w == -- ]] && return 0  # the rest is a command line (dvr run)\n"
       "    next=\"${path:+$path }$w\"\n"
       "    case \"$next\" in\n";
  for (auto& [path, words] : paths)
    if (!path.empty()) s << "      \"" << path << "\") path=\"$next\" ;;\n";
  s << "    esac\n"
       "  done\n"
       "  local words=\"\"\n"
       "  case \"$path\" in\n";
  for (auto& [path, words] : paths)
    s << "    \"" << path << "\") words=\"" << words << (path.empty() ? "" : globals) << "\" ;;\n";
  s << "  esac\n"
       "  if [[ $cur == -* || -n $words ]]; then\n"
       "    COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))\n"
       "  fi\n"
       "}\n"
       "complete -o default -F _dvr dvr\n";
  return s.str();
}

}  // namespace dvr::cli
