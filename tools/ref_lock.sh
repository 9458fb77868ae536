# Sourced by tools/verl_ref.sh and tools/verifiers_ref.sh: one install of a reference at a time.
#
#   take_ref_lock DIR WANT   # holds DIR.lock on fd 9; prints DIR and exits the script if DIR holds WANT
#
# Why a lock: tools/test.sh starts each install in the background and its tests call the script again
# on first use; a second caller waits here for the first, then finds it installed.
take_ref_lock() {
  mkdir -p "$(dirname "$1")"
  exec 9>"$1.lock"
  flock 9
  if [ -f "$1/.installed" ] && [ "$(cat "$1/.installed")" = "$2" ]; then
    echo "$1"
    exit 0
  fi
}
