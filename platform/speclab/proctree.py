"""Stopping exactly the processes a command started, never by name: a process group led
by a ``Popen(start_new_session=True)`` and every descendant seen so far, in or out of
that group (Ray puts each worker in a group of its own; job drivers get their own
session). Linux ``/proc`` only; no Ray, no MLflow."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time


def proc_table() -> dict[int, tuple[int, int, str, int]]:
    """pid -> (ppid, pgid, state, start time) of every process, read from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(name)] = (int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    return table


class ProcessTree:
    """What ``proc`` started: the process group it leads (Popen(start_new_session=True)
    makes pgid == pid) and every descendant seen so far, in or out of that group (Ray
    puts each worker in a group of its own; job drivers get their own session).
    Processes are known by (pid, start time), so a reused pid is never signalled."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.pgid = proc, proc.pid
        self.known: dict[int, int] = {}
        self.group_seen_empty = False
        self._watching = True

    def scan(self) -> dict[int, int]:
        """The live processes of the tree now (pid -> start time), zombies excluded."""
        self.proc.poll()  # reap the leader once it exits
        table = proc_table()
        live = {pid: start for pid, (_, pgid, state, start) in table.items()
                if state != "Z" and (self.known.get(pid) == start or (
                    pgid == self.pgid and not self.group_seen_empty))}
        grown = True
        while grown:  # descendants of anything in the tree (before they are orphaned)
            grown = False
            for pid, (ppid, _, state, start) in table.items():
                if state != "Z" and pid not in live and ppid in live:
                    live[pid] = start
                    grown = True
        if not any(table[p][1] == self.pgid for p in live):
            self.group_seen_empty = True  # its pgid may be reused from now on
        self.known.update(live)
        return live

    def watch(self, every: float = 0.5) -> None:
        """Scan until the leader exits or :meth:`stop_watching` (run in a thread), so
        descendants are known even if their parents are gone by the time we stop them."""
        while self._watching and self.proc.poll() is None:
            self.scan()
            time.sleep(every)

    def stop_watching(self, thread: threading.Thread) -> None:
        self._watching = False
        thread.join()

    def signal(self, sig: int) -> None:
        live = self.scan()
        if not self.group_seen_empty:
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
        table = proc_table()
        for pid, start in live.items():
            if table.get(pid, (0, 0, "", -1))[3] == start:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float) -> dict[int, int]:
        deadline = time.time() + timeout
        live = self.scan()
        while live and time.time() < deadline:
            time.sleep(0.2)
            live = self.scan()
        return live


def stop_process_tree(proc: subprocess.Popen, grace: float = 30,
                      leader_grace: float = 0, tree: ProcessTree | None = None) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``) and everything it started.

    With ``leader_grace``, first SIGTERM only ``proc`` and give it that long to shut down
    its own children; then SIGTERM the whole tree, wait ``grace`` s, SIGKILL what is left.
    ``tree``: a :class:`ProcessTree` that has been watching ``proc`` (knows orphaned workers).
    Raises AssertionError if anything survives that."""
    tree = tree or ProcessTree(proc)
    if not tree.scan():
        return
    if leader_grace and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + leader_grace
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
            tree.scan()  # keep track of its children while it stops them
    tree.signal(signal.SIGTERM)
    if tree.wait(grace):
        tree.signal(signal.SIGKILL)
    left = tree.wait(10)
    assert not left, "processes survived SIGKILL: " + ", ".join(
        f"{pid} {cmdline(pid)}" for pid in left)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"
