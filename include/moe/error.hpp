#pragma once
/// \file
/// Exceptions thrown by moe. Every message names the offending value and the rule it breaks.

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe {

/// \brief Base of every exception moe throws.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// \brief A config key or value breaks a rule (unknown key, bad value, incompatible options).
struct ConfigError : Error {
  using Error::Error;
};

/// \brief A tensor has the wrong shape for the layer's configuration.
struct ShapeError : Error {
  using Error::Error;
};

/// \brief Input data is unusable (NaN/Inf in activations or weights, ids out of range).
struct InputError : Error {
  using Error::Error;
};

/// \brief A value that must be finite is not (a step's loss or gradient norm, a tensor to save).
struct NumericError : Error {
  using Error::Error;
};

/// \brief A file could not be read or written, or its content is malformed.
struct IoError : Error {
  using Error::Error;
};

/// \brief An MPI call failed on this rank. Not collective: the other ranks may be waiting in a
/// collective, so a program that catches it should report it and end the job (MPI_Abort).
struct CommError : Error {
  using Error::Error;
};

namespace detail {

/// Concatenates its arguments with operator<< into one message.
template <class... Args>
std::string cat(Args const&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

/// Throws E(cat(args...)) unless cond holds.
template <class E = Error, class... Args>
void require(bool cond, Args const&... args) {
  if (!cond) throw E(cat(args...));
}

}  // namespace detail
}  // namespace moe
