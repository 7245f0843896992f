// How a model's parameters become the engine's groups: the rules both front ends follow
// (the LibTorch front end's strata::zero3 holders, the Python front end's blocks), in one
// place. A front end says which blocks there are and, for each parameter, which blocks hold
// it, whether the model also holds it outside every block, and whether it trains; PlanGroups
// returns the groups in the engine's order:
//
//   group 0             the root: every parameter held by no block (and, with
//                       GroupRules::refuse_shared false, every shared one: tied weights)
//   groups 1..          one per block, in the blocks' order, holding the trainable
//                       parameters held by that block alone
//   then                a frozen group per group that has frozen parameters (requires_grad
//                       false), in the same order: gathered with its owner, with no
//                       optimizer state and no gradient (GroupDesc::frozen)
//
// Within a group the parameters keep the order the front end gave them in (which is the
// order of the group's flat buffer, so it must be the same on every rank and in every run
// that shares checkpoints).
//
// Thread-safety: a pure function.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::engine {

// One parameter as a front end sees it (a tied parameter once).
struct ParamPlacement {
  std::string name;         // its first name in the model
  std::vector<int> blocks;  // the blocks whose modules hold it (indices into the blocks)
  bool outside = false;     // the model also holds it outside every block
  bool trainable = true;    // false: frozen (requires_grad false)
};

struct GroupRules {
  // A parameter held by several blocks, or by a block and outside it (tied weights): true
  // refuses it, naming it (the LibTorch front end: its blocks are the user's strata::zero3
  // holders, which must own their parameters); false puts it in the root group, which is
  // gathered through every forward and backward.
  bool refuse_shared = false;
  // A block left with no parameter at all: true keeps it as a group of no parameters (the
  // LibTorch front end: holder k is group k + 1); false drops it.
  bool keep_empty_blocks = false;
  // How errors name a block and the call: "strata::zero3 module", "strata::initialize".
  std::string block_word = "block";
  std::string caller = "strata.initialize";
};

struct PlannedGroup {
  std::string name;            // the root: "root"; a block: its name; frozen: "<owner>:frozen"
  std::vector<size_t> params;  // indices into the placements, in their order
  bool frozen = false;
  int companion = -1;  // the frozen group gathered with this one (-1: none)
  int owner = -1;      // a frozen group: the group it is gathered with
  int block = -1;      // the block this group is (-1: the root or a frozen group)
};

struct GroupPlan {
  std::vector<PlannedGroup> groups;
  std::vector<int> group_of_block;  // each block's group; -1: dropped (no parameter)
};

// InvalidArgument naming the parameter for a shared one under refuse_shared, or for a
// placement naming a block that does not exist.
Result<GroupPlan> PlanGroups(const std::vector<std::string>& blocks,
                             const std::vector<ParamPlacement>& params, const GroupRules& rules);

}  // namespace strata::engine
