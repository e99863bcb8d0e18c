// libFuzzer target: a checkpoint's small files (engine/checkpoint/manifest.h). Each input is
// parsed as manifest.json as given, then with its checksum made right (the input taken as the
// bytes before the checksum member, the member appended as a save writes it), so the mutator
// reaches the JSON reader behind the checksum; and as a latest pointer. Any input must give a
// result or an error naming the file, never a crash, hang or unbounded memory; a manifest that
// parses must write (format_checkpoint_manifest) to bytes that parse to the same manifest.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/check.h"
#include "core/logging.h"
#include "engine/checkpoint/manifest.h"
#include "nvme/crc64.h"

namespace {

using strata::engine::CheckpointManifest;

const std::string kPath = "fuzz/step-1/manifest.json";

std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

void check_manifest(std::span<const std::byte> bytes) {
  auto parsed = strata::engine::parse_checkpoint_manifest(bytes, kPath);
  if (!parsed.ok()) {
    STRATA_CHECK(parsed.status().message().find(kPath) != std::string_view::npos)
        << "an error that does not name the file: " << parsed.status();
    return;
  }
  if (parsed->version == 1) return;  // read, never written
  const std::string text = strata::engine::format_checkpoint_manifest(*parsed);
  auto again = strata::engine::parse_checkpoint_manifest(bytes_of(text), kPath);
  STRATA_CHECK(again.ok()) << "a written manifest does not parse: " << again.status() << "\n" << text;
  CheckpointManifest a = *std::move(parsed), b = *std::move(again);
  // The config is kept as text: compare it as the writer normalizes it.
  STRATA_CHECK(strata::engine::format_checkpoint_manifest(a) == strata::engine::format_checkpoint_manifest(b))
      << "format then parse changed the manifest:\n" << text;
  a.config_json = b.config_json = "{}";
  STRATA_CHECK(a == b) << "format then parse changed the manifest:\n" << text;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  strata::core::set_log_sink([](strata::core::LogLevel, std::string_view) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  check_manifest(bytes_of(input));
  const std::string fixed = std::string(input) + ",\n  \"manifest_crc64\": \"" +
                            strata::engine::crc64_hex(strata::nvme::crc64(0, bytes_of(input))) + "\"\n}\n";
  check_manifest(bytes_of(fixed));
  auto latest = strata::engine::parse_latest_pointer(bytes_of(input), "fuzz/latest");
  if (latest.ok()) {
    std::int64_t step = -1;
    STRATA_CHECK(strata::engine::parse_step_dir_name(latest->step_dir_name, &step) && step >= 0)
        << "latest names '" << latest->step_dir_name << "'";
  }
  return 0;
}
