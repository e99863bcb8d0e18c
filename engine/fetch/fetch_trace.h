// FetchTrace: the order a training step fetches its groups in, learned from
// the first step and followed by the next ones. Prefetches read it ahead of
// the cursor, the resident set evicts by it (the copy used again farthest
// ahead goes first), and the optimizer updates groups in its order (the next
// forward's first fetches first, or the backward's).
//
// A step's own sequence is recorded fetch by fetch; at step_end it becomes
// the learned one when it differs, less the evaluation passes before the
// step's forward: when the fetches before the first backward fetch (marked by
// the step's first grad_buffer) are one sequence repeated, only the last
// repetition is the step's. The cursor follows the learned sequence: each
// fetch moves it past that group's next occurrence (wrapping), and before the
// backward a fetch of the sequence's first group starts a forward again.
// Thread-compatible (the engine's lock). Pure bookkeeping: group indices only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata::engine {

class FetchTrace {
 public:
  // A fetch of group g: recorded, and the cursor moves past its next use.
  void note_fetch(std::size_t g);
  // grad_buffer(g): the step's backward began with g's last fetch (the
  // first call of the step marks it).
  void note_backward(std::size_t g);
  // What learn() did with the step's sequence.
  enum class LearnOutcome {
    kUnchanged,  // the learned one again, or a step without fetches
    kFirst,      // the first sequence learned
    kNew,        // replaced the learned one by a sequence never learned before
    kSeen,       // replaced it by one learned before (control flow that alternates)
  };
  // step_end: the step's sequence (less evaluation passes) becomes the
  // learned one when it differs. The next step starts recording afresh.
  LearnOutcome learn();
  // How many different sequences learn() has taken so far (the first
  // kRememberedSequences are told apart; each one after them counts as new).
  std::size_t sequences_learned() const { return sequences_learned_; }
  static constexpr std::size_t kRememberedSequences = 64;

  // The learned sequence (empty before the first learn()).
  const std::vector<std::size_t>& learned() const { return learned_; }
  bool empty() const { return learned_.empty(); }
  // The position in learned() the next fetch is expected at.
  std::size_t cursor() const { return cursor_; }
  // The position of group g's next use from the cursor on (SIZE_MAX: not
  // again in this step).
  std::size_t next_use(std::size_t g) const;

  // The `groups` groups in the order of their first fetch in the learned
  // sequence (the next forward's), then those it never fetched by index.
  std::vector<std::size_t> forward_order(std::size_t groups) const;
  // Sorts groups into the order the backward hands their gradients over: by
  // their last place in the learned sequence (never fetched: last), and
  // backwards by index before one is learned.
  void sort_in_backward_order(std::vector<std::size_t>& groups) const;

 private:
  std::vector<std::size_t> learned_;
  std::size_t learned_backward_ = 0;  // index in learned_ of its first backward fetch
  std::size_t cursor_ = 0;
  std::vector<std::size_t> step_;          // this step's fetches so far
  std::size_t step_backward_ = SIZE_MAX;   // index in step_ of the first backward fetch
  // Fingerprints of the sequences learned so far (at most
  // kRememberedSequences; a collision only makes a new sequence read as seen).
  std::vector<std::uint64_t> seen_;
  std::size_t sequences_learned_ = 0;
};

}  // namespace strata::engine
