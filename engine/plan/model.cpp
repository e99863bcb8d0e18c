// The model the planner sizes: a parameter count or a transformer shape resolved
// (resolve_model), the activation estimate, and the counts the command line parses.
#include "engine/plan/plan.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/str.h"
#include "engine/plan/plan_internal.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
using plan_detail::invalid;
using plan_detail::kMaxParams;
using plan_detail::u64;

// Elements of the tensors of one block, in the order of transformer_num_params.
std::array<std::int64_t, 12> block_tensor_elems(std::int64_t h) {
  return {3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h};
}

}  // namespace

namespace plan_detail {

core::Result<ModelSummary> resolve_model(const Config& config, const ModelSpec& spec) {
  ModelSummary m;
  m.has_shape = spec.hidden_size != 0 || spec.vocab_size != 0;
  if (spec.num_layers == 0) {
    return invalid("num_layers (--layers) is required: the number of layers (fetch groups)");
  }
  if (spec.num_layers < 0) {
    return invalid(str_cat("num_layers (--layers) must be positive, got ", spec.num_layers));
  }
  m.num_layers = spec.num_layers;
  if (m.has_shape) {
    if (spec.num_params != 0) {
      return invalid(
          "give either num_params (--params) or a transformer shape (--hidden, --vocab), not both");
    }
    if (spec.hidden_size <= 0) {
      return invalid(
          str_cat("hidden_size (--hidden) must be positive with a transformer shape, got ",
                  spec.hidden_size));
    }
    if (spec.vocab_size <= 0) {
      return invalid(str_cat("vocab_size (--vocab) must be positive with a transformer shape, got ",
                             spec.vocab_size));
    }
    if (spec.num_heads < 0 || spec.num_heads > spec.hidden_size) {
      return invalid(str_cat("num_heads (--heads) must be in [1, hidden_size = ", spec.hidden_size,
                             "], got ", spec.num_heads));
    }
    m.hidden_size = spec.hidden_size;
    m.vocab_size = spec.vocab_size;
    m.num_heads =
        spec.num_heads != 0 ? spec.num_heads : std::max<std::int64_t>(1, spec.hidden_size / 128);
    STRATA_ASSIGN_OR_RETURN(m.num_params,
                            transformer_num_params(m.num_layers, m.hidden_size, m.vocab_size));
  } else {
    if (spec.num_heads != 0) {
      return invalid("num_heads (--heads) needs a transformer shape (--hidden, --vocab)");
    }
    if (spec.num_params == 0) {
      return invalid(
          "the model size is required: give num_params (--params) or a transformer shape "
          "(--hidden, --vocab)");
    }
    if (spec.num_params < 0) {
      return invalid(str_cat("num_params (--params) must be positive, got ", spec.num_params));
    }
    m.num_params = spec.num_params;
  }
  if (m.num_params > kMaxParams) {
    return invalid(str_cat("the model has ", m.num_params,
                           " parameters, beyond the planner's range (", kMaxParams, ")"));
  }
  if (m.num_layers > m.num_params) {
    return invalid(str_cat("num_layers (--layers) ", m.num_layers,
                           " exceeds num_params (--params) ", m.num_params,
                           ": a layer holds at least one parameter"));
  }
  if (!(spec.frozen_fraction >= 0.0 && spec.frozen_fraction <= 1.0)) {
    return invalid(str_cat("frozen_fraction (--frozen-fraction) must be in [0, 1], got ",
                           spec.frozen_fraction));
  }
  m.frozen_fraction = spec.frozen_fraction;
  m.num_frozen_params = share_of(m.num_params, spec.frozen_fraction);
  m.num_trainable_params = m.num_params - m.num_frozen_params;
  if (spec.lora_rank != 0) {
    if (spec.lora_rank < 0) return invalid(str_cat("lora_rank (--lora) must be positive, got ", spec.lora_rank));
    if (!m.has_shape) {
      return invalid("lora_rank (--lora) needs a transformer shape (--hidden, --vocab): the adapters' size follows "
                     "the hidden size");
    }
    if (spec.frozen_fraction != 0.0) {
      return invalid("give either lora_rank (--lora) or frozen_fraction (--frozen-fraction), not both: LoRA "
                     "freezes every parameter but its adapters");
    }
    if (spec.lora_rank > spec.hidden_size) {
      return invalid(str_cat("lora_rank (--lora) ", spec.lora_rank, " exceeds the hidden size ", spec.hidden_size));
    }
    // Adapters A (r x in) and B (out x r) on each block's qkv (h -> 3h),
    // output (h -> h) and two MLP (h -> 4h, 4h -> h) matrices: r (4h + 2h
    // + 5h + 5h) = 16 r h a layer. They add to the base's parameters.
    const std::int64_t adapters = m.num_layers * 16 * spec.lora_rank * spec.hidden_size;
    m.lora_rank = spec.lora_rank;
    m.mixed_groups = true;
    m.num_frozen_params = m.num_params;
    m.num_trainable_params = adapters;
    m.num_params += adapters;
    m.frozen_fraction = static_cast<double>(m.num_frozen_params) / static_cast<double>(m.num_params);
    if (m.num_params > kMaxParams) {
      return invalid(str_cat("the model has ", m.num_params, " parameters with its adapters, beyond the planner's range (",
                             kMaxParams, ")"));
    }
  }
  if (spec.seq_len <= 0) {
    return invalid(str_cat("seq_len (--seq) must be positive, got ", spec.seq_len));
  }
  m.seq_len = spec.seq_len;
  if (spec.micro_batch < 0) {
    return invalid(str_cat("micro_batch (--micro-batch) must be positive, got ", spec.micro_batch));
  }
  m.micro_batch = spec.micro_batch != 0 ? spec.micro_batch : config.train_micro_batch_size_per_gpu;
  if (m.micro_batch <= 0) {
    return invalid(str_cat("train_micro_batch_size_per_gpu must be positive, got ", m.micro_batch));
  }
  m.activation_checkpointing = spec.activation_checkpointing;

  const std::int64_t threshold = config.zero.stage3_param_persistence_threshold;
  if (m.has_shape) {
    const std::int64_t h = m.hidden_size;
    const std::int64_t adapters_per_layer = m.mixed_groups ? m.num_trainable_params / m.num_layers : 0;
    m.group_params = std::max(12 * h * h + 13 * h + adapters_per_layer, m.vocab_size * h);
    std::int64_t per_block = 0;
    for (std::int64_t elems : block_tensor_elems(h)) {
      if (elems < threshold) per_block += elems;
    }
    m.persistent_params = m.num_layers * per_block;
    if (h < threshold) m.persistent_params += 2 * h;  // final layer norm
    if (m.vocab_size * h < threshold) m.persistent_params += m.vocab_size * h;
    STRATA_ASSIGN_OR_RETURN(
        ActivationEstimate act,
        estimate_activations(m.num_layers, h, m.num_heads, m.vocab_size, m.seq_len, m.micro_batch,
                             m.activation_checkpointing, config.compute_bytes()));
    m.activations = act;
  } else {
    m.group_params = (m.num_params + m.num_layers - 1) / m.num_layers;
  }
  return m;
}

}  // namespace plan_detail

