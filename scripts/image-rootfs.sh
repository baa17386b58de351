#!/bin/bash
# The root filesystem of a sidecar or operator image, and nothing else (the Dockerfile's
# final stages are `FROM scratch` plus this directory):
#
#   image-rootfs.sh DEST
#
# DEST gets the virtualenv /opt/lease-sidecar, the Python it was made with and the part
# of the standard library a server can import, the ODBC driver manager and driver if this
# build stage has them, the image user, and every shared library those load (found with
# ldd). No shell, package manager or other tool of the build stage goes in:
# both run on a read-only root and never install anything.
set -euo pipefail

dest=${1:?usage: image-rootfs.sh DEST}
venv=/opt/lease-sidecar
# Parts of the standard library neither image imports at run time: installers,
# IDEs, GUI toolkits, the test suite, the 2to3 converter and pydoc's topic index.
unused_stdlib=(ensurepip idlelib tkinter turtledemo test lib2to3 pydoc_data distutils)
# C modules for NIS, Berkeley DB, the interactive prompt and terminals: each alone pulls
# in a library (Kerberos and RPC, libdb, readline, ncurses).
unused_c_modules=(nis _dbm readline _curses _curses_panel)

# add PATH: copy PATH (file, directory or symlink) to the same place under DEST, with its
# parent directories resolved; a symlink brings what it points to as well.
add() {
  local dir path target
  dir=$(cd "$(dirname "$1")" && pwd -P)
  path="$dir/$(basename "$1")"
  [[ -e $dest$path || -L $dest$path ]] || cp -a --parents "$path" "$dest"
  if [[ -L $path ]]; then
    target=$(readlink "$path")
    [[ $target == /* ]] || target="$dir/$target"
    add "$target"
  fi
}

mkdir -p "$dest"
# Merged /usr: /lib64/ld-linux-x86-64.so.2, the programs' interpreter, is found through
# these links.
for link in /bin /lib /lib64 /sbin; do
  if [[ -L $link ]]; then cp -a "$link" "$dest/"; fi
done

# Python: the virtualenv, its interpreter (bin/python is a chain of links) and the
# standard library, byte-compiled once here (the root is read-only at run time, and a
# base image may ship the library without bytecode).
# pip and setuptools built the virtualenv; nothing runs them.
if [[ -x $venv/bin/pip ]]; then
  "$venv/bin/python" -m pip uninstall --quiet --yes pip setuptools
fi
add "$venv"
add "$venv/bin/python"
stdlib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
"$venv/bin/python" -m compileall -q -j0 \
  -x "/($(IFS='|'; echo "${unused_stdlib[*]}"))/" "$stdlib"
add "$stdlib"
for unused in "${unused_stdlib[@]}"; do rm -rf "${dest:?}$stdlib/$unused"; done
for unused in "${unused_c_modules[@]}"; do rm -f "$dest$stdlib/lib-dynload/$unused".*.so; done
# Links out of the library (Debian's sitecustomize.py lives in /etc).
while IFS= read -r link; do add "${link#"$dest"}"; done \
  < <(find "$dest$stdlib" -xtype l)

# TLS: OpenSSL's directory (links into /etc/ssl) and configuration. The CA bundle is
# not copied here: a build may mount its own over it for the duration of a RUN (to reach
# a package index), so the Dockerfile copies the image's own from this stage's layers.
for path in /usr/lib/ssl /etc/ssl/openssl.cnf; do
  if [[ -e $path ]]; then add "$path"; fi
done
install -d "$dest/etc/ssl/certs"

# SQL Server: unixODBC's registry of drivers, its query tool and each driver named there
# (a bare file name is looked up among the system's libraries), and glibc's character
# set converters, which the driver uses for the server's code page.
if command -v odbcinst > /dev/null; then
  add /etc/odbcinst.ini
  add /etc/odbc.ini
  add "$(command -v odbcinst)"
  while IFS= read -r driver; do
    if [[ $driver == /* ]]; then
      add "$driver"
    else
      while IFS= read -r found; do add "$found"; done < <(find /usr/lib -name "$driver")
    fi
  done < <(sed -n 's/^Driver *= *//p' /etc/odbcinst.ini)
  add "$(dirname "$(find /usr/lib -path '*/gconv/gconv-modules' -print -quit)")"
  # Microsoft's driver keeps its message catalogues beside its library.
  if [[ -d /opt/microsoft ]]; then add /opt/microsoft; fi
fi

# Every shared library of every program and extension module copied so far (ldd lists
# the whole closure), and the loader's cache of where they are.
# A library found beside its user (gconv's, through $ORIGIN) is in DEST already.
while IFS= read -r lib; do [[ $lib == "$dest"/* ]] || add "$lib"; done < <(
  find "$dest" -type f \( -perm -u+x -o -name '*.so*' \) -exec ldd {} + 2>/dev/null |
    awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' |
    sort -u)
for path in /etc/ld.so.conf /etc/ld.so.conf.d /etc/nsswitch.conf; do
  if [[ -e $path ]]; then add "$path"; fi
done
ldconfig -r "$dest"

# The image user (a fixed uid/gid, so runAsNonRoot can check it without a lookup), the
# leader file's directory (an emptyDir is mounted over it in a pod) and /tmp.
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nlease:x:10001:10001::/tmp:/usr/sbin/nologin\n' \
  > "$dest/etc/passwd"
printf 'root:x:0:\nlease:x:10001:\n' > "$dest/etc/group"
install -d -m 1777 "$dest/tmp"
install -d -o 10001 -g 10001 -m 0755 "$dest/run/lease"
