#!/usr/bin/env bash
# The real data sets that come from Debian packages (docs/data.md); scripts/install.sh runs this.
#
#   Fashion-MNIST         apt-get install dataset-fashion-mnist  -> /usr/share/datasets/fashion-mnist/
#   Jane Austen's novels  apt-get download r-cran-janeaustenr, unpacked with dpkg -x (R itself is not
#                         installed)                             -> $REDSYNC_DATA_CACHE/janeaustenr/
#
#   REDSYNC_DATA_CACHE    where downloaded data sets are unpacked (default: ~/.cache/redsync_hvd/data)
#
# As root with apt-get, each is fetched once; a later run sees it there and says so. Elsewhere
# (not root, or no apt-get) it prints the command that gets it. It never fails the install: a run
# that needs a missing data set stops with the same command.
set -uo pipefail

DATA_CACHE="${REDSYNC_DATA_CACHE:-$HOME/.cache/redsync_hvd/data}"
FASHION=/usr/share/datasets/fashion-mnist
AUSTEN="$DATA_CACHE/janeaustenr"

say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
as_root_with_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && command -v dpkg >/dev/null; }
# apt's package lists may be missing (a fresh container): refresh them once, then try again
with_lists() { "$@" >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && "$@" >/dev/null 2>&1; }; }

fashion_mnist() {
  if [ -f "$FASHION/train-images-idx3-ubyte.gz" ]; then
    say "Fashion-MNIST: in $FASHION already (dataset-fashion-mnist)"
  elif ! as_root_with_apt; then
    say "Fashion-MNIST: not installed; data.name: fashion_mnist needs: sudo apt-get install dataset-fashion-mnist (or data.path=<folder with the idx files>)"
  elif DEBIAN_FRONTEND=noninteractive with_lists apt-get install -y -qq dataset-fashion-mnist; then
    say "Fashion-MNIST: apt-get install dataset-fashion-mnist -> $FASHION"
  else
    say "Fashion-MNIST: apt-get install dataset-fashion-mnist failed; data.name: fashion_mnist will stop until it is installed"
  fi
}

austen() {
  local tmp
  if [ -f "$AUSTEN/data/Rdata.rdb" ] && [ -f "$AUSTEN/data/Rdata.rdx" ]; then
    say "Jane Austen's novels: in $AUSTEN already (r-cran-janeaustenr)"
    return
  fi
  if ! as_root_with_apt; then
    say "Jane Austen's novels: not fetched (needs root and apt-get); data.name: austen needs: apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb x && mkdir -p $DATA_CACHE && cp -r x/usr/lib/R/site-library/janeaustenr $DATA_CACHE/"
    return
  fi
  tmp=$(mktemp -d)
  # apt-get download writes into the current folder; _apt may not read root's mktemp folder
  chmod 755 "$tmp"
  if (cd "$tmp" && with_lists apt-get download r-cran-janeaustenr) \
      && dpkg -x "$tmp"/r-cran-janeaustenr_*.deb "$tmp/x" \
      && [ -f "$tmp/x/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb" ] \
      && mkdir -p "$DATA_CACHE" && rm -rf "$AUSTEN" \
      && mv "$tmp/x/usr/lib/R/site-library/janeaustenr" "$AUSTEN"; then
    say "Jane Austen's novels: apt-get download r-cran-janeaustenr, dpkg -x -> $AUSTEN"
  else
    say "Jane Austen's novels: apt-get download r-cran-janeaustenr failed; data.name: austen will stop until it is in $AUSTEN"
  fi
  rm -rf "$tmp"
}

fashion_mnist
austen
exit 0
