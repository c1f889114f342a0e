"""The shell side of SWE-ReX's sessions on dsec: the scripts the face sends to a
sandbox, and how their answers are read.

A SWE-ReX session is one of dsec's shell sessions (chronus, node/agent/sessions.py), named
``swerex-<name>``. dsec starts a session's shell on its first command, so "this session
was created" cannot be dsec's own state: ``create_session`` sets a (readonly, not
exported) flag in the shell, and every later script checks it first. A shell that never
saw ``create_session``, or one restarted after being killed, lacks the flag and answers
"missing" (then exits, so no stray shell is left). Keeping this in the shell keeps the
apiserver stateless: any replica serves any request, and an apiserver restart forgets
nothing.

Each script tells the face what happened on the command's stderr, in lines that start
with a per-request random nonce; the command's own stderr is folded into its stdout
(SWE-ReX's sessions run on a pty, where the two are one stream), so nothing the
command prints can be taken for a status line, and the nonce keeps a forged one from
matching. Scripts parse under bash and POSIX sh alike (a sandbox without bash gets sh
sessions, checked with sh -n).

Each session's shell records its pid under ``STATE_DIR``, so that an interrupt (which
must not queue behind the running command in the session) can reach what it runs from a
one-off process, and ``close`` can find every session.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import shlex
from dataclasses import dataclass

STATE_DIR = "/tmp/.dsec-swerex"
_LITERAL = re.compile(r"[A-Za-z0-9_.-]{1,48}\Z")


def session_name(name: str) -> str:
    """dsec's session name for SWE-ReX session ``name`` (dsec's names are 1-64 of
    [A-Za-z0-9_.-]; others are hashed, with a separator no literal name produces)."""
    if _LITERAL.match(name):
        return f"swerex-{name}"
    return "swerex_" + hashlib.sha256(name.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class Script:
    nonce: str
    text: str


def _nonce() -> str:
    return "dsecswx" + secrets.token_hex(12)


# A session's start: the flag; the pid for interrupts and close; the directory
# the sandbox's first session started in (its workdir), which a session created again
# returns to, since dsec restarts a killed session's shell where it last was.
_CREATE = """if [ "${__dsec_swerex-}" = 1 ]; then printf '%s exists\\n' @N@ >&2
else __dsec_swerex=1; readonly __dsec_swerex
  if [ -r @D@/home ]; then read -r __dsec_h < @D@/home && cd "$__dsec_h" 2>/dev/null; unset __dsec_h
  else mkdir -p @D@ 2>/dev/null && printf '%s\\n' "$PWD" > @D@/home 2>/dev/null; fi
  echo $$ > @D@/@S@.pid 2>/dev/null
  printf '%s created\\n' @N@ >&2
  @SOURCES@
