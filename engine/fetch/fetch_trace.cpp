#include "engine/fetch/fetch_trace.h"

#include <algorithm>
#include <cstdint>

namespace strata::engine {
namespace {

// The fetches of a training step without the evaluation passes that came
// before its forward (see the top of fetch_trace.h). `backward` is the index
// of the first backward fetch (the sequence's size when the step had none).
struct Learned {
  std::vector<std::size_t> sequence;
  std::size_t backward;  // index of its first backward fetch (its size without one)
};
Learned without_evaluation_passes(const std::vector<std::size_t>& seq, std::size_t backward) {
  backward = std::min(backward, seq.size());
  for (std::size_t period = 1; period < backward; ++period) {
    if (backward % period != 0) continue;
    bool repeats = true;
    for (std::size_t i = period; i < backward && repeats; ++i) repeats = seq[i] == seq[i - period];
    if (repeats) return {{seq.begin() + static_cast<std::ptrdiff_t>(backward - period), seq.end()}, period};
  }
  return {seq, backward};
}

// FNV-1a over the sequence and the place of its backward.
std::uint64_t fingerprint(const std::vector<std::size_t>& seq, std::size_t backward) {
  std::uint64_t h = 14695981039346656037ull;
  auto mix = [&h](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(seq.size());
  mix(backward);
  for (std::size_t g : seq) mix(g);
  return h;
}

}  // namespace

FetchTrace::LearnOutcome FetchTrace::learn() {
  Learned learned = without_evaluation_passes(step_, step_backward_);
  LearnOutcome outcome = LearnOutcome::kUnchanged;
  if (!learned.sequence.empty() && learned.sequence != learned_) {
    const std::uint64_t print = fingerprint(learned.sequence, learned.backward);
    const bool seen = std::find(seen_.begin(), seen_.end(), print) != seen_.end();
    outcome = learned_.empty() ? LearnOutcome::kFirst : seen ? LearnOutcome::kSeen : LearnOutcome::kNew;
    if (!seen) {
      ++sequences_learned_;
      if (seen_.size() < kRememberedSequences) seen_.push_back(print);
    }
    learned_ = std::move(learned.sequence);
    learned_backward_ = learned.backward;
  }
  step_.clear();
  step_backward_ = SIZE_MAX;
  cursor_ = 0;
  return outcome;
}

void FetchTrace::note_backward(std::size_t g) {
  if (step_backward_ != SIZE_MAX) return;
  const auto it = std::find(step_.rbegin(), step_.rend(), g);
  if (it != step_.rend()) step_backward_ = static_cast<std::size_t>(step_.rend() - it) - 1;
}

void FetchTrace::note_fetch(std::size_t g) {
  step_.push_back(g);
  if (learned_.empty()) return;
  // The next occurrence of g from the cursor on (wrapping: an evaluation pass
  // between steps starts the forward again).
  const auto from = learned_.begin() + static_cast<std::ptrdiff_t>(std::min(cursor_, learned_.size()));
  auto it = std::find(from, learned_.end(), g);
  if (it == learned_.end()) it = std::find(learned_.begin(), from, g);
  // Before this step's backward, the trace's first group starts a forward
  // again (an evaluation pass, or the training forward after one): follow the
  // trace from its start, not from that group's place in the backward.
  // (Only while the cursor has not followed the trace into its backward: a
  // backward fetch may come before the grad_buffer that marks the backward.)
  if (step_backward_ == SIZE_MAX && g == learned_.front() && cursor_ <= learned_backward_ &&
      static_cast<std::size_t>(it - learned_.begin()) >= learned_backward_) {
    it = learned_.begin();
  }
  if (it != learned_.end()) cursor_ = static_cast<std::size_t>(it - learned_.begin()) + 1;
}

std::size_t FetchTrace::next_use(std::size_t g) const {
  for (std::size_t i = cursor_; i < learned_.size(); ++i) {
    if (learned_[i] == g) return i;
  }
  return SIZE_MAX;
}

std::vector<std::size_t> FetchTrace::forward_order(std::size_t groups) const {
  std::vector<std::size_t> order;
  order.reserve(groups);
  std::vector<bool> placed(groups, false);
  for (std::size_t g : learned_) {
    if (!placed[g]) order.push_back(g);
    placed[g] = true;
  }
  for (std::size_t g = 0; g < groups; ++g) {
    if (!placed[g]) order.push_back(g);
  }
  return order;
}

void FetchTrace::sort_in_backward_order(std::vector<std::size_t>& groups) const {
  std::size_t n = 0;
  for (std::size_t g : groups) n = std::max(n, g + 1);
  for (std::size_t g : learned_) n = std::max(n, g + 1);
  std::vector<std::size_t> last(n, SIZE_MAX);
  for (std::size_t i = 0; i < learned_.size(); ++i) last[learned_[i]] = i;
  std::sort(groups.begin(), groups.end(), [&](std::size_t a, std::size_t b) {
    if (last[a] != last[b]) return last[a] < last[b];
    return a > b;
  });
}

}  // namespace strata::engine
