#!/usr/bin/env bash
# Builds a minimal OCI image archive with umoci (Debian: apt install umoci):
# the given files at their own absolute paths (or SRC=DEST: SRC at DEST),
# plus the shared libraries a dynamically linked one needs (from ldd), and
# nothing else: no shell, no package manager.
#
#   deploy/image/build.sh OUT.tar NAME TAG USER ENTRYPOINT FILE|SRC=DEST...
#
# Load it on a node (K3s: `k3s ctr`; other containerd nodes: `ctr`):
#   ctr -n k8s.io images import --base-name NAME OUT.tar
# which gives the image NAME:TAG (the DaemonSet's `image:`).
set -euo pipefail

if (($# < 6)); then
	sed -n '2,12p' "$0" >&2
	exit 2
fi
out="$1" name="$2" tag="$3" user="$4" entrypoint="$5"
shift 5

command -v umoci >/dev/null || {
	echo "build.sh: umoci not found (apt-get install umoci)" >&2
	exit 1
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
umoci init --layout "$work/oci"
umoci new --image "$work/oci:$tag"
umoci unpack --image "$work/oci:$tag" "$work/bundle"
rootfs="$work/bundle/rootfs"

add() { # SRC [DEST]
	install -D -m "$(stat -L -c %a "$1")" "$1" "$rootfs${2:-$1}"
}
for file in "$@"; do
	dest=""
	if [[ "$file" == *=* ]]; then
		dest="${file#*=}" file="${file%%=*}"
	fi
	file="$(readlink -f "$file")"
	add "$file" "$dest"
	# ldd prints "lib => /path (addr)" and the loader as "/path (addr)";
	# a static binary makes it fail, and then there is nothing to add.
	for lib in $(ldd "$file" 2>/dev/null | grep -o '/[^ ]*' || true); do
		[[ -e "$rootfs$lib" ]] || add "$lib"
	done
done

umoci repack --image "$work/oci:$tag" "$work/bundle"
umoci config --image "$work/oci:$tag" --author=edgefleet \
	--config.user="$user" --config.entrypoint="$entrypoint" \
	--config.label="org.opencontainers.image.title=$name"
umoci gc --layout "$work/oci"
mkdir -p "$(dirname "$out")"
tar -C "$work/oci" -cf "$out.tmp" .
mv -f "$out.tmp" "$out"
echo "build.sh: $name:$tag -> $out ($(du -h "$out" | cut -f1))" >&2
