"""`python -I -S common/log_tee.py LOG TAIL`: what launch.sh puts between a process and its log, so the reason a
process failed reaches the terminal even when its log cannot be written (the run folder's disk is full).

It reads the process's stdout+stderr (a pipe) until the end, appends it to LOG and keeps its last TAIL_LINES
lines in memory, copied after each read to the small file TAIL (launch.sh puts it in /dev/shm or
$XDG_RUNTIME_DIR, off the run folder's disk). A read that cannot be appended (ENOSPC, EIO, ...) is
truncated back out of LOG (whole lines only) and counted; TAIL.lost then says how much and why, and the
first append that works again starts with a line saying what is missing before it. launch.sh prints TAIL
(and TAIL.lost) when the process fails, instead of the log's last lines.

Stop signals are ignored: it ends when the pipe does (every writer gone), so the last lines of a process that
stops gracefully after a Ctrl-C are still written. Standard library only, started with -I -S: it costs one
short interpreter start per process.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import deque

TAIL_LINES = 20
MAX_LINE = 2000  # bytes kept of one line (the end of it): the tail stays small whatever the process prints
READ = 1 << 16


class Tee:
    def __init__(self, log: str, tail: str) -> None:
        self.log, self.tail = log, tail
        self.lines: deque[bytes] = deque(maxlen=TAIL_LINES)
        self.partial = b""
        self.fd: int | None = None
        self.lost_lines = self.lost_bytes = 0  # in all, this run
        self.missing = 0  # lines lost since the last append that worked
        self.reason = ""
        try:
            self._open()  # the log exists from the start, as with a plain redirection
        except OSError:
            pass  # tried again at each read, counted as lost while it fails

    def _open(self) -> int:
        if self.fd is None:
            self.fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self.fd

    def feed(self, chunk: bytes) -> None:
        self._append(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()[-MAX_LINE:]
        self.lines.extend(line[-MAX_LINE:] for line in lines)
        self._save()

    def end(self) -> None:
        if self.partial:
            self.lines.append(self.partial)
            self.partial = b""
        self._save()
        if self.fd is not None:
            os.close(self.fd)

    def _append(self, chunk: bytes) -> None:
        data = chunk
        if self.missing:
            data = (
                f"[log_tee] {self.missing} line(s) of this output could not be written here ({self.reason})\n".encode()
                + chunk
            )
        start = None
        try:
            fd = self._open()
            start = os.fstat(fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as err:
            if start is not None:
                try:
                    os.ftruncate(self.fd, start)
                except OSError:
                    pass
            n = max(1, chunk.count(b"\n"))
            self.lost_lines += n
            self.missing += n
            self.lost_bytes += len(chunk)
            self.reason = err.strerror or str(err)
            return
        self.missing = 0

    def _save(self) -> None:
        """TAIL (the last lines) and, once anything was lost, TAIL.lost; replaced whole, never half-written."""
        files = {self.tail: b"\n".join(self.lines) + (b"\n" if self.lines else b"")}
        if self.lost_lines:
            files[self.tail + ".lost"] = (
                f"{self.lost_lines} line(s) ({self.lost_bytes} bytes) of its output could not be written to"
                f" {self.log}: {self.reason}\n"
            ).encode()
        for path, data in files.items():
            try:
                with open(path + ".tmp", "wb") as f:
                    f.write(data)
                os.replace(path + ".tmp", path)
            except OSError:
                pass  # no tail then: launch.sh falls back to the log itself


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: log_tee.py LOG TAIL", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    tee = Tee(*argv)
    stdin = sys.stdin.fileno()
    while True:
        try:
            chunk = os.read(stdin, READ)
        except OSError:
            break
        if not chunk:
            break
        tee.feed(chunk)
    tee.end()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
