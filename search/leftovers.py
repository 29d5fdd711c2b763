"""What a killed search leaves running: the processes of its private Ray session.

A search started without `--address` runs its own Ray in a private temp dir
(`runner.ray_session`). When its driver is killed with `kill -9`, Ray's head processes
die with it, but some of its agents and workers (`ray::DashboardAgent`,
`ray::RuntimeEnvAgent`, trial workers) are re-parented to init and live on; they ignore
SIGTERM. Their command lines are rewritten (`ray::...`) and their environment is
overwritten by setproctitle, so they are found by what they still hold: open files
(their logs) inside the session's temp dir. A session is dead when the driver recorded
in `driver.json` there no longer runs; the next search on this machine, new or resumed,
kills what is left of it (SIGKILL) before it starts its own Ray.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

DRIVER_FILE = "driver.json"


def process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None where there is none
    (or it is a zombie, or this system has no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces: fields start after it
    if fields[0] == "Z":
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def record_driver(session_dir: Path) -> None:
    """Write this process into the session dir as the driver that owns it."""
    me = os.getpid()
    (session_dir / DRIVER_FILE).write_text(json.dumps({"pid": me, "started": process_start(me)}) + "\n")


def driver_alive(session_dir: Path) -> bool | None:
    """Whether the driver that owns `session_dir` still runs; None when no driver is recorded."""
    try:
        driver = json.loads((session_dir / DRIVER_FILE).read_text())
        pid, started = int(driver["pid"]), driver["started"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = process_start(pid)
    # The same pid and start time: that process. A pid given to a later process is not it.
    return now is not None and (started is None or abs(now - float(started)) < 1.0)


def session_processes(session_dir: Path) -> list[tuple[int, float]]:
    """(pid, start time) of every process of this user that holds a file open, or has its
    working directory, inside `session_dir`; this process excluded."""
    prefix = str(session_dir.resolve()) + os.sep
    found: list[tuple[int, float]] = []
    if not Path("/proc").is_dir():  # no way to tell here (not Linux): leave every process alone
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            links = [os.readlink(entry / "cwd")]
            links += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:  # gone, or another user's
            continue
        if any(link.startswith(prefix) for link in links):
            started = process_start(int(entry.name))
            if started is not None:
                found.append((int(entry.name), started))
    return found


# After a round of kills, how long to wait before looking again: a process that was being
# started when the session was scanned opens its files inside it only a moment later.
RESCAN_AFTER_S = 0.2


def kill_session_processes(session_dir: Path, wait_s: float = 10.0) -> list[int]:
    """SIGKILL every process of a dead session (they ignore SIGTERM) and wait until they
    are gone, looking again until two looks `RESCAN_AFTER_S` apart find none (or `wait_s`
    has passed); returns their pids. A pid whose process changed meanwhile is left alone."""
    deadline = time.time() + wait_s
    killed: list[int] = []
    quiet_looks = 0
    while time.time() < deadline:
        victims = session_processes(session_dir)
        if not victims:
            quiet_looks += 1
            if quiet_looks == 2:
                break
        else:
            quiet_looks = 0
            for pid, started in victims:
                if process_start(pid) == started:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            killed += [pid for pid, _ in victims if pid not in killed]
            while time.time() < deadline and any(process_start(pid) == started for pid, started in victims):
                time.sleep(0.05)
        time.sleep(RESCAN_AFTER_S)
    return killed
