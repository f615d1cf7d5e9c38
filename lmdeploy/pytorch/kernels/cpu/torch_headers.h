// The parts of torch the kernels use, without <torch/extension.h>: that header (all of the C++ frontend and
// pybind) took about 25 s to compile in every translation unit, these about 2 s. Only bindings.cpp includes
// pybind. A kernel that needs another ATen op includes its <ATen/ops/NAME.h> here.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

// torch::Tensor, torch::empty, torch::kInt64, ... as <torch/types.h> names them.
namespace torch {
using namespace at;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace torch
