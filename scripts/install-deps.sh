#!/usr/bin/env bash
# Installs (with apt, as root) everything moe's build, tests, examples and benchmarks need.
# Idempotent: when every package is already present it returns in well under a second.
set -euo pipefail
PACKAGES=(
  build-essential cmake ccache pkg-config git
  libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev
  libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libopenblas0-pthread libopenblas-dev
  libdnnl-dev ocl-icd-opencl-dev
  libyaml-cpp-dev nlohmann-json3-dev
  python3 python3-matplotlib
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages: ${missing[*]} (run as root to install them)" >&2
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
