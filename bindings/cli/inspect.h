// `strata inspect CKPT [--verify] [--json]`: what a checkpoint holds (step,
// counters, placement, config, tensors) and, with --verify, a full CRC64
// check of every file (engine/checkpoint/inspect.h does the reading).
#pragma once

#include <iosfwd>
#include <string>

namespace strata::cli {

// Exit statuses of inspect_command.
inline constexpr int kInspectOk = 0;
inline constexpr int kInspectDamaged = 1;  // DATA_LOSS: a file of the checkpoint is damaged (named on stderr)
inline constexpr int kInspectBadInput = 2;  // no checkpoint there, unreadable, or a newer format

// Prints the checkpoint at `checkpoint_dir` (a root holding `latest`, which is
// followed, or a step-<N> folder) to `out`: a table, or JSON with `json`
// (engine::format_inspection_json). With `verify`, every file's CRC64 is
// checked first. Errors go to `err` as "strata inspect: <message>" (the
// message names the file). Returns kInspectOk, kInspectDamaged or kInspectBadInput.
int inspect_command(const std::string& checkpoint_dir, bool verify, bool json, std::ostream& out,
                    std::ostream& err);
// The same on stdout and stderr.
int inspect_command(const std::string& checkpoint_dir, bool verify, bool json);

// The usage lines of `strata inspect`, for the command's help.
const char* inspect_usage();

}  // namespace strata::cli
