#include "common/testing.h"

#include <cstdlib>

namespace jaxdet {
namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::map<std::string, std::string> parse(const char* value) {
  std::map<std::string, std::string> items;
  if (value == nullptr) return items;
  const std::string all(value);
  size_t start = 0;
  while (start <= all.size()) {
    size_t end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    const std::string item = trim(all.substr(start, end - start));
    if (!item.empty()) {
      const size_t eq = item.find('=');
      // A malformed item (no '=') is kept with an empty value: jaxdet/_switches.py refuses it.
      if (eq == std::string::npos) {
        items[item] = "";
      } else {
        items[trim(item.substr(0, eq))] = trim(item.substr(eq + 1));
      }
    }
    start = end + 1;
  }
  return items;
}

}  // namespace

const std::map<std::string, std::string>& testing_overrides() {
  static const std::map<std::string, std::string> items = parse(std::getenv(kTestingEnv));
  return items;
}

const std::string* testing_override(const std::string& key) {
  const auto& items = testing_overrides();
  const auto it = items.find(key);
  return it == items.end() ? nullptr : &it->second;
}

}  // namespace jaxdet
