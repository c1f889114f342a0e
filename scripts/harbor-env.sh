#!/usr/bin/env bash
# Builds, once per machine, the root filesystem scripts/harbor runs Harbor in: Debian trixie
# (Harbor needs Python >= 3.12; Debian 12 has 3.11) from this machine's own apt mirror, with
# Harbor and the E2B SDK in a venv at /opt/harbor. Idempotent: a stamp file makes a re-run a
# no-op. Run as root. Prints the root's path on success.
#
#   ${DSEC_DATA_DIR:-/var/lib/dsec}/harness/harbor-root      the root
#   .../harbor-root/.dsec-harbor-stamp                       what it was built with
#   .../harbor-root/.dsec-rootfs-ok                          the Debian part of that
set -euo pipefail

HARBOR_VERSION="0.26.0"
E2B_VERSION="2.63.0"
SUITE="trixie"
PACKAGES="python3,python3-venv,ca-certificates,git,tar,gzip"
ROOTFS_TEXT="suite=$SUITE packages=$PACKAGES"
STAMP_TEXT="$ROOTFS_TEXT harbor[e2b]==$HARBOR_VERSION e2b==$E2B_VERSION"

DATA_DIR="${DSEC_DATA_DIR:-/var/lib/dsec}"
HARNESS_DIR="$DATA_DIR/harness"
ROOT="$HARNESS_DIR/harbor-root"
STAMP="$ROOT/.dsec-harbor-stamp"

if [ "$(id -u)" != 0 ]; then
  echo "harbor-env.sh: run as root (mmdebstrap, chroot and mounts need it)" >&2
  exit 1
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ]; then
  echo "$ROOT"
  exit 0
fi

mkdir -p "$HARNESS_DIR"
exec 9>"$HARNESS_DIR/.harbor-root.lock"
flock 9
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ]; then   # built while we waited
  echo "$ROOT"
  exit 0
fi
started=$(date +%s)

# The host's apt sources, the same file dsec's base layers are built from
# (dsec.node.layers.base.host_apt_sources), with the host's release replaced by $SUITE.
host_sources=""
for cand in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
  if [ -f "$cand" ] && [ -s "$cand" ]; then host_sources="$cand"; break; fi
done
[ -n "$host_sources" ] || { echo "harbor-env.sh: no apt sources configured on this machine" >&2; exit 1; }
# shellcheck disable=SC1091
host_codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
[ -n "$host_codename" ] || { echo "harbor-env.sh: cannot tell the host's Debian release" >&2; exit 1; }

work="$(mktemp -d "$HARNESS_DIR/.harbor-build.XXXXXX")"
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

