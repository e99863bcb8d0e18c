// Scalar kernels (Adam with fp32, bf16 or 8-bit blockwise moments, Lion,
// Adagrad, the gradient pass): numerics.h applied element by element (block by
// block for the 8-bit moments). The reference every vector kernel must match
// bit for bit (finite inputs).
#include <bit>
#include <cmath>
#include <cstdint>

#include "cpu_adam/kernels/kernels.h"
#include "core/numerics.h"

namespace strata::adam::kernels {
namespace {

namespace nx = core::numerics;

float load_elem(const void* p, ElemType type, std::int64_t i) {
  switch (type) {
    case ElemType::kF32: return static_cast<const float*>(p)[i];
    case ElemType::kBf16: return nx::bf16_bits_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
    case ElemType::kF16: return nx::fp16_bits_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
  }
  return 0.0f;
}

void store_elem(void* p, ElemType type, std::int64_t i, float x) {
  switch (type) {
    case ElemType::kF32: static_cast<float*>(p)[i] = x; break;
    case ElemType::kBf16: static_cast<std::uint16_t*>(p)[i] = nx::fp32_to_bf16_bits(x); break;
    case ElemType::kF16: static_cast<std::uint16_t*>(p)[i] = nx::fp32_to_fp16_bits(x); break;
  }
}

void adam_scalar(const AdamKernelArgs& a) {
  const nx::AdamStepConstants& c = *a.constants;
  for (std::int64_t i = 0; i < a.n; ++i) {
    nx::adam_step(c, load_elem(a.grad, a.grad_type, i), a.master[i], a.exp_avg[i],
                  a.exp_avg_sq[i]);
    if (a.copy_out != nullptr) store_elem(a.copy_out, a.copy_type, i, a.master[i]);
  }
}

// The stochastic bits come from the key derived once per call, which is
// numerics::stochastic_rounding_bits(seed, step, index, moment) per element.
void adam_bf16_moments_scalar(const AdamBf16MomentsKernelArgs& a) {
  const nx::AdamStepConstants& c = *a.constants;
  const bool stochastic = a.rounding == nx::Bf16Rounding::kStochastic;
  const std::uint64_t key = stochastic ? nx::stochastic_rounding_key(a.seed, a.step) : 0;
  for (std::int64_t i = 0; i < a.n; ++i) {
    std::uint32_t bits_m = 0, bits_v = 0;
    if (stochastic) {
      bits_m = nx::stochastic_rounding_bits(key, a.index_base + i, nx::AdamMoment::kExpAvg);
      bits_v = nx::stochastic_rounding_bits(key, a.index_base + i, nx::AdamMoment::kExpAvgSq);
    }
    nx::adam_step_bf16_moments(c, load_elem(a.grad, a.grad_type, i), a.master[i], a.exp_avg[i],
                               a.exp_avg_sq[i], a.rounding, bits_m, bits_v);
    if (a.copy_out != nullptr) store_elem(a.copy_out, a.copy_type, i, a.master[i]);
  }
}

// Adam with 8-bit blockwise moments (Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization", 2022), one block of kQuantBlockElems at a time:
// dequantize the block's m and v with its scales, run the fp32 step, take the
// new moments' absolute maxima as the new scales, and quantize against them.
// The same operations as numerics::adam_step_int8_block, with the gradient
// read in its own type and the compute copy written as each master is.
void adam_int8_scalar(const AdamInt8KernelArgs& a) {
  const nx::AdamStepConstants& c = *a.constants;
  const nx::QuantTables& t = nx::kQuantTables;
  for (std::int64_t b = 0; b * nx::kQuantBlockElems < a.n; ++b) {
    const std::int64_t begin = b * nx::kQuantBlockElems;
    const std::int64_t end = begin + nx::kQuantBlockElems < a.n ? begin + nx::kQuantBlockElems : a.n;
    float m32[nx::kQuantBlockElems];
    float v32[nx::kQuantBlockElems];
    float m_absmax = 0.0f, v_absmax = 0.0f;
    for (std::int64_t i = begin; i < end; ++i) {
      float& m = m32[i - begin];
      float& v = v32[i - begin];
      m = nx::dequantize_m(t, a.exp_avg[i], a.exp_avg_scale[b]);
      v = nx::dequantize_v(t, a.exp_avg_sq[i], a.exp_avg_sq_scale[b]);
      nx::adam_step(c, load_elem(a.grad, a.grad_type, i), a.master[i], m, v);
      if (a.copy_out != nullptr) store_elem(a.copy_out, a.copy_type, i, a.master[i]);
      m_absmax = nx::absmax_step(m_absmax, m);
      v_absmax = nx::absmax_step(v_absmax, v);
    }
    const float m_scale = nx::block_scale(m_absmax);
    const float v_scale = nx::block_scale(v_absmax);
    a.exp_avg_scale[b] = m_scale;
    a.exp_avg_sq_scale[b] = v_scale;
    for (std::int64_t i = begin; i < end; ++i) {
      a.exp_avg[i] = nx::quantize_m(t, m32[i - begin], m_scale);
      a.exp_avg_sq[i] = nx::quantize_v(t, v32[i - begin], v_scale);
    }
  }
}

// Decade z's line of a code table of `width` bits (numerics.h's dynamic tree:
// values 10^-z (0.1 + 0.9 (F + 1) / 2^k) at r = 2^k + F, k = width - 1 - z),
// r = 2^k (10^z x - 0.1) / 0.9 + 2^k - 1, plus `bias`: y = a x + c.
constexpr void decade_line(int width, int z, double bias, float& a, float& c) {
  const double p = static_cast<double>(1 << (width - 1 - z));
  double ten_z = 1.0;
  for (int i = 0; i < z; ++i) ten_z *= 10.0;
  a = static_cast<float>(p * ten_z / 0.9);
  c = static_cast<float>(p - 1.0 - p * 0.1 / 0.9 + bias);
}

// kernels.h's QuantLines for a table of `width` bits (7: m, 8: v). Bin e
// holds the floats whose exponent field is 96 + 2e or 97 + 2e,
// [2^(2e - 31), 2^(2e - 29)); bin 0 takes everything below too. Below
// values[1] (the last decade's one value) the line runs from values[0] = 0:
// r = x / values[1], steeper than every decade's, so the minimum still holds.
constexpr QuantLines make_quant_lines(int width, const float* values) {
  const double bias = 0.5 + static_cast<double>(kQuantGuessDelta);
  const int last_decade = width - 1;
  // The line of the decade of x in [0, 1]: (10^-(z+1), 10^-z], the last
  // decade taking all below.
  const auto line_at = [&](double x, float& a, float& c) {
    int z = 0;
    double top = 0.1;
    while (z < last_decade && x <= top) {
      ++z;
      top /= 10.0;
    }
    if (z == last_decade) {
      a = static_cast<float>(1.0 / static_cast<double>(values[1]));
      c = static_cast<float>(bias);
    } else {
      decade_line(width, z, bias, a, c);
    }
  };
  QuantLines l{};
  l.lo = 0x30000000u;  // 2^-31
  double lo = 1.0;
  for (int i = 0; i < 31; ++i) lo /= 2.0;
  for (int e = 0; e < 16; ++e, lo *= 4.0) {
    const double hi = lo * 4.0;
    line_at(lo, l.a0[e], l.c0[e]);
    line_at(hi < 1.0 ? hi : 1.0, l.a1[e], l.c1[e]);
  }
  return l;
}

// kernels.h's QuantAllLines for a table of `width` bits: the origin line,
// then decades 0 .. width - 3.
constexpr QuantAllLines make_quant_all_lines(int width, const float* values) {
  const double bias = 0.5 + static_cast<double>(kQuantGuessDelta);
  QuantAllLines l{};
  l.count = width;
  l.a[0] = static_cast<float>(1.0 / static_cast<double>(values[1]));
  l.c[0] = static_cast<float>(bias);
  for (int z = 0; z <= width - 2; ++z) decade_line(width, z, bias, l.a[z + 1], l.c[z + 1]);
  return l;
}

// The vector kernels' view of kQuantTables (kernels.h).
constexpr QuantKernelTables make_quant_kernel_tables() {
  const nx::QuantTables& t = nx::kQuantTables;
  QuantKernelTables k{};
  for (int r = 0; r < 128; ++r) k.m_values[r] = t.m_values[r];
  for (int r = 0; r < 256; ++r) k.v_values[r] = t.v_values[r];
  for (int j = 0; j < 7; ++j) {
    const int s = 1 << (6 - j);
    for (int i = 0; i < (1 << j); ++i) k.m_levels[j][i] = t.m_thresholds[s * (2 * i + 1) - 1];
  }
  for (int j = 0; j < 8; ++j) {
    const int s = 1 << (7 - j);
    for (int i = 0; i < (1 << j); ++i) k.v_levels[j][i] = t.v_thresholds[s * (2 * i + 1) - 1];
  }
  k.m_lines = make_quant_lines(7, t.m_values);
  k.v_lines = make_quant_lines(8, t.v_values);
  k.m_all_lines = make_quant_all_lines(7, t.m_values);
  k.v_all_lines = make_quant_all_lines(8, t.v_values);
  for (int p = 0; p < 4; ++p) {
    for (int r = 0; r < 128; ++r) {
      k.m_value_bytes[p][r] = static_cast<std::uint8_t>(std::bit_cast<std::uint32_t>(t.m_values[r]) >> (8 * p));
    }
    for (int r = 0; r < 256; ++r) {
      k.v_value_bytes[p][r] = static_cast<std::uint8_t>(std::bit_cast<std::uint32_t>(t.v_values[r]) >> (8 * p));
    }
  }
  return k;
}

constexpr QuantKernelTables kQuantKernelTables = make_quant_kernel_tables();

void lion_scalar(const LionKernelArgs& a) {
  const nx::LionStepConstants& c = *a.constants;
  for (std::int64_t i = 0; i < a.n; ++i) {
    nx::lion_step(c, load_elem(a.grad, a.grad_type, i), a.master[i], a.exp_avg[i]);
    if (a.copy_out != nullptr) store_elem(a.copy_out, a.copy_type, i, a.master[i]);
  }
}

void adagrad_scalar(const AdagradKernelArgs& a) {
  const nx::AdagradStepConstants& c = *a.constants;
  for (std::int64_t i = 0; i < a.n; ++i) {
    nx::adagrad_step(c, load_elem(a.grad, a.grad_type, i), a.master[i], a.exp_avg_sq[i]);
    if (a.copy_out != nullptr) store_elem(a.copy_out, a.copy_type, i, a.master[i]);
  }
}

// Elements [begin, end) of a block; element `begin` sits in lane first_lane.
void grad_range(const GradKernelArgs& a, std::int64_t begin, std::int64_t end, double* lanes,
                std::int64_t first_lane) {
  const bool raw_copy = !a.accumulate && a.src_type == a.dst_type;
  for (std::int64_t i = begin; i < end; ++i) {
    if (raw_copy) {
      // A copy is a copy: 16-bit patterns (NaN payloads included) move unchanged.
      if (a.dst_type == ElemType::kF32) {
        static_cast<float*>(a.dst)[i] = static_cast<const float*>(a.src)[i];
      } else {
        static_cast<std::uint16_t*>(a.dst)[i] = static_cast<const std::uint16_t*>(a.src)[i];
      }
    } else {
      float x = load_elem(a.src, a.src_type, i);
      if (a.accumulate) x = static_cast<float*>(a.dst)[i] + x;
      store_elem(a.dst, a.dst_type, i, x);
    }
    const int lane = static_cast<int>((first_lane + i - begin) % nx::kNormLanes);
    lanes[lane] = lanes[lane] + nx::square_f64(load_elem(a.dst, a.dst_type, i));
  }
}

void grad_pass_scalar(const GradKernelArgs& a) {
  const std::int64_t blocks = nx::norm_block_count(a.n);
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t begin = b * nx::kNormBlockElems;
    const std::int64_t end = begin + nx::kNormBlockElems < a.n ? begin + nx::kNormBlockElems : a.n;
    double lanes[nx::kNormLanes] = {};
    grad_range(a, begin, end, lanes, 0);
    a.norm_partials[b] = nx::fold_norm_lanes(lanes);
  }
}

}  // namespace

