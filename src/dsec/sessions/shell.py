"""Stateful shell sessions without a long-lived shell: state is carried, not kept running.

Every command of a session is its own process tree, started like any command (so a
timeout, a signal or a kill ends that command only, output is streamed and capped the
same way, and an idle session costs no process and no agent memory). A small POSIX
wrapper makes it stateful: before the command it restores the session's working
directory, exported environment and umask from a state file inside the sandbox, and on
exit (also after ``exit N``) it writes them back. Everything uses shell built-ins, so a
session command costs what ``sh -c`` costs.

What carries over: ``cd``, ``export``/``unset`` of exported variables (so ``source
venv/bin/activate`` works for PATH), ``umask``. What does not: unexported variables,
functions, aliases, shell options; a command killed by a timeout or signal leaves the
state as it was before it.
"""

from __future__ import annotations

STATE_DIR = "/dev/shm"

# $1 = state file, $2 = the command. `export -p` quotes values so that the same shell
# can read them back; PWD is exported so it travels in the same file.
_SAVE = (
    "trap '__dsec_rc=$?; export PWD; "
    '{ export -p; printf "umask "; umask; printf "cd -- \\"\\$PWD\\" 2>/dev/null\\n"; } '
    '>"$__dsec_f" 2>/dev/null; exit $__dsec_rc\' EXIT; '
)
_RESTORE = '__dsec_f=$1; __dsec_c=$2; shift 2; [ -r "$__dsec_f" ] && . "$__dsec_f"; '
WRAPPER = _RESTORE + _SAVE + 'eval "$__dsec_c"'
#: For background commands: start from the session's state, never write it back (a
#: late exit would overwrite what later commands changed).
WRAPPER_NO_SAVE = _RESTORE + 'eval "$__dsec_c"'


def state_path(session_id: str) -> str:
    return f"{STATE_DIR}/.dsec-session-{session_id}"


def session_argv(session_id: str, command: str, *, save: bool = True) -> list[str]:
    """The argv that runs ``command`` in the session ``session_id``."""
    script = WRAPPER if save else WRAPPER_NO_SAVE
    return ["/bin/sh", "-c", script, "sh", state_path(session_id), command]
