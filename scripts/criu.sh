#!/usr/bin/env bash
# Builds CRIU (the container backend's live branch: checkpoint/restore of a running container's
# processes) into a fixed prefix, once. Debian 12's criu 3.17 cannot dump on recent kernels
# ("vdso: Unexpected rt vDSO area bounds"), so this builds the newer release from Debian
# trixie's source package, from the same mirror the machine's apt sources already name.
# Idempotent: skipped when the prefix already holds this build (BUILD names it). Run as root.
set -euo pipefail

PREFIX="${DSEC_CRIU_PREFIX:-/usr/local/lib/dsec/criu}"
SUITE=trixie
# what is built: the release (4.1 has the vDSO fix) and the patch on it; a prefix holding
# another build is rebuilt
PATCH="$(cd "$(dirname "$0")" && pwd)/criu-sockopts.patch"
BUILD="4.1.1 $(sha256sum "$PATCH" | cut -c1-12)"

if [ -x "$PREFIX/sbin/criu" ] && [ "$(cat "$PREFIX/BUILD" 2>/dev/null)" = "$BUILD" ]; then
  exit 0
fi

# the build's dependencies from Debian 12 (criu's own Build-Depends, less the docs and GPU plugins)
DEPS=(dpkg-dev patch gcc make pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
      python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libaio-dev libgnutls28-dev
      libnftables-dev uuid-dev)
. "$(dirname "$0")/apt.sh"
apt_ensure "CRIU's build dependencies: " "${DEPS[@]}"

# the Debian mirror this machine already uses (deb822 or one-line sources)
MIRROR=$(grep -hoE '^URIs:[[:space:]]*[^[:space:]]+/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null \
           | head -1 | awk '{print $2}')
if [ -z "$MIRROR" ]; then
  MIRROR=$(grep -hoE '^deb[[:space:]]+[^[:space:]]+/debian/?[[:space:]]' /etc/apt/sources.list 2>/dev/null \
             | head -1 | awk '{print $2}')
fi
[ -n "$MIRROR" ] || { echo "no Debian mirror in the apt sources" >&2; exit 1; }

WORK=$(mktemp -d /tmp/dsec-criu-build.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# a private apt state, so the machine's own sources and lists are left as they are
mkdir -p "$WORK/lists/partial" "$WORK/src"
echo "deb-src ${MIRROR%/} $SUITE main" > "$WORK/sources.list"
APT=(-o "Dir::Etc::SourceList=$WORK/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
     -o "Dir::State::Lists=$WORK/lists" -o "APT::Sandbox::User=root")
echo "== CRIU: fetching the $SUITE source package"
apt-get "${APT[@]}" update -qq
# the package's files, each checked against the signed index; some mirrors serve only the
# upstream tarball (no .dsc, no Debian diff): that builds the same binary, so it is enough
(cd "$WORK/src" && apt-get "${APT[@]}" source -qq criu >"$WORK/source.log" 2>&1) || true
SRC=$(find "$WORK/src" -maxdepth 1 -mindepth 1 -type d -name 'criu-*' | head -1)
if [ -z "$SRC" ]; then
  ORIG=$(find "$WORK/src" -maxdepth 1 -name 'criu_*.orig.tar.*' | head -1)
  [ -n "$ORIG" ] || { cat "$WORK/source.log" >&2; echo "CRIU's source package was not fetched" >&2; exit 1; }
  tar -xf "$ORIG" -C "$WORK/src"
  SRC=$(find "$WORK/src" -maxdepth 1 -mindepth 1 -type d -name 'criu-*' | head -1)
fi

patch -s -d "$SRC" -p1 < "$PATCH"
echo "== CRIU: building $(basename "$SRC") into $PREFIX"
# the criu binary only: no docs (asciidoc), no plugins, no python bindings
make -C "$SRC" -j"$(nproc)" criu >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; exit 1; }
install -D -m 0755 "$SRC/criu/criu" "$PREFIX/sbin/criu"
echo "$BUILD" > "$PREFIX/BUILD"
"$PREFIX/sbin/criu" --version
