// libFuzzer target: safetensors files (engine::SafetensorsReader). The input is a whole file (8-byte
// header length, JSON header, data), put in a memfd and opened by path as the importer opens one. Any
// input must open or give an error; every tensor of a file that opens must read (raw and as fp32).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "core/logging.h"
#include "core/unique_fd.h"
#include "engine/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  strata::core::set_log_sink([](strata::core::LogLevel, std::string_view) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  strata::core::UniqueFd fd(::memfd_create("safetensors_fuzz", MFD_CLOEXEC));
  STRATA_CHECK(fd.valid()) << "memfd_create";
  for (std::size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd.get(), data + done, size - done);
    STRATA_CHECK(n > 0) << "write to the memfd";
    done += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd.get());
  auto reader = strata::engine::SafetensorsReader::open(path);
  if (!reader.ok()) {
    STRATA_CHECK(!reader.status().message().empty()) << "an error without a message";
    return 0;
  }
  for (const strata::engine::TensorInfo& t : reader->tensors()) {
    STRATA_CHECK(t.offset + t.nbytes <= size) << "tensor '" << t.name << "' outside the file";
    std::vector<std::byte> raw(t.nbytes);
    const auto s = reader->read_raw(t.name, raw);
    STRATA_CHECK(s.ok()) << s;
    std::vector<float> f32(static_cast<std::size_t>(t.numel()));
    const auto s32 = reader->read_f32(t.name, f32);
    STRATA_CHECK(s32.ok()) << s32;
  }
  return 0;
}
