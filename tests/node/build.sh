#!/usr/bin/env bash
# Builds the node side of the test cluster: kubelet, kube-scheduler and
# kube-controller-manager from the same upstream Kubernetes release as the
# test API server (tests/controlplane), plus the pod sandbox ("pause") binary
# from that release's own C source. Prints ONLY the directory that holds them
# on stdout; progress goes to stderr.
#
# Cached under ${EDGEFLEET_CACHE_DIR:-$HOME/.cache/edgefleet}/node/<sha256>/,
# where <sha256> covers go.mod, go.sum, this script and the Go toolchain, so a
# second call returns at once. Concurrent callers are serialised with flock.
#
# Needs Go (>= the version in go.mod), the Go module proxy and a C compiler.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
CC="${CC:-cc}"
bins=(kubelet kube-scheduler kube-controller-manager pause)

hash="$(
	{
		"$GO" env GOVERSION GOOS GOARCH
		cat build.sh go.mod go.sum
	} | sha256sum | cut -d' ' -f1
)"
out_dir="${EDGEFLEET_CACHE_DIR:-$HOME/.cache/edgefleet}/node/$hash"

built() {
	for b in "${bins[@]}"; do [[ -x "$out_dir/$b" ]] || return 1; done
}
if built; then
	echo "$out_dir"
	exit 0
fi

mkdir -p "$out_dir"
exec 9>"$out_dir.lock"
flock 9
if built; then
	echo "$out_dir"
	exit 0
fi

k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' go.mod)"
k8s_minor="$(echo "$k8s_version" | cut -d. -f2)"
echo "build.sh: building kubelet, kube-scheduler, kube-controller-manager $k8s_version (a cold build takes several minutes)" >&2
start=$(date +%s)

# Report the real version (the kubelet's Node shows it as kubeletVersion).
vpkg=k8s.io/component-base/version
ldflags="-s -w -X $vpkg.gitVersion=$k8s_version -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$k8s_minor"
ldflags+=" -X $vpkg.gitTreeState=clean -X $vpkg.gitCommit="

tmp="$(mktemp -d "$out_dir/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
GOFLAGS=-buildvcs=false CGO_ENABLED=0 "$GO" build -mod=readonly -trimpath -ldflags="$ldflags" \
	-o "$tmp/" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler \
	k8s.io/kubernetes/cmd/kube-controller-manager >&2

# The sandbox image's only binary: upstream's pause.c, linked statically so
# the image needs nothing else.
k8s_src="$(GOFLAGS=-mod=readonly "$GO" list -m -f '{{.Dir}}' k8s.io/kubernetes)"
"$CC" -Os -static -Wall -Werror -DVERSION="$k8s_version" -o "$tmp/pause" \
	"$k8s_src/build/pause/linux/pause.c" >&2

for b in "${bins[@]}"; do
	mv -f "$tmp/$b" "$out_dir/$b"
done
echo "build.sh: built ${bins[*]} in $(($(date +%s) - start))s" >&2
echo "$out_dir"
