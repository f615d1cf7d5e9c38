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

// torch::Tensor, torch::empty, torch::kInt64, ... as <torch/types.h> names them.
namespace torch {
using namespace at;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
}  // namespace torch
