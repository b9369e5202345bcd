#pragma once
/// \file
/// Grouped-GEMM policy traits (as Kokkos Kernels' `*_tpl_spec_avail`): each gmm/backend/*.hpp
/// defines its tag and specialises is_policy and is_available (false: the call runs on Vendor).

#include <type_traits>

namespace moe::gmm {

/// \brief True for grouped-GEMM policy tags (specialised by each backend).
template <class Policy>
struct is_policy : std::false_type {};

/// \brief True when `Policy` runs natively on `ExecSpace` for `Scalar`; a policy that is not
/// available there runs as Vendor (same numbers up to rounding). Specialised by each backend.
template <class Policy, class ExecSpace, class Scalar>
struct is_available : std::true_type {};

/// \brief True when `Policy`'s implementation takes moe::bf16 row operands (gmm's lhs and out,
/// tgmm's lhs and dy) and GmmOptions::bf16_output itself; for other policies gmm and tgmm pass it
/// float copies and round after. Specialised by each backend that does.
template <class Policy>
struct handles_bf16 : std::false_type {};

/// \brief True when `Policy`'s implementation honours GmmOptions::round_rhs itself (rounding as it
/// packs the weights); for other policies gmm passes it a rounded copy of rhs on every call.
template <class Policy>
struct rounds_rhs : std::false_type {};

/// \brief Policy: the best backend of the execution space and scalar: OneDnn on host spaces for
/// float with oneDNN (MOE_ENABLE_ONEDNN), else Vendor on host spaces, DeviceTiled on devices.
struct Auto {};

template <>
struct is_policy<Auto> : std::true_type {};

}  // namespace moe::gmm
