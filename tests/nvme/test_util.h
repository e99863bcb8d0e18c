// Helpers shared by the nvme tests: temporary directories, random bytes,
// aligned buffers, and the backend parameter every conformance case runs over.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "nvme/io_backend.h"

namespace strata::nvme::testing_util {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string base = ::testing::TempDir();
    if (base.empty()) base = "/tmp/";
    if (base.back() != '/') base += '/';
    std::string tmpl = base + "strata_nvme_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    const char* p = ::mkdtemp(buf.data());
    EXPECT_NE(p, nullptr) << "mkdtemp " << tmpl;
    path_ = p != nullptr ? p : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const {
    const std::string p = path_ + "/" + name;
    std::filesystem::create_directories(p);
    return p;
  }

 private:
  std::string path_;
};

inline core::AlignedBuffer random_buffer(std::size_t size, std::uint32_t seed) {
  auto b = core::AlignedBuffer::allocate(std::max<std::size_t>(size, 1), core::kDirectIoAlignment);
  EXPECT_TRUE(b.ok());
  std::mt19937_64 rng(seed);
  auto* p = b->data();
  for (std::size_t i = 0; i < size; i += 8) {
    const std::uint64_t v = rng();
    for (std::size_t k = 0; k < 8 && i + k < size; ++k) p[i + k] = static_cast<std::byte>(v >> (8 * k));
  }
  return std::move(b).value();
}

inline core::AlignedBuffer zero_buffer(std::size_t size) {
  auto b = core::AlignedBuffer::allocate(std::max<std::size_t>(size, 1), core::kDirectIoAlignment);
  EXPECT_TRUE(b.ok());
  std::fill(b->data(), b->data() + b->size_bytes(), std::byte{0});
  return std::move(b).value();
}

inline bool same_bytes(const core::AlignedBuffer& a, const core::AlignedBuffer& b, std::size_t n) {
  return std::equal(a.data(), a.data() + n, b.data());
}

// The backends every conformance case runs over.
inline const std::vector<BackendKind>& all_backends() {
  static const std::vector<BackendKind> kinds = {BackendKind::kIoUring, BackendKind::kLibaio, BackendKind::kPsync};
  return kinds;
}

inline std::string backend_name(const ::testing::TestParamInfo<BackendKind>& info) {
  switch (info.param) {
    case BackendKind::kIoUring: return "IoUring";
    case BackendKind::kLibaio: return "Libaio";
    case BackendKind::kPsync: return "Psync";
    case BackendKind::kAuto: return "Auto";
  }
  return "Unknown";
}

// Empty when `kind` can run here; otherwise why not (for GTEST_SKIP).
inline std::string unavailable_reason(BackendKind kind) {
  if (!backend_compiled(kind)) return std::string(to_string(kind)) + " was not built into this binary";
  IoBackendOptions o;
  o.kind = kind;
  o.queue_depth = 4;
  auto b = IoBackend::create(o);
  if (!b.ok()) return std::string(to_string(kind)) + " cannot run here: " + b.status().to_string();
  return {};
}

}  // namespace strata::nvme::testing_util
