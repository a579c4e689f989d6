#!/usr/bin/env bash
# Writes a help2man include file (--include) with one section per lorapipe-cli subcommand, taken from
# `lorapipe-cli <subcommand> --help`, so that the man page documents every option, not only the
# top-level list. Usage: man_subcommands.sh LORAPIPE_CLI OUT
set -euo pipefail
cli="$1"
out="$2"
subs=$("$cli" --help | awk '/^Subcommands:/{on=1; next} on && /^  [a-z]/{print $1}')
[ -n "$subs" ] || { echo "man_subcommands.sh: no subcommands found in $cli --help" >&2; exit 1; }
{
  echo "[SUBCOMMANDS]"
  for s in $subs; do
    echo ".SS $s"
    echo ".nf"
    # Usage lines name the build path of the program; the man page names the installed one. Escape
    # backslashes and leading dots for roff.
    "$cli" "$s" --help | sed -e "s|^Usage: [^ ]*lorapipe-cli|Usage: lorapipe-cli|" -e 's/\\/\\e/g' -e 's/^\./\\\&./'
    echo ".fi"
  done
  cat <<'TXT'
[FILES]
.TP
.I ~/.local/share/lorapipe/runs.db
The run database ($XDG_DATA_HOME/lorapipe/runs.db; $LORAPIPE_DB or run.database override it).
.TP
.I /usr/share/lorapipe/examples/
Example project files (copy one, then point model.path and data.train at your model and data).
[SEE ALSO]
.BR lorapipe (1)
TXT
} > "$out"
