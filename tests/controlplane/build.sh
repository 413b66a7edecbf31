#!/usr/bin/env bash
# Builds edgefleet-controlplane (kube-apiserver + embedded etcd, in-process)
# and prints ONLY the absolute path of the binary on stdout; progress goes to
# stderr.
#
# The binary is cached under
#   ${EDGEFLEET_CACHE_DIR:-$HOME/.cache/edgefleet}/controlplane/<sha256>/edgefleet-controlplane
# where <sha256> covers go.mod, go.sum, *.go, this script and the Go toolchain
# version, so a second call returns at once. Go's own module and build caches
# stay in their default places, so a rebuild after a source change is cheap
# too. Concurrent callers are serialised with flock(1); only one of them builds.
#
# Needs only Go (>= the version in go.mod) and access to the Go module proxy.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

GO="${GO:-$(command -v go || true)}"
if [[ -z "$GO" && -x /usr/local/go/bin/go ]]; then
	GO=/usr/local/go/bin/go
fi
if [[ -z "$GO" ]]; then
	echo "build.sh: no Go toolchain found (put go on PATH or set GO=/path/to/go)" >&2
	exit 1
fi

sha256() {
	if command -v sha256sum >/dev/null 2>&1; then
		sha256sum | cut -d' ' -f1
	else
		shasum -a 256 | cut -d' ' -f1
	fi
}

goversion="$("$GO" env GOVERSION GOOS GOARCH | tr '\n' ' ')"
hash="$(
	{
		echo "toolchain: $goversion"
		for f in build.sh go.mod go.sum $(LC_ALL=C ls -- *.go); do
			echo "== $f"
			cat -- "$f"
		done
	} | sha256
)"

cache_root="${EDGEFLEET_CACHE_DIR:-$HOME/.cache/edgefleet}/controlplane"
out_dir="$cache_root/$hash"
bin="$out_dir/edgefleet-controlplane"

if [[ -x "$bin" ]]; then
	echo "$bin"
	exit 0
fi

mkdir -p "$out_dir"
lock="$out_dir.lock"
if command -v flock >/dev/null 2>&1; then
	exec 9>"$lock"
	if ! flock -n 9; then
		echo "build.sh: another build of edgefleet-controlplane is running; waiting for it..." >&2
		flock 9
	fi
	# Somebody else may have finished the build while we waited.
	if [[ -x "$bin" ]]; then
		echo "$bin"
		exit 0
	fi
else
	echo "build.sh: flock not found; building without a lock" >&2
fi

k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' go.mod)"
k8s_minor="$(echo "$k8s_version" | cut -d. -f2)"
echo "build.sh: building kube-apiserver $k8s_version + embedded etcd with $goversion" >&2
echo "build.sh: (a cold build downloads modules and compiles Kubernetes: several minutes; with warm Go caches it only relinks)" >&2

# Report the real Kubernetes version on /version instead of v0.0.0-master.
vpkg=k8s.io/component-base/version
ldflags="-s -w"
ldflags+=" -X $vpkg.gitVersion=$k8s_version -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$k8s_minor"
ldflags+=" -X $vpkg.gitTreeState=clean -X $vpkg.gitCommit="

tmp="$(mktemp "$out_dir/.edgefleet-controlplane.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
start=$(date +%s)
# Note: -o must be a file (not a directory) and the result is moved into place
# atomically, so a reader never sees a half-written binary.
GOFLAGS=-buildvcs=false CGO_ENABLED=0 \
	"$GO" build -mod=readonly -trimpath -ldflags="$ldflags" -o "$tmp" . >&2
chmod 0755 "$tmp"
mv -f "$tmp" "$bin"
trap - EXIT
echo "build.sh: built $bin in $(($(date +%s) - start))s" >&2
echo "$bin"
