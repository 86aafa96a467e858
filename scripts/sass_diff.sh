#!/usr/bin/env bash
# Does a refactor change the GPU code? Compiles one CUDA translation unit at two commits with the
# cuda preset's own compile command (build/cuda/compile_commands.json, without -g / -lineinfo) and
# compares the SASS instructions of every kernel (addresses and line comments stripped). Runs on a
# machine without a GPU: what cannot be re-run on the device can still be shown to be the same code.
#
#   scripts/sass_diff.sh OLD_REV src/ops/<op>/<file>.cu [NEW_REV]   (NEW_REV: the working tree)
# SASS_DIFF_SHOW=N also prints the first N lines of each differing kernel's unified diff;
# SASS_DIFF_RENAMED="OLD=NEW,..." compares kernels the change renamed (name substrings).
#
# Needs a configured cuda preset (cmake --preset cuda) and cuobjdump (CUOBJDUMP, default: on PATH
# or in the CUDA toolkit's bin). Exit status 0 when the instructions are identical, 1 when they
# differ or a kernel exists on one side only (each is listed), 2 on a usage or build error.
set -u -o pipefail
OLD=${1:?old revision}
FILE=${2:?translation unit, relative to the repository root}
NEW=${3:-}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CC_JSON="$ROOT/build/cuda/compile_commands.json"
[ -f "$CC_JSON" ] || { echo "no $CC_JSON: run cmake --preset cuda first" >&2; exit 2; }
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
[ -x "$CUOBJDUMP" ] || { echo "cuobjdump not found (set CUOBJDUMP)" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$WORK/old" >/dev/null 2>&1; [ -n "$NEW" ] && git -C "$ROOT" worktree remove --force "$WORK/new" >/dev/null 2>&1; rm -rf "$WORK"' EXIT
git -C "$ROOT" worktree add --detach -q "$WORK/old" "$OLD" || exit 2
NEWROOT="$ROOT"
if [ -n "$NEW" ]; then
  git -C "$ROOT" worktree add --detach -q "$WORK/new" "$NEW" || exit 2
  NEWROOT="$WORK/new"
fi
CMD=$(python3 - "$CC_JSON" "$FILE" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1])):
    if c["file"].endswith("/" + sys.argv[2]):
        print(c["command"])
        break
else:
    sys.exit(f"{sys.argv[2]} is not in {sys.argv[1]}")
PY
) || exit 2
sass() {  # sass SOURCE_ROOT OUT_TXT
  local cmd
  cmd=$(sed -e "s# -lineinfo##; s# -g # #" -e "s#-I$ROOT/include#-I$1/include#; s#-I$ROOT/src#-I$1/src#" \
        -e "s#-c [^ ]*$FILE -o [^ ]*#-c $1/$FILE -o $WORK/tu.o#" <<<"$CMD")
  (cd "$WORK" && eval "$cmd") || return 2
  # (a unit without kernels has no lines to keep: not an error)
  "$CUOBJDUMP" -sass "$WORK/tu.o" | { grep -E '^\s+/\*[0-9a-f]{4,}\*/|Function :' || true; } |
    sed -E 's#/\*[0-9a-f]{4,}\*/##; s#;\s*/\*.*\*/##; s#\s+# #g' >"$2"
}
sass "$WORK/old" "$WORK/old.txt" || exit 2
sass "$NEWROOT" "$WORK/new.txt" || exit 2
echo "$FILE: $OLD $(grep -c 'Function' "$WORK/old.txt") kernels, ${NEW:-working tree} $(grep -c 'Function' "$WORK/new.txt") kernels"
# Kernel by kernel, matched by name: the anonymous namespace's per-compilation hash is dropped from
# the names, and kernels only one side has (added or removed code) are listed, not diffed.
python3 - "$WORK/old.txt" "$WORK/new.txt" "${SASS_DIFF_SHOW:-}" "${SASS_DIFF_RENAMED:-}" <<'PY'
import re, sys
def kernels(path):
    out, name = {}, None
    for line in open(path):
        if "Function :" in line:
            name = re.sub(r"_GLOBAL__N__[0-9a-f]{8}_\d+_\w+?_[0-9a-f]{8}(?:_\d+(?=_))?", "_GLOBAL__N_", line.split("Function :")[1].strip())
            # The short form "<len>_GLOBAL__N__<digits><len><name>" (hash and name length run
            # together): drop every digit up to the name.
            name = re.sub(r"\d+_GLOBAL__N__\d+", "_GLOBAL__N_", name)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out
old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
show = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else 0
# SASS_DIFF_RENAMED="OLD_SUBSTRING=NEW_SUBSTRING,...": a kernel renamed by the change is compared
# under its old name (the first old kernel containing OLD_SUBSTRING, the first new one NEW_...).
for pair in filter(None, (sys.argv[4] if len(sys.argv) > 4 else "").split(",")):
    a, b = pair.split("=", 1)
    ko = next((k for k in sorted(old) if a in k), None)
    kn = next((k for k in sorted(new) if b in k and k not in old), None)
    if ko is not None and kn is not None:
        print(f"renamed: {kn} compared as {ko}")
        new[ko] = new.pop(kn)
only_old = sorted(set(old) - set(new)); only_new = sorted(set(new) - set(old))
differ = sorted(k for k in set(old) & set(new) if old[k] != new[k])
same = len(set(old) & set(new)) - len(differ)
for k in only_old: print("only in old:", k)
for k in only_new: print("only in new:", k)
for k in differ:
    print("differs:", k, f"({len(old[k])} -> {len(new[k])} instructions)")
    if show:  # SASS_DIFF_SHOW=N: the first N lines of each differing kernel's unified diff
        import difflib
        d = list(difflib.unified_diff(old[k], new[k], "old", "new", n=1, lineterm=""))
        print("".join(l if l.endswith("\n") else l + "\n" for l in d[:show]), end="")
print(f"{same} kernels with identical SASS instructions, {len(differ)} differ")
sys.exit(1 if differ or only_old or only_new else 0)
PY
