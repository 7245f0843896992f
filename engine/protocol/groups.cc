#include "strata/engine/protocol/groups.h"

#include <utility>

namespace strata::engine {

Result<GroupPlan> PlanGroups(const std::vector<std::string>& blocks,
                             const std::vector<ParamPlacement>& params, const GroupRules& rules) {
  const size_t nb = blocks.size();
  // Each parameter's home: 0 = root, b + 1 = block b.
  std::vector<std::vector<size_t>> trainable(nb + 1), frozen(nb + 1);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamPlacement& p = params[i];
    for (const int b : p.blocks) {
      if (b < 0 || static_cast<size_t>(b) >= nb) {
        return InvalidArgumentError(rules.caller + ": parameter '" + p.name +
                                    "' is placed in block " + std::to_string(b) + " of " +
                                    std::to_string(nb));
      }
    }
    size_t home = 0;
    if (p.blocks.size() == 1 && !p.outside) {
      home = static_cast<size_t>(p.blocks[0]) + 1;
    } else if (!p.blocks.empty() && rules.refuse_shared) {
      if (p.blocks.size() > 1) {
        return InvalidArgumentError(rules.caller + ": parameter '" + p.name +
                                    "' is shared between " + rules.block_word + "s '" +
                                    blocks[static_cast<size_t>(p.blocks[0])] + "' and '" +
                                    blocks[static_cast<size_t>(p.blocks[1])] + "'");
      }
      return InvalidArgumentError(
          rules.caller + ": parameter '" + p.name + "' is used both inside " + rules.block_word +
          " '" + blocks[static_cast<size_t>(p.blocks[0])] +
          "' and outside it; a wrapped module's parameters must be its own");
    }
    (p.trainable ? trainable : frozen)[home].push_back(i);
  }
  GroupPlan plan;
  plan.group_of_block.assign(nb, -1);
  PlannedGroup root;
  root.name = "root";
  root.params = std::move(trainable[0]);
  plan.groups.push_back(std::move(root));
  std::vector<size_t> home_of_group = {0};
  for (size_t b = 0; b < nb; ++b) {
    if (!rules.keep_empty_blocks && trainable[b + 1].empty() && frozen[b + 1].empty()) continue;
    PlannedGroup g;
    g.name = blocks[b];
    g.params = std::move(trainable[b + 1]);
    g.block = static_cast<int>(b);
    plan.group_of_block[b] = static_cast<int>(plan.groups.size());
    plan.groups.push_back(std::move(g));
    home_of_group.push_back(b + 1);
  }
  const size_t owners = plan.groups.size();
  for (size_t g = 0; g < owners; ++g) {
    std::vector<size_t>& f = frozen[home_of_group[g]];
    if (f.empty()) continue;
    PlannedGroup c;
    c.name = plan.groups[g].name + ":frozen";
    c.params = std::move(f);
    c.frozen = true;
    c.owner = static_cast<int>(g);
    plan.groups[g].companion = static_cast<int>(plan.groups.size());
    plan.groups.push_back(std::move(c));
  }
  return plan;
}

}  // namespace strata::engine
