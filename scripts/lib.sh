# shellcheck shell=bash
# Shared by the scripts in scripts/ (sourced, not run). Each phase of a script (installing
# packages, configuring, building, running) prints a short "[moe] ..." line and its time; the
# phase's own output (apt, cmake, the compiler) goes to one log, ${MOE_BUILD_DIR:-build}/
# moe-setup.log (MOE_SETUP_LOG overrides the path). When a phase fails, the last lines of the log
# and its path are printed on stderr and the script exits with the phase's status.
#
#   MOE_VERBOSE=1  also show each phase's whole output (scripts/test.sh's default, as CI reads it)
#
# The first script of a chain (main.sh -> build.sh -> install-deps.sh) starts the log; the
# scripts it runs append to it.

MOE_TAIL_LINES=${MOE_TAIL_LINES:-40}

# Microseconds since the epoch.
moe_now_us() {
  if [ -n "${EPOCHREALTIME:-}" ]; then
    local t=${EPOCHREALTIME/[.,]/}
    echo $((10#$t))
  else
    echo $(($(date +%s) * 1000000))
  fi
}

# "0.4s", "12.3s", "6m05s" for a span in microseconds.
moe_span() {
  local us=$1
  if [ "$us" -lt 60000000 ]; then
    local ds=$(((us + 50000) / 100000))
    printf '%d.%ds' $((ds / 10)) $((ds % 10))
  else
    local s=$(((us + 500000) / 1000000))
    printf '%dm%02ds' $((s / 60)) $((s % 60))
  fi
}

moe_say() { printf '[moe] %s\n' "$*"; }

# A command line as one string that a shell would read back as the same words.
moe_quote() {
  local out='' w
  for w in "$@"; do
    case $w in
      *[!A-Za-z0-9_./=:,+@%-]* | '') out+=" $(printf '%q' "$w")" ;;
      *) out+=" $w" ;;
    esac
  done
  printf '%s' "${out# }"
}

# Starts the log unless a script that ran this one already did.
moe_log_init() {
  if [ -n "${MOE_SETUP_LOG_OWNER:-}" ] && [ -n "${MOE_SETUP_LOG:-}" ]; then
    return 0
  fi
  local log=${MOE_SETUP_LOG:-${MOE_BUILD_DIR:-build}/moe-setup.log}
  mkdir -p "$(dirname "$log")"
  log="$(cd "$(dirname "$log")" && pwd)/$(basename "$log")"
  : >"$log"
  MOE_SETUP_LOG=$log
  MOE_SETUP_LOG_OWNER=$$
  MOE_SETUP_T0=$(moe_now_us)
  export MOE_SETUP_LOG MOE_SETUP_LOG_OWNER MOE_SETUP_T0
  printf '# moe setup log, %s, %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$PWD" >>"$MOE_SETUP_LOG"
}