core::Result<ActivationEstimate> estimate_activations(
    std::int64_t num_layers, std::int64_t hidden_size, std::int64_t num_heads,
    std::int64_t vocab_size, std::int64_t seq_len, std::int64_t micro_batch,
    bool activation_checkpointing, int compute_bytes) {
  if (num_layers <= 0 || hidden_size <= 0 || num_heads <= 0 || vocab_size <= 0 || seq_len <= 0 ||
      micro_batch <= 0 || (compute_bytes != 2 && compute_bytes != 4)) {
    return invalid(str_cat("activation estimate: layers ", num_layers, ", hidden ", hidden_size,
                           ", heads ", num_heads, ", vocab ", vocab_size, ", seq ", seq_len,
                           ", micro-batch ", micro_batch, " must all be positive"));
  }
  // Checked 64-bit arithmetic: any overflow makes the estimate an error.
  bool overflow = false;
  auto mul = [&overflow](std::uint64_t x, std::uint64_t y) {
    std::uint64_t r = 0;
    overflow = overflow || __builtin_mul_overflow(x, y, &r);
    return r;
  };
  auto add = [&overflow](std::uint64_t x, std::uint64_t y) {
    std::uint64_t r = 0;
    overflow = overflow || __builtin_add_overflow(x, y, &r);
    return r;
  };
  const std::uint64_t s = u64(seq_len), b = u64(micro_batch), h = u64(hidden_size);
  const std::uint64_t a = u64(num_heads), L = u64(num_layers), V = u64(vocab_size);
  const std::uint64_t scale = u64(compute_bytes);  // over 2: 16-bit is the paper's unit
  const std::uint64_t sb = mul(s, b);
  const std::uint64_t full = mul(mul(sb, add(mul(34, h), mul(mul(5, a), s))), scale) / 2;
  const std::uint64_t kept_ckpt = mul(mul(2, mul(sb, h)), scale) / 2;
  const std::uint64_t kept = activation_checkpointing ? kept_ckpt : full;
  const std::uint64_t layers =
      activation_checkpointing ? add(mul(L, kept_ckpt), full) : mul(L, full);
  const std::uint64_t logits = mul(mul(4, sb), V);
  const std::uint64_t total = add(layers, logits);
  if (overflow) {
    return invalid("activation estimate overflows 64 bits: check --seq, --hidden, --micro-batch");
  }
  ActivationEstimate e;
  e.full_layer_bytes = full;
  e.kept_layer_bytes = kept;
  e.layers_bytes = layers;
  e.logits_bytes = logits;
  e.total_bytes = total;
  return e;
}

