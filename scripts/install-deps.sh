#!/usr/bin/env bash
# Installs (with apt, as root) everything moe's build, tests, examples and benchmarks need.
# Idempotent: when every package is already present it returns in well under a second.
# apt's output goes to ${MOE_BUILD_DIR:-build}/moe-setup.log (scripts/lib.sh); the screen gets
# one line per phase and the download / install progress.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev
  libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libopenblas0-pthread libopenblas-dev
  libdnnl-dev ocl-icd-opencl-dev
  libyaml-cpp-dev nlohmann-json3-dev
  python3
)
# The plots (bench/plot_bench.py, scripts/plot_loss.py); the test command leaves them out.
[ "${MOE_PLOTTING:-1}" = 0 ] || PACKAGES+=(python3-matplotlib)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  moe_say "packages (apt): all ${#PACKAGES[@]} already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages: ${missing[*]} (run as root to install them)" >&2
  exit 1
fi
moe_log_init
export DEBIAN_FRONTEND=noninteractive
moe_say "installing packages (apt): ${#missing[@]} of ${#PACKAGES[@]} missing: ${missing[*]}"
moe_phase "updating package lists (apt-get update)" apt-get update -qq
# APT::Status-Fd=3: apt's progress lines on fd 3, which the filter turns into a compact line;
# apt's own output goes to the log.
apt_install() {
  apt-get -o APT::Status-Fd=3 install -y -qq --no-install-recommends "$@" \
    3>&1 1>>"$MOE_SETUP_LOG" 2>&1
}
moe_phase "downloading and installing them (apt-get install; a few minutes on a fresh machine)" \
  --filter moe_filter_apt apt_install "${missing[@]}"
