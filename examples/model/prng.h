// Counter-based random numbers for the example model: every value is a pure
// function of (key, index), so results never depend on the order in which
// parameters are initialised or batches drawn, nor on the standard library
// (std::normal_distribution's output differs between implementations).
#pragma once

#include <cmath>
#include <cstdint>

namespace strata::examples {

// splitmix64's output function: a bijective 64-bit mixer with good avalanche.
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A key for one stream of values, derived from a seed and up to two labels
// (e.g. a parameter's index, or "batch" and the step).
inline std::uint64_t stream_key(std::uint64_t seed, std::uint64_t a, std::uint64_t b = 0) {
  return splitmix64(splitmix64(splitmix64(seed) ^ a) ^ b);
}

// Uniform in (0, 1): the top 53 bits plus half an ulp, so never 0 or 1.
inline double uniform_open01(std::uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

// Standard normal value number `index` of stream `key` (Box-Muller in double,
// using the cosine branch only). Computed in double and rounded once to float,
// so a last-bit difference between libm implementations almost never shows.
inline float gaussian(std::uint64_t key, std::uint64_t index) {
  const double u1 = uniform_open01(splitmix64(key ^ splitmix64(2 * index)));
  const double u2 = uniform_open01(splitmix64(key ^ splitmix64(2 * index + 1)));
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
}

}  // namespace strata::examples