core::Result<std::int64_t> transformer_num_params(std::int64_t num_layers, std::int64_t hidden_size,
                                                  std::int64_t vocab_size) {
  if (num_layers <= 0 || hidden_size <= 0 || vocab_size <= 0) {
    return invalid(str_cat("transformer shape: layers ", num_layers, ", hidden ", hidden_size,
                           ", vocab ", vocab_size, " must all be positive"));
  }
  // L (12 h^2 + 13 h) + V h + 2 h, checked.
  std::int64_t params = 0;
  std::int64_t hh = 0, block = 0, blocks = 0, embed = 0;
  const bool overflow = __builtin_mul_overflow(hidden_size, hidden_size, &hh) ||
                        __builtin_mul_overflow(hh, std::int64_t{12}, &block) ||
                        __builtin_add_overflow(block, 13 * hidden_size, &block) ||
                        __builtin_mul_overflow(num_layers, block, &blocks) ||
                        __builtin_mul_overflow(vocab_size, hidden_size, &embed) ||
                        __builtin_add_overflow(blocks, embed, &params) ||
                        __builtin_add_overflow(params, 2 * hidden_size, &params) ||
                        hidden_size > (std::int64_t{1} << 40);
  if (overflow) {
    return invalid(str_cat("transformer shape: layers ", num_layers, " x hidden ", hidden_size,
                           " x vocab ", vocab_size, " overflows 64 bits"));
  }
  return params;
}

bool parse_count(std::string_view text, std::int64_t* out) {
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start]))) ++start;
  s.erase(0, start);
  if (s.empty()) return false;
  const bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.')) return false;
  if (s.find_first_of("xXpP") != std::string::npos) return false;  // strtold's hex floats
  char* end = nullptr;
  const long double number = std::strtold(s.c_str(), &end);
  if (end == s.c_str() || !std::isfinite(number)) return false;
  std::string suffix(end);
  long double mult = 0;
  if (suffix.empty()) mult = 1;
  if (suffix == "k" || suffix == "K") mult = 1e3L;
  if (suffix == "m" || suffix == "M") mult = 1e6L;
  if (suffix == "b" || suffix == "B" || suffix == "g" || suffix == "G") mult = 1e9L;
  if (suffix == "t" || suffix == "T") mult = 1e12L;
  if (mult == 0) return false;
  const long double value = number * mult;
  const long double rounded = std::round(value);
  if (rounded >= 9.2e18L) return false;
  if (std::fabs(value - rounded) > 1e-9L * std::max(1.0L, rounded)) return false;
  const auto v = static_cast<std::int64_t>(rounded);
  *out = negative ? -v : v;
  return true;
}

}  // namespace strata::engine
