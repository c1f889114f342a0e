# Sourced by the setup scripts: apt_ensure WHAT PKG... installs the Debian packages among
# PKG that are not installed yet (one apt-get update first, only when any is missing).
apt_ensure() {
  local what=$1; shift
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== apt: installing ${what}${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}