# The log's path as shown on the screen (relative to the current directory when below it).
moe_log_shown() {
  case $MOE_SETUP_LOG in
    "$PWD"/*) printf '%s' "${MOE_SETUP_LOG#"$PWD"/}" ;;
    *) printf '%s' "$MOE_SETUP_LOG" ;;
  esac
}

moe_verbose() { [ "${MOE_VERBOSE:-0}" = 1 ]; }

# Terminal width for the progress line that rewrites itself (stdout a terminal only).
moe_cols() {
  local c
  c=$(tput cols 2>/dev/null) || c=
  [ -n "$c" ] && [ "$c" -gt 20 ] 2>/dev/null || c=${COLUMNS:-100}
  echo "$c"
}

# Progress filters: read a phase's output on stdin, append every line to the log (and show it
# under MOE_VERBOSE=1), and show a compact progress line: rewritten in place on a terminal,
# otherwise one line per 10% step.
_moe_progress_show() {  # _moe_progress_show PERCENT TEXT
  local pct=$1 text=$2
  if [ -t 1 ]; then
    local line="[moe]   $text"
    [ -n "${_moe_progress_cols:-}" ] || _moe_progress_cols=$(moe_cols)
    [ ${#line} -lt "$_moe_progress_cols" ] || line="${line:0:$((_moe_progress_cols - 4))}..."
    printf '\r\033[K%s' "$line"
    _moe_progress_open=1
  elif [ $((pct / 10)) -ne "${_moe_progress_bucket:--1}" ]; then
    _moe_progress_bucket=$((pct / 10))
    printf '[moe]   %s\n' "$text"
  fi
}

_moe_progress_end() {
  if [ -n "${_moe_progress_open:-}" ]; then printf '\r\033[K'; fi
}

# Any output: the log only.
moe_filter_log() {
  if moe_verbose; then
    tee -a "$MOE_SETUP_LOG"
  else
    cat >>"$MOE_SETUP_LOG"
  fi
}

# CMake's build output (Makefiles "[ 42%] ..." or Ninja "[12/57] ..." lines).
moe_filter_build() {
  local line pct step what
  exec 3>>"$MOE_SETUP_LOG"
  while IFS= read -r line; do
    printf '%s\n' "$line" >&3
    if moe_verbose; then
      printf '%s\n' "$line"
      continue
    fi
    if [[ $line =~ ^\[\ *([0-9]+)%\]\ (.*)$ ]]; then
      pct=$((10#${BASH_REMATCH[1]}))
      step=$(printf '%3d%%' "$pct")
      what=${BASH_REMATCH[2]}
    elif [[ $line =~ ^\[([0-9]+)/([0-9]+)\]\ (.*)$ ]]; then
      pct=$((100 * 10#${BASH_REMATCH[1]} / 10#${BASH_REMATCH[2]}))
      step="step ${BASH_REMATCH[1]} of ${BASH_REMATCH[2]}, $(printf '%d%%' "$pct")"
      what=${BASH_REMATCH[3]}
    else
      continue
    fi
    case $what in
      "Building "*" object "*)
        # tests/CMakeFiles/moe_unit_tests.dir/unit/test_gmm.cpp.o -> moe_unit_tests: unit/test_gmm.cpp
        what=${what#Building * object }
        if [[ $what =~ CMakeFiles/([^/]+)\.dir/(.*)\.o$ ]]; then
          what="compiling ${BASH_REMATCH[1]}: ${BASH_REMATCH[2]}"
        else
          what="compiling $what"
        fi
        ;;
      "Linking "*) what="linking ${what##* }" ;;
      "Built target "*) what="built ${what#Built target }" ;;
    esac
    _moe_progress_show "$pct" "[$step] $what"
  done
  _moe_progress_end
}

# apt-get's status lines (APT::Status-Fd): "dlstatus:3:41.2:Retrieving file 3 of 80" and
# "pmstatus:libfoo:57.0:Installing libfoo".
moe_filter_apt() {
  local line kind pct msg
  exec 3>>"$MOE_SETUP_LOG"
  while IFS= read -r line; do
    printf '%s\n' "$line" >&3
    [[ $line =~ ^(dl|pm)status:.*:([0-9]+)(\.[0-9]*)?:(.*)$ ]] || continue
    kind=${BASH_REMATCH[1]}
    pct=$((10#${BASH_REMATCH[2]}))
    msg=${BASH_REMATCH[4]}
    if [ "$kind" = dl ]; then
      _moe_progress_show "$pct" "downloading: $(printf '%3d%%' "$pct") ($msg)"
    else
      # restart the 10% steps when dpkg starts (the downloads reached 100%)
      if [ "${_moe_apt_kind:-}" != pm ]; then _moe_progress_bucket=-1; _moe_apt_kind=pm; fi
      _moe_progress_show "$pct" "unpacking and setting up: $(printf '%3d%%' "$pct") ($msg)"
    fi
  done
  _moe_progress_end
}

# moe_phase TITLE [--filter FN] CMD [ARG...]: prints "[moe] TITLE", runs CMD (a command or a
# function) with its stdout and stderr through FN (default: into the log), then its time. On
# failure prints the log's tail and path on stderr and exits with CMD's status.
moe_phase() {
  local title=$1 filter=moe_filter_log
  shift
  if [ "${1:-}" = --filter ]; then
    filter=$2
    shift 2
  fi
  moe_say "$title"
  printf '\n==== [moe] %s\n==== $ %s\n' "$title" "$(moe_quote "$@")" >>"$MOE_SETUP_LOG"
  local start lines rc errexit_was=0
  start=$(moe_now_us)
  lines=$(wc -l <"$MOE_SETUP_LOG")
  [[ -o errexit ]] && errexit_was=1
  set +e
  "$@" </dev/null 2>&1 | "$filter"
  rc=${PIPESTATUS[0]}
  [ "$errexit_was" = 0 ] || set -e
  local took
  took=$(moe_span $(($(moe_now_us) - start)))
  if [ "$rc" -ne 0 ]; then
    printf '==== [moe] failed (exit %d) after %s\n' "$rc" "$took" >>"$MOE_SETUP_LOG"
    moe_fail "$title failed (exit $rc) after $took"
    exit "$rc"
  fi
  local warnings
  warnings=$(tail -n +"$((lines + 1))" "$MOE_SETUP_LOG" | grep -c ': warning:' || true)
  printf '==== [moe] done in %s\n' "$took" >>"$MOE_SETUP_LOG"
  if [ "${warnings:-0}" -gt 0 ]; then
    moe_say "  done in $took ($warnings compiler warnings, see $(moe_log_shown))"
  else
    moe_say "  done in $took"
  fi
}

# moe_fail MESSAGE: the message, the log's last lines and its path, on stderr.
moe_fail() {
  {
    moe_say "ERROR: $1"
    if [ -s "$MOE_SETUP_LOG" ]; then
      moe_say "last $MOE_TAIL_LINES lines of $(moe_log_shown):"
      tail -n "$MOE_TAIL_LINES" "$MOE_SETUP_LOG" | sed 's/^/    /'
    fi
    moe_say "full log: $MOE_SETUP_LOG"
  } >&2
}

# Time since the log was started (the whole chain of scripts).
moe_elapsed() { moe_span $(($(moe_now_us) - MOE_SETUP_T0)); }
