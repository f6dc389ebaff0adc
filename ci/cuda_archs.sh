# Sourced by ci/build_wheel.sh (and the build tests): the accepted arch values, the check of an arch
# list, and the build tag that names a wheel's arches.
# Unset means the default, but an empty, unknown or malformed value is an error (CMakeLists.txt and the
# sdist's build backend, build_backend/prime_kernels_build.py, apply the same rule).
ACCEPTED_ARCHS="90a 100a 103a 100f"
check_archs() {
  local value=$1 a bad="" stripped
  stripped="${value//[[:space:]]/}"
  if [ -z "$stripped" ]; then bad="it is empty"; fi
  if [ -z "$bad" ]; then
    local IFS=';'
    # A trailing ';' would be dropped by read: append a sentinel so that "90a;" counts as malformed.
    local -a parts
    read -r -a parts <<<"${stripped};x"
    unset 'parts[${#parts[@]}-1]'
    [ "${#parts[@]}" -gt 0 ] || bad="it is empty"
    for a in "${parts[@]}"; do
      case " $ACCEPTED_ARCHS " in
        *" ${a%-real} "*) [ -n "$a" ] || { bad="it has an empty entry"; break; } ;;
        *) bad="'$a' cannot be built"; [ -n "$a" ] || bad="it has an empty entry"; break ;;
      esac
    done
  fi
  if [ -n "$bad" ]; then
    echo "error: PRIME_KERNELS_CUDA_ARCHS='$value': $bad. Accepted values: ${ACCEPTED_ARCHS// /, }" \
         "(';'-separated, e.g. PRIME_KERNELS_CUDA_ARCHS=\"90a;100a\")" >&2
    exit 2
  fi
}
# The wheel's build tag names its arches: the accepted values it holds, in the accepted order, joined by
# '_' ("90a;100a" -> prime_kernels_core-0.1.0-90a_100a-py3-none-....whl). CMake orders build_info()'s
# arches the same way.
arch_tag() {
  local stripped="${1//[[:space:]]/}" a tag=""
  local -a parts
  IFS=';' read -r -a parts <<<"$stripped"
  local joined=";${parts[*]%-real};"
  joined="${joined// /;}"
  for a in $ACCEPTED_ARCHS; do
    case "$joined" in *";$a;"*) tag="${tag:+${tag}_}$a" ;; esac
  done
  echo "$tag"
}
