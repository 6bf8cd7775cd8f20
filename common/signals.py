"""Which signals stop a process: SIGTERM always; SIGINT (Ctrl-C) unless it was ignored when the
process started, as it is in a child of `pdserve launch`, of deploy/launch.sh or of a bench (and in
anything a shell starts with `&` or `nohup`; Python itself keeps SIGINT ignored then).

A terminal's Ctrl-C goes to its whole foreground process group, the launcher's children with it.
A child that took it then took its launcher's SIGTERM as a second signal and left at once, without
draining what it held; a bench went on measuring a cluster whose processes had gone. Now only the
launcher takes Ctrl-C, and it stops each child once, in order. Run alone in a terminal, a process
stops on Ctrl-C as before."""

from __future__ import annotations

import signal

DRAIN_TIMEOUT_S = 5.0  # a worker told to stop finishes what it holds for up to this long (--drain-timeout)


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals this process stops on (install its handlers for these)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return (signal.SIGTERM,)
    return (signal.SIGTERM, signal.SIGINT)


def deaf_to_ctrl_c() -> None:
    """For a launcher's child, before it execs: its launcher takes Ctrl-C and stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