void grad_tail_scalar(const GradKernelArgs& args, double* lanes, std::int64_t first_lane) {
  grad_range(args, 0, args.n, lanes, first_lane);
}

double fold_lanes_scalar(double* lanes) { return nx::fold_norm_lanes(lanes); }

const QuantKernelTables& quant_kernel_tables() { return kQuantKernelTables; }

QuantGuess quant_guess(const QuantLines& lines, float xn) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(xn);
  bits = bits > lines.lo ? bits : lines.lo;  // xn below 2^-31 counts as 2^-31
  const float xc = std::bit_cast<float>(bits);
  const std::uint32_t j = (bits >> 24) & 15;
  const float y0 = nx::fma_f32(xc, lines.a0[j], lines.c0[j]);
  const float y1 = nx::fma_f32(xc, lines.a1[j], lines.c1[j]);
  const float y = y1 < y0 ? y1 : y0;
  const float whole = std::trunc(y);
  return QuantGuess{static_cast<std::uint32_t>(whole), y - whole >= 2.0f * kQuantGuessDelta};
}

QuantGuess quant_guess(const QuantAllLines& lines, float xn) {
  float y = nx::fma_f32(xn, lines.a[0], lines.c[0]);
  for (int i = 1; i < lines.count; ++i) {
    const float yi = nx::fma_f32(xn, lines.a[i], lines.c[i]);
    y = yi < y ? yi : y;
  }
  const float whole = std::trunc(y);
  return QuantGuess{static_cast<std::uint32_t>(whole), y - whole >= 2.0f * kQuantGuessDelta};
}

const KernelTable& scalar_kernels() {
  static constexpr KernelTable kTable{Isa::kScalar, adam_scalar, grad_pass_scalar, lion_scalar,
                                      adagrad_scalar, adam_bf16_moments_scalar, adam_int8_scalar};
  return kTable;
}

}  // namespace strata::adam::kernels
