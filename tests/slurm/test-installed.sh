#!/usr/bin/env bash
# tests/slurm/test-installed.sh: the Slurm integration tests against the installed Debian
# packages (debian/: am and slurm-spank-am) instead of a build tree: test-spank.sh and
# test-jobs.sh with the plugin from Slurm's plugin directory, the programs from /usr/bin
# (am-launch runs the am-train beside it) and the recipes, model configs and templates from
# /usr/share/am. Each test starts its own private cluster (tests/slurm/cluster), as root.
#
# Skips (exit 77) when the packages are not installed, so that it is harmless anywhere; it is
# not part of `make check`. Run as root after installing the packages built from this tree:
#   dpkg-buildpackage -us -uc -b     (in a copy of the tree: it writes ../*.deb)
#   apt install ./am_*.deb ./slurm-spank-am_*.deb
#   tests/slurm/test-installed.sh
#   apt purge am slurm-spank-am
# Exits 0 when both tests pass, 1 when one fails.
set -uo pipefail

SRCDIR=${AM_SRCDIR:-$(cd "$(dirname "$0")/../.." && pwd)}
say() { printf 'test-installed: %s\n' "$*"; }

for pkg in am slurm-spank-am; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)
  [[ $status == "install ok installed" ]] ||
    { say "SKIP: the Debian package $pkg is not installed (apt install ./${pkg}_*.deb)"; exit 77; }
done
plugin=$(dpkg-query -L slurm-spank-am | grep '/spank_am\.so$' | head -n 1)
bindir=$(dirname "$(dpkg-query -L am | grep '/bin/am-plan$' | head -n 1)")
datadir=$(dpkg-query -L am | grep '/share/am$' | head -n 1)
[[ -f $plugin && -x $bindir/am-plan && -d $datadir/recipes ]] ||
  { say "FAIL: the packages do not hold spank_am.so, am-plan and share/am/recipes"; exit 1; }

installed=$(dpkg-query -W -f='${Version}' am)
tree=$(sed -n 's/^AC_INIT(\[am\], \[\([^]]*\)\].*/\1/p' "$SRCDIR/configure.ac")
[[ $installed == "$tree" ]] || say "warning: installed am $installed, this tree is $tree"
say "am $installed: plugin $plugin, programs in $bindir, data in $datadir"
"$bindir/am-launch" --version | sed 's/^/    /'

rc=0
# test-spank.sh: the plugin's cases, with the installed am-plan for the expected messages
AM_SRCDIR=$SRCDIR AM_BUILDDIR=$bindir AM_SPANK_PLUGIN_SO=$plugin AM_MODELS_DIR=$datadir/models \
  "$SRCDIR/tests/slurm/test-spank.sh" || { say "FAIL: test-spank.sh"; rc=1; }
# test-jobs.sh: jobs that train, with the installed programs first in PATH and the installed data
AM_SRCDIR=$SRCDIR AM_BUILDDIR=$bindir AM_SPANK_PLUGIN_SO=$plugin AM_INSTALLED_DATADIR=$datadir \
  "$SRCDIR/tests/slurm/test-jobs.sh" || { say "FAIL: test-jobs.sh"; rc=1; }
[[ $rc == 0 ]] && say "PASS: test-spank.sh and test-jobs.sh against the installed packages"
exit $rc
