#pragma once
/// \file
/// Exceptions thrown by moe. Every message names the offending value and the rule it breaks.

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe {

/// \brief Base of every exception moe throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// \brief A configuration key or value breaks a rule (unknown key, bad value, incompatible
/// options).
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// \brief A tensor has the wrong shape for the layer's configuration.
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// \brief Input data is unusable (NaN/Inf in activations or weights, ids out of range).
class InputError : public Error {
 public:
  using Error::Error;
};

/// \brief A computation produced a value that is not finite where one must be (a training step's
/// loss or gradient norm, a tensor about to be saved): training diverged.
class NumericError : public Error {
 public:
  using Error::Error;
};

/// \brief A file could not be read or written, or its content is malformed.
class IoError : public Error {
 public:
  using Error::Error;
};

/// \brief An MPI call failed on this rank. Not collective: the other ranks may be waiting in a
/// collective, so a program that catches it should report it and end the job (MPI_Abort).
class CommError : public Error {
 public:
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
