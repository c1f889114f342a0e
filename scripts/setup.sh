#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for dsec, idempotently: system packages, the .venv
# with dsec installed, cgroups, dsec-init and the base layers. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

# fuse3 + libfuse3-dev + pkg-config: the node's lazy layer reader (pyfuse3 builds against libfuse3);
# moosefs-*: the distributed filesystem the shared layer store is tested on
# qemu-system-x86: the microVM and full-VM backends (the guest kernel is fetched by `dsec setup`)
# btrfs-progs: the sandbox volume (per-sandbox disk quotas as btrfs qgroups)
# postgresql-15: cluster metadata (dsec cluster up starts a private server when given no --db)
# chromium: the web console's browser tests (Playwright drives Debian's build; no browser download)
PKGS=(crun erofs-utils mmdebstrap busybox-static nftables iproute2 gcc libc6-dev util-linux procps psmisc
      docker-registry fuse3 libfuse3-dev pkg-config moosefs-master moosefs-chunkserver moosefs-client curl python3-dev
      qemu-system-x86 btrfs-progs postgresql-15 chromium)
. scripts/apt.sh
apt_ensure "" "${PKGS[@]}"

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import dsec, pytest, ruff" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.dsec-installed ]; then
  echo "== pip: installing dsec (with its services) and its dev tools into .venv"
  .venv/bin/pip install -q --disable-pip-version-check -e ".[server,cluster,dev]" 2>&1 | grep -v "^WARNING: Location" || true
  touch .venv/.dsec-installed
fi

# the E2B JS SDK for tests/test_e2b.py (node >= 18; Debian's nodejs/npm if the machine has none)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "== apt: installing nodejs npm"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
if [ ! -f tests/e2b_js/node_modules/e2b/package.json ] \
   || [ tests/e2b_js/package.json -nt tests/e2b_js/node_modules/e2b/package.json ]; then
  echo "== npm: installing the E2B JS SDK into tests/e2b_js"
  npm install --prefix tests/e2b_js --no-audit --no-fund --silent
fi

# the web console's browser libraries (preact, uPlot, xterm.js), served from node_modules: no CDN at run time
if [ ! -f src/dsec/control/console/node_modules/.package-lock.json ] \
   || [ src/dsec/control/console/package-lock.json -nt src/dsec/control/console/node_modules/.package-lock.json ]; then
  echo "== npm: installing the console's browser libraries into src/dsec/control/console"
  npm ci --prefix src/dsec/control/console --no-audit --no-fund --silent
fi

# CRIU for the container backend's live branch (built once from Debian trixie's source, ~20 s on 2 cores)
# (a failed build leaves the rest of the setup alone: only live branches of containers need it)
echo "== CRIU (built once into /usr/local/lib/dsec/criu)"
bash scripts/criu.sh || echo "WARNING: CRIU was not built: live branches of containers will say so (scripts/criu.sh)"

# the base layers, then FnCall's default toolchain layers (each built once; ~3 min the first
# time, from Debian, PyPI and npm; the on-demand ones: `dsec fncall toolchains build NAME`)
echo "== dsec setup (cgroups, dsec-init, base layers, FnCall toolchain layers)"
.venv/bin/dsec setup
echo "== Harbor for tests/test_harbor.py (a Debian trixie root with harbor[e2b]: Harbor needs Python >= 3.12)"; bash scripts/harbor-env.sh >/dev/null

DEMO_DIR="${DSEC_DATA_DIR:-/var/lib/dsec}/demo"
if [ ! -f "$DEMO_DIR/more-itertools-10.5.0.tar.gz" ]; then
  echo "== fetching the demo project (more-itertools 10.5.0 sdist)"
  mkdir -p "$DEMO_DIR"
  .venv/bin/pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$DEMO_DIR" "more-itertools==10.5.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
echo "== setup done"