fi
"""

# A command: its syntax checked without running it, then run in this shell (cd,
# exports and functions persist), its stderr folded into stdout. The check parses the
# command as the never-taken branch inside a function's body (no fork, and under the
# session's own shopts; a stray "fi" or "}" in a broken command is a parse error, not
# an escape into running code); only when that fails is bash -n asked, in a child, for
# the verdict and its message, so a form the body cannot hold (a here-document left
# open at the end) is not taken for an error. sh sessions ask sh -n: a syntax error
# inside eval would end a dash shell.
_RUN = """if [ "${__dsec_swerex-}" != 1 ]; then printf '%s missing\\n' @N@ >&2; exit 0; fi
__dsec_c=@C@
__dsec_bad=
if [ -n "${BASH_VERSION-}" ] && eval "__dsec_chk() { if false; then :
$__dsec_c
fi
}" 2>/dev/null; then :
elif ! __dsec_e=$(printf '%s\\n' "$__dsec_c" | "${BASH:-/bin/sh}" -n 2>&1); then __dsec_bad=1; fi
unset -f __dsec_chk 2>/dev/null
if [ -n "$__dsec_bad" ]; then printf '%s syntax\\n%s\\n%s end\\n' @N@ "$__dsec_e" @N@ >&2
else printf '%s run\\n' @N@ >&2; { eval "$__dsec_c"; } 2>&1; printf '%s done %d\\n' @N@ "$?" >&2
fi; unset __dsec_c __dsec_e __dsec_bad
"""


def create(name: str, sources: list[str]) -> Script:
    """Flag the shell as session ``name`` and source ``sources`` (each missing one
    reported in the output, as bash's ``source`` would, without ending an sh shell)."""
    n = _nonce()
    sourcing = "".join(
        f"if [ -r {shlex.quote(s)} ]; then . {shlex.quote(s)}; "
        f"else printf '%s: No such file or directory\\n' {shlex.quote(s)}; fi; " for s in sources)
    text = (_CREATE.replace("@S@", session_name(name)).replace("@D@", STATE_DIR).replace("@N@", n)
            .replace("@SOURCES@", f"{{ {sourcing}}} 2>&1" if sources else ":"))  # last: paths are the caller's
    return Script(n, text)


def run(command: str) -> Script:
    """Run ``command`` in the session (see _RUN)."""
    n = _nonce()
    return Script(n, _RUN.replace("@N@", n).replace("@C@", shlex.quote(command)))


def close(dsec_name: str) -> Script:
    """End the session from inside: its shell and everything it started (its process
    group: without job control, background jobs stay in it). From inside, because dsec
    then sees the shell end under a command and lets go of it; a shell killed from
    outside between commands would leave dsec writing its next command to a dead pipe."""
    n = _nonce()
    text = (  # the pid goes either way: after this, no shell of this name is a session
        f"rm -f {STATE_DIR}/{dsec_name}.pid\n"
        f'if [ "${{__dsec_swerex-}}" = 1 ]; then printf \'%s closed\\n\' {n} >&2; kill -KILL 0; fi\n'
        f"printf '%s missing\\n' {n} >&2; exit 0\n")
    return Script(n, text)


# A one-off process (never in the session: that would wait behind the command it is
# meant to stop): SIGINT to what the session's shell runs, as Ctrl-C would send. The
# shell has no terminal and no job control, so it cannot abandon the rest of a command
# line the way an interactive bash does; instead, commands the line goes on to start
# within the window get SIGINT too, and whatever still runs when the window closes gets
# SIGKILL. It ends early once nothing has run for two ticks. $1: dsec's session name,
# $2: the window in 50 ms ticks. Exits 3 when the session has no shell on record.
INTERRUPT = r"""
f=@DIR@/$1.pid
[ -r "$f" ] || exit 3
read -r top < "$f" || exit 3
case $top in ''|*[!0-9]*) exit 3;; esac
[ -d /proc/$top ] || exit 3
descendants() {
  seen=" $1 "; out=""; grew=1
  while [ $grew = 1 ]; do
    grew=0
    for s in /proc/[0-9]*/stat; do
      read -r l < "$s" 2>/dev/null || continue
      p=${l%% *}; r=${l##*) }
      set -- $r
      case "$seen" in *" $p "*) continue;; esac
      case "$seen" in *" $2 "*) seen="$seen$p "; out="$out $p"; grew=1;; esac
    done
  done
  echo $out
}
kids=$(descendants "$top")
[ -n "$kids" ] || exit 0
kill -INT $kids 2>/dev/null
hit=" $kids "; t=0; quiet=0
while [ $t -lt "$2" ]; do
  sleep 0.05; t=$((t + 1))
  now=$(descendants "$top")
  if [ -z "$now" ]; then
    quiet=$((quiet + 1)); [ $quiet -lt 2 ] || exit 0; continue
  fi
  quiet=0; new=""
  for p in $now; do case "$hit" in *" $p "*) ;; *) new="$new $p"; hit="$hit$p ";; esac; done
  [ -z "$new" ] || kill -INT $new 2>/dev/null
done
kill -KILL $(descendants "$top") 2>/dev/null
exit 0
""".replace("@DIR@", STATE_DIR)


@dataclass(frozen=True)
class Status:
    """What a script reported: its status words in order, the exit status of the
    command if it finished (``done``), and the syntax checker's message."""

    words: list[str]
    exit_code: int | None
    syntax_error: str | None

    def has(self, word: str) -> bool:
        return word in self.words


def status(stderr: str, nonce: str) -> Status:
    words: list[str] = []
    code: int | None = None
    syntax: str | None = None
    lines = stderr.split("\n")
    i = 0
    while i < len(lines):
        head, _, rest = lines[i].partition(" ")
        i += 1
        if head != nonce:
            continue
        word, _, arg = rest.partition(" ")
        words.append(word)
        if word == "done" and arg.lstrip("-").isdigit():
            code = int(arg)
        elif word == "syntax":
            body = []
            while i < len(lines) and lines[i] != f"{nonce} end":
                body.append(lines[i])
                i += 1
            syntax = "\n".join(body)
    return Status(words, code, syntax)