if [ "$(cat "$ROOT/.dsec-rootfs-ok" 2>/dev/null)" != "$ROOTFS_TEXT" ]; then
  echo "== harbor-env: building a Debian $SUITE root (mmdebstrap, from $host_sources)" >&2
  case "$host_sources" in
    *.sources) sources="$work/$SUITE.sources"
      # deb822: only the Suites: fields name releases (bookworm, bookworm-updates, bookworm-security)
      sed -E "/^Suites:/ s/\\b$host_codename\\b/$SUITE/g" \
        "$host_sources" >"$sources" ;;
    *) sources="$work/$SUITE.list"
      # one-line: "deb [opts] URI SUITE COMPONENTS..."
      sed -E "/^[[:space:]]*deb(-src)?[[:space:]]/ s/[[:space:]]$host_codename(-[a-z]+)?[[:space:]]/ $SUITE\1 /" \
        "$host_sources" >"$sources" ;;
  esac
  grep -q "$SUITE" "$sources" || { echo "harbor-env.sh: could not rewrite $host_sources for $SUITE" >&2; exit 1; }
  rm -rf --one-file-system "$ROOT" "$ROOT.new"
  # in a private mount namespace: the /proc, /sys and /dev mounts mmdebstrap makes in the
  # target go away with it, however it ends
  unshare --mount --propagation private --fork -- mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$SUITE" "$ROOT.new" "$sources"
  rm -f "$ROOT.new"/var/cache/apt/archives/*.deb "$ROOT.new"/var/lib/apt/lists/*_Packages* 2>/dev/null || true
  # the host's extra CAs (a TLS-intercepting egress proxy's, say), so pip and Harbor trust
  # what the host trusts
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    mkdir -p "$ROOT.new/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$ROOT.new/usr/local/share/ca-certificates/"
    chroot "$ROOT.new" update-ca-certificates >/dev/null 2>&1
  fi
  echo "$ROOTFS_TEXT" >"$ROOT.new/.dsec-rootfs-ok"
  mv "$ROOT.new" "$ROOT"
fi

# The host's pip configuration (config files and PIP_* environment, `pip config list`), as one
# /etc/pip.conf in the root: local paths and file:// URLs the root does not have are dropped,
# except the files cert/constraint/... point at, which are copied in.
host_pip=""
for p in python3 /usr/bin/python3; do
  if "$p" -m pip --version >/dev/null 2>&1; then host_pip="$p"; break; fi
done
pip_conf="$work/pip.conf"
if [ -n "$host_pip" ]; then
  "$host_pip" -m pip config list 2>/dev/null >"$work/pip-config-list" || true
else
  : >"$work/pip-config-list"
fi
python3 - "$ROOT" "$work/pip-config-list" "$pip_conf" <<'PY'
import ast, os, shutil, sys
root, listing, out = sys.argv[1:4]
FILE_KEYS = {"cert", "client-cert", "constraint", "requirement"}
DROP_KEYS = {"target", "prefix", "root", "src", "cache-dir", "log", "user"}
conf: dict[str, str] = {}
env: dict[str, str] = {}
for line in open(listing):
    line = line.strip()
    if "=" not in line:
        continue
    key, _, raw = line.partition("=")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw.strip("'\"")
    section, _, name = key.rpartition(".")
    if section == ":env:":
        env[name] = value
    elif section in ("global", "install", "download", "index", "wheel"):
        conf.setdefault(name, value) if section != "global" else conf.__setitem__(name, value)
conf.update(env)   # PIP_* variables win over files, as for pip itself
lines = ["[global]"]
for name, value in conf.items():
    if name in DROP_KEYS:
        continue
    if name in FILE_KEYS:
        inside = os.path.join(root, value.lstrip("/"))
        if os.path.isfile(value) and not os.path.exists(inside):
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            shutil.copy2(value, inside)
        if os.path.exists(inside):
            lines.append(f"{name} = {value}")
        continue
    kept = []
    for tok in value.split():
        path = tok[len("file://"):] if tok.startswith("file://") else tok if tok.startswith("/") else None
        if path is not None and not os.path.exists(os.path.join(root, path.lstrip("/"))):
            continue   # a local index or wheel dir of the host's, absent in the root
        kept.append(tok)
    if kept:
        lines.append(f"{name} = {' '.join(kept)}")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
PY
install -m 0644 "$pip_conf" "$ROOT/etc/pip.conf"

# DNS and the host's name table inside the root (scripts/harbor bind-mounts them too)
rm -f "$ROOT/etc/resolv.conf"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
cp -L /etc/hosts "$ROOT/etc/hosts"

echo "== harbor-env: pip install harbor[e2b]==$HARBOR_VERSION e2b==$E2B_VERSION into $ROOT/opt/harbor" >&2
proxy_env=()
for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY all_proxy ALL_PROXY; do
  [ -n "${!v:-}" ] && proxy_env+=("$v=${!v}")
done
# a private mount namespace: /proc and /dev for pip, gone when it exits
# shellcheck disable=SC2016  # the script below expands its own variables
unshare --mount --propagation private --fork -- /bin/bash -euo pipefail -c '
  root="$1"; shift
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  exec chroot "$root" /usr/bin/env -i "$@"
' harbor-env "$ROOT" HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 "${proxy_env[@]}" \
  /bin/sh -ec "
    [ -x /opt/harbor/bin/python ] || python3 -m venv /opt/harbor
    /opt/harbor/bin/pip install --quiet --no-cache-dir --disable-pip-version-check \
      'harbor[e2b]==$HARBOR_VERSION' 'e2b==$E2B_VERSION'
    /opt/harbor/bin/harbor --version >/dev/null
  "

echo "$STAMP_TEXT" >"$STAMP"
echo "== harbor-env: done in $(( $(date +%s) - started ))s" >&2
echo "$ROOT"
