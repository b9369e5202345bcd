#pragma once
/// \file
/// Umbrella header of the moe library.

#include <moe/config.hpp>
#include <moe/moe_config.hpp>
#include <moe/error.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/layer.hpp>
#include <moe/nn/activation.hpp>
#include <moe/permute/permute.hpp>
#include <moe/policies.hpp>
#include <moe/routing/router.hpp>
