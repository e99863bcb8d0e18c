// libFuzzer target: the swap index (nvme/internal/swap_index.h) and reopening a swap store from it
// (nvme::SwapStore::open). Each input is decoded as it is, then with its trailing CRC64 made right
// (so that mutations reach the body's parser). An index that decodes with at most kMaxPaths paths
// and small files is then reopened for real: its paths are replaced by fresh directories holding
// swap files of the sizes it names, and every block is read, then one more is allocated and
// written. Nothing may crash, hang or grow memory beyond the input's sizes; errors must name what
// was wrong.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "core/logging.h"
#include "core/unique_fd.h"
#include "nvme/crc64.h"
#include "nvme/internal/swap_index.h"
#include "nvme/swap_store.h"

namespace {

using strata::nvme::SwapStore;
namespace internal = strata::nvme::internal;

constexpr std::size_t kMaxPaths = 4;
constexpr std::uint64_t kMaxFileBytes = 16ull << 20;  // sparse, on the temporary directory's file system
constexpr std::uint64_t kMaxBlockBytes = 1ull << 20;  // largest block read back

std::string g_root;  // a private temporary directory, made once

void write_file(const std::string& path, std::string_view bytes) {
  strata::core::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  STRATA_CHECK(fd.valid()) << "create " << path;
  STRATA_CHECK(::write(fd.get(), bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size())) << path;
}

void reopen(internal::SwapIndex index) {
  std::error_code ec;
  std::filesystem::remove_all(g_root + "/run", ec);
  for (std::size_t i = 0; i < index.paths.size(); ++i) {
    index.paths[i] = g_root + "/run/p" + std::to_string(i);
    std::filesystem::create_directories(index.paths[i]);
    const std::string file = index.paths[i] + "/" + std::string(SwapStore::kSwapFileName);
    write_file(file, "");
    STRATA_CHECK(::truncate(file.c_str(), static_cast<off_t>(index.file_bytes[i])) == 0) << file;
  }
  const std::string index_path = g_root + "/run/swap.index";
  write_file(index_path, internal::encode_index(index));
  strata::nvme::SwapStoreOptions options;
  options.io.kind = strata::nvme::BackendKind::kPsync;
  options.io.queue_depth = 2;
  options.direct_io = strata::nvme::DirectIo::kOff;
  auto store = SwapStore::open(options, index_path);
  if (!store.ok()) {
    STRATA_CHECK(!store.status().message().empty()) << "an error without a message";
    return;
  }
  for (const internal::IndexBlock& b : index.blocks) {
    if (b.size > kMaxBlockBytes) continue;
    std::vector<std::byte> out(b.size);
    (*store)->read(b.id, out).ignore_error();  // never written, or a CRC mismatch: both are errors here
  }
  std::vector<std::byte> data(8192, std::byte{0x5a});
  if ((*store)->allocate("fuzz-new-block", data.size()).ok()) {
    (*store)->write("fuzz-new-block", data).ignore_error();  // a full store may refuse
  }
  (*store)->close().ignore_error();  // the directory goes away next
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  strata::core::set_log_sink([](strata::core::LogLevel, std::string_view) {});
  std::string tmpl = (std::filesystem::temp_directory_path() / "strata_swap_fuzz_XXXXXX").string();
  STRATA_CHECK(::mkdtemp(tmpl.data()) != nullptr) << "mkdtemp " << tmpl;
  g_root = tmpl;
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(g_root, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto as_is = internal::decode_index(bytes, "fuzz.index");
  if (!as_is.ok()) STRATA_CHECK(!as_is.status().message().empty()) << "an error without a message";
  // The same bytes with a right CRC64 (decode_index checks it before the body).
  if (size < 8) return 0;
  std::string fixed(bytes);
  const std::string_view body = std::string_view(fixed).substr(0, size - 8);
  const std::uint64_t crc = strata::nvme::crc64(0, std::as_bytes(std::span<const char>(body.data(), body.size())));
  for (int i = 0; i < 8; ++i) fixed[size - 8 + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
  auto index = internal::decode_index(fixed, "fuzz.index");
  if (!index.ok()) {
    STRATA_CHECK(!index.status().message().empty()) << "an error without a message";
    return 0;
  }
  STRATA_CHECK(internal::encode_index(*index).size() <= size) << "decoding invented bytes";
  if (index->paths.empty() || index->paths.size() > kMaxPaths) return 0;
  for (std::uint64_t b : index->file_bytes) {
    if (b > kMaxFileBytes) return 0;
  }
  reopen(*std::move(index));
  return 0;
}
