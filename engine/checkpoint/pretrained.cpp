// Initial values from safetensors files (engine/checkpoint/pretrained.h).
#include "engine/checkpoint/pretrained.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "core/str.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += str_cat(i == 0 ? "" : ", ", shape[i]);
  return s + "]";
}

core::Result<PretrainedWeights> PretrainedWeights::open(const std::string& path, std::string name_prefix,
                                                        const IoConfig& io) {
  PretrainedWeights w;
  STRATA_ASSIGN_OR_RETURN(w.files_, find_safetensors(path, io));
  w.prefix_ = std::move(name_prefix);
  w.where_ = w.files_.describe();
  for (std::size_t f = 0; f < w.files_.files.size(); ++f) {
    const std::string& file = w.files_.files[f];
    // Only the header is read here; finalize reads the data.
    STRATA_ASSIGN_OR_RETURN(const SafetensorsReader r, SafetensorsReader::open(file, io));
    for (const TensorInfo& t : r.tensors()) {
      if (const auto it = w.tensors_.find(t.name); it != w.tensors_.end()) {
        return Status::data_loss(str_cat("tensor '", t.name, "' is in both ", w.files_.files[it->second.file],
                                         " and ", file));
      }
      if (!w.files_.index.empty()) {
        const auto m = w.files_.weight_map.find(t.name);
        if (m == w.files_.weight_map.end() || m->second != file) {
          return Status::data_loss(str_cat(w.files_.index, " does not list tensor '", t.name, "' of ", file,
                                           m == w.files_.weight_map.end() ? "" : str_cat(" (it names ", m->second, ")")));
        }
      }
      w.tensors_.emplace(t.name, Tensor{f, t.shape});
      w.order_.push_back(t.name);
    }
  }
  for (const auto& [tensor, file] : w.files_.weight_map) {
    if (!w.tensors_.contains(tensor)) {
      return Status::data_loss(
          str_cat(w.files_.index, " puts tensor '", tensor, "' in ", file, ", whose header does not have it"));
    }
  }
  return w;
}

core::Status PretrainedWeights::check_param(const ParamDesc& param) const {
  const std::string name = tensor_name(param.name);
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return Status::not_found(str_cat("parameter '", param.name, "' has no init callback and no tensor '", name,
                                     "' in ", where_));
  }
  if (it->second.shape != param.shape) {
    return Status::invalid_argument(str_cat("tensor '", name, "' in ", files_.files[it->second.file], " has shape ",
                                            shape_string(it->second.shape), "; parameter '", param.name,
                                            "' is registered with shape ", shape_string(param.shape)));
  }
  return Status();
}

core::Status PretrainedWeights::check_extra(std::span<const ParamDesc> params) const {
  std::map<std::string_view, bool> registered;
  for (const ParamDesc& p : params) registered.emplace(p.name, true);
  for (const std::string& name : order_) {
    const std::string& file = files_.files[tensors_.find(name)->second.file];
    if (!name.starts_with(prefix_)) {
      return Status::invalid_argument(str_cat("extra tensor '", name, "' in ", file,
                                              ": its name does not start with the name prefix '", prefix_,
                                              "', so no parameter takes it"));
    }
    const std::string_view param = std::string_view(name).substr(prefix_.size());
    if (!registered.contains(param)) {
      return Status::invalid_argument(str_cat("extra tensor '", name, "' in ", file, ": no parameter named '", param,
                                              "' is registered", prefix_.empty() ? "" : str_cat(" (name prefix '", prefix_, "')")));
    }
  }
  return Status();
}

std::size_t PretrainedWeights::file_of(std::string_view param) const {
  const auto it = tensors_.find(tensor_name(param));
  return it == tensors_.end() ? SIZE_MAX : it->second.file;
}

void PretrainedWeights::Stream::plan(std::size_t group, std::string_view param) {
  const std::size_t f = weights_.file_of(param);
  if (f != SIZE_MAX) last_group_[f] = std::max(last_group_[f], group);
}

core::Status PretrainedWeights::Stream::read(const ParamDesc& param, std::span<float> out) {
  const std::size_t f = weights_.file_of(param.name);
  if (f == SIZE_MAX) return weights_.check_param(param);  // its kNotFound
  const std::string& path = weights_.files()[f];
  if (open_[f] == nullptr) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::DirectFileReader> file,
                            nvme::DirectFileReader::open(backend_, path, options_));
    STRATA_ASSIGN_OR_RETURN(SafetensorsReader r, SafetensorsReader::open(std::move(file)));
    open_[f] = std::make_unique<SafetensorsReader>(std::move(r));
  }
  const std::string name = weights_.tensor_name(param.name);
  const TensorInfo* t = open_[f]->find(name);
  if (t == nullptr || t->shape != param.shape) {  // the file changed since its header was read
    return Status::data_loss(str_cat(path, ": tensor '", name, "' ",
                                     t == nullptr ? std::string("is gone") : str_cat("now has shape ", shape_string(t->shape)),
                                     " (parameter '", param.name, "' is ", shape_string(param.shape), ")"));
  }
  return open_[f]->read_f32(name, out);
}

void PretrainedWeights::Stream::end_group(std::size_t group) {
  for (std::size_t f = 0; f < open_.size(); ++f) {
    if (open_[f] != nullptr && last_group_[f] <= group) open_[f].reset();
  }
}

}  // namespace strata::engine
