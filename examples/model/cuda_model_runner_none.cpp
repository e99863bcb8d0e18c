// CudaModelRunner in a build without the CUDA runner (no CUDA or no cuBLAS):
// create() checks its arguments and then reports why it cannot run; no
// runner can exist, so the other members are never reached.
#include "examples/model/cuda_model_runner.h"

#include <utility>

#include "core/check.h"
#include "core/str.h"

namespace strata::examples {

class CudaModelRunner::Impl {};

core::Result<CudaModelRunner> CudaModelRunner::create(const ResidualMlp& model, std::vector<GroupLayout> layouts,
                                                      const CudaRunnerOptions& /*options*/) {
  if (static_cast<int>(layouts.size()) != model.num_groups()) {
    return core::Status::invalid_argument(core::str_cat("CudaModelRunner: ", layouts.size(), " layouts for ",
                                                        model.num_groups(), " groups"));
  }
  for (int g = 0; g < model.num_groups(); ++g) {
    STRATA_RETURN_IF_ERROR(model.check_layout(g, layouts[static_cast<std::size_t>(g)]));
  }
  return core::Status::unimplemented(
      "CudaModelRunner: this build has no CUDA example runner (CUDA or cuBLAS was not found at meson setup)");
}

CudaModelRunner::CudaModelRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModelRunner::CudaModelRunner(CudaModelRunner&& other) noexcept = default;
CudaModelRunner& CudaModelRunner::operator=(CudaModelRunner&& other) noexcept = default;
CudaModelRunner::~CudaModelRunner() = default;

namespace {
[[noreturn]] void unreachable(const char* what) {
  STRATA_CHECK(false) << "CudaModelRunner::" << what << " without CUDA: create() never succeeds in this build";
  __builtin_unreachable();
}
}  // namespace

void* CudaModelRunner::native_stream() const { unreachable("native_stream"); }
int CudaModelRunner::device_ordinal() const { unreachable("device_ordinal"); }
core::Status CudaModelRunner::begin(const Batch& /*batch*/, float /*loss_scale*/) { unreachable("begin"); }
core::Status CudaModelRunner::forward_group(int /*group_index*/, const CudaWeights& /*weights*/) {
  unreachable("forward_group");
}
double CudaModelRunner::loss() const { unreachable("loss"); }
core::Status CudaModelRunner::outputs(std::span<float> /*out*/) const { unreachable("outputs"); }
core::Status CudaModelRunner::backward_group(int /*group_index*/, const CudaWeights& /*weights*/,
                                             const CudaGrads& /*grads*/) {
  unreachable("backward_group");
}

}  // namespace strata::examples
