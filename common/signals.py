"""Which signals stop a process: SIGTERM always; SIGINT (Ctrl-C) unless it was ignored when the
process started, as it is in a child of `pdserve launch`, of deploy/launch.sh or of a bench (and in
anything a shell starts with `&` or `nohup`; Python itself keeps SIGINT ignored then).

A terminal's Ctrl-C goes to its whole foreground process group, the launcher's children with it.
A child that took it then took its launcher's SIGTERM as a second signal and left at once, without
draining what it held; a bench went on measuring a cluster whose processes had gone. Now only the
launcher takes Ctrl-C, and it stops each child once, in order. Run alone in a terminal, a process
stops on Ctrl-C as before.

A process group's or a cgroup's SIGTERM (`kill -- -PGID`; systemd's stop, which signals every
process of the unit) reaches a launcher's children as well as the launcher, which then stops each
of them: two signals, the second of which stopped a draining child at once. StopSignals takes a
launcher's child's second signal within REPEAT_S of its first as the same stop."""

from __future__ import annotations

import signal
import time

DRAIN_TIMEOUT_S = 5.0  # a process told to stop finishes what it holds for up to this long (--drain-timeout)
REPEAT_S = 0.5  # a launcher's child: a signal this soon after the first is the same stop, sent twice


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals this process stops on (install its handlers for these)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return (signal.SIGTERM,)
    return (signal.SIGTERM, signal.SIGINT)


def deaf_to_ctrl_c() -> None:
    """For a launcher's child, before it execs: its launcher takes Ctrl-C and stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class StopSignals:
    """The stop signals a process has taken, as they count: the first drains, a second stops it at
    once. Make it before installing handlers for stop_signals()."""

    def __init__(self):
        self.count = 0
        self.first_at = 0.0
        self.launched = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a launcher's child (or `&`'s)

    def take(self) -> int:
        """Count a signal just taken; the count."""
        now = time.monotonic()
        if self.count == 1 and self.launched and now - self.first_at < REPEAT_S:
            return self.count  # the group's signal and its launcher's
        self.count += 1
        if self.count == 1:
            self.first_at = now
        return self.count
