// docs/config.md must match the key table, and the generated texts must cover it.
//
// To regenerate docs/config.md: build/bin/strata-config defaults --markdown > docs/config.md
// or run this test with STRATA_REGENERATE_DOCS=1 in the environment.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "strata/core/config.h"

namespace strata {
namespace {

// The first line where two texts differ, for a readable failure.
std::string FirstDifference(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  std::string la, lb;
  for (int line = 1;; ++line) {
    const bool ga = static_cast<bool>(std::getline(sa, la));
    const bool gb = static_cast<bool>(std::getline(sb, lb));
    if (!ga && !gb) return "(texts differ only in the final newline)";
    if (!ga || !gb || la != lb) {
      return "first difference at line " + std::to_string(line) +
             ":\n  file: " + (ga ? la : "<end of file>") +
             "\n  code: " + (gb ? lb : "<end of text>");
    }
  }
}

TEST(ConfigDocTest, DocsConfigMdMatchesTheCode) {
  const char* src = std::getenv("STRATA_SOURCE_DIR");
  if (src == nullptr || *src == '\0') {
    GTEST_SKIP() << "STRATA_SOURCE_DIR is not set (ctest sets it; see strata_gtest)";
  }
  const std::string path = std::string(src) + "/docs/config.md";
  const std::string expected = ConfigReferenceMarkdown();

  if (const char* regen = std::getenv("STRATA_REGENERATE_DOCS");
      regen && std::string(regen) == "1") {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    ASSERT_TRUE(out) << "cannot write " << path;
    out << expected;
    out.close();
    ASSERT_TRUE(out) << "writing " << path << " failed";
  }

  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path << " is missing; generate it with "
                  << "`build/bin/strata-config defaults --markdown > docs/config.md` "
                  << "(or run this test with STRATA_REGENERATE_DOCS=1)";
  std::ostringstream text;
  text << in.rdbuf();
  EXPECT_TRUE(text.str() == expected)
      << path << " does not match core/config_keys.cc; regenerate it with "
      << "`build/bin/strata-config defaults --markdown > docs/config.md` "
      << "(or run this test with STRATA_REGENERATE_DOCS=1).\n"
      << FirstDifference(text.str(), expected);
}

TEST(ConfigDocTest, MarkdownListsEveryKey) {
  const std::string md = ConfigReferenceMarkdown();
  const size_t refused_section = md.find("## DeepSpeed keys that Strata refuses");
  ASSERT_NE(refused_section, std::string::npos);
  for (const KeySpec& k : ConfigKeys()) {
    const std::string cell = "| `" + std::string(k.path) + "` |";
    const size_t at = md.find(cell);
    ASSERT_NE(at, std::string::npos) << k.path << " is missing from the reference";
    if (k.not_supported.empty()) {
      EXPECT_LT(at, refused_section) << k.path;
    } else {
      EXPECT_GT(at, refused_section) << k.path;
    }
    if (!k.alias.empty()) {
      EXPECT_NE(md.find("Also accepted as `" + std::string(k.alias) + "`"), std::string::npos);
    }
  }
  // Every table row has the same number of cells as its header (no unescaped '|').
  std::istringstream lines(md);
  std::string line;
  int rows = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    ++rows;
    int bars = 0;
    for (size_t i = 0; i < line.size(); ++i) {
      if (line[i] == '|' && (i == 0 || line[i - 1] != '\\')) ++bars;
    }
    const bool refused = md.find(line) > refused_section;
    EXPECT_EQ(bars, refused ? 4 : 6) << line;
  }
  EXPECT_EQ(rows, static_cast<int>(ConfigKeys().size()));
  EXPECT_EQ(md.back(), '\n');
}

TEST(ConfigDocTest, MarkdownShowsTypesDefaultsAndRanges) {
  const std::string md = ConfigReferenceMarkdown();
  EXPECT_NE(md.find("| `aio.block_size` | bytes | `1048576` | 4096 to 1073741824 |"),
            std::string::npos);
  EXPECT_NE(md.find("| `optimizer.type` | enum | `\"Adam\"` | `Adam`, `AdamW`, `Lamb` |"),
            std::string::npos);
  EXPECT_NE(md.find("| `optimizer.params.eps` | number | `1e-08` | > 0 |"), std::string::npos);
  EXPECT_NE(md.find("| `scheduler.type` | enum | required |"), std::string::npos);
  EXPECT_NE(md.find("| `zero_optimization.offload_optimizer.nvme_path` | path or [paths] | "
                    "(absent) |"),
            std::string::npos);
  EXPECT_NE(md.find("| `optimizer.params.betas` | [number, number] | `[0.9, 0.999]` | each in "
                    "[0, 1) |"),
            std::string::npos);
  EXPECT_NE(md.find("| `flops_profiler` | `{\"enabled\": false}` |"), std::string::npos);
  EXPECT_NE(md.find("| `pipeline` | (never) |"), std::string::npos);
  EXPECT_NE(md.find("Only with scheduler.type WarmupDecayLR/WarmupCosineLR."), std::string::npos);
}

TEST(ConfigDocTest, KeysTextHasOneLinePerLeafAndRefusedKey) {
  const std::string text = ConfigKeysText();
  std::istringstream lines(text);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    ++n;
    EXPECT_FALSE(line.empty());
    EXPECT_NE(line.back(), ' ') << "trailing blanks: \"" << line << "\"";
  }
  int expected = 0;
  for (const KeySpec& k : ConfigKeys()) {
    if (k.type != KeyType::kObject || !k.not_supported.empty()) ++expected;
  }
  EXPECT_EQ(n, expected);
  EXPECT_NE(text.find("aio.use_gds"), std::string::npos);
  EXPECT_NE(text.find("not supported by Strata: GPUDirect Storage is not implemented"),
            std::string::npos);
  EXPECT_NE(text.find("strata.log_level"), std::string::npos);
}

}  // namespace
}  // namespace strata
