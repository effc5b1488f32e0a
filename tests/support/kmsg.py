"""The guest's kernel log as the VM tier judges it (tests/vm/conftest.py).

`KernelLog` reads /dev/kmsg from where it was opened, record by record, and
keeps the lines that fail the tier (`BAD`); the tier reads it after every
test, so that each line is told with the test it followed, and once more at
the session's end.
"""

from __future__ import annotations

import os
import re

KMSG = "/dev/kmsg"

# What fails the tier when the kernel prints it. panic_on_warn and oops=panic
# stop the guest on a WARN or an oops, but not on a pr_err: nvsim's "N backing
# pages leaked" (kmod/nvsim/mmap.c), a BUG: report that returns (sleeping in
# atomic context, a workqueue leaked lock), or the debug kernel's checkers
# (make test-debug: KASAN, lockdep, kmemleak; scripts/test-debug greps the
# same reports on the host).
BAD = re.compile(
    r"BUG:|WARNING:|kernel BUG at|Oops|general protection fault|Kernel panic"
    r"|KASAN|UBSAN|possible circular locking|possible recursive locking"
    r"|inconsistent lock state|suspicious RCU usage|held lock freed"
    r"|unreferenced object|suspected memory leak|leaked"
)


class KernelLog:
    """/dev/kmsg, read non-blocking from its end at open: the records since."""

    def __init__(self) -> None:
        self.fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)
        self.records = 0
        # Records the ring buffer overwrote before they were read: unjudged.
        self.lost = 0
        self._seq: int | None = None

    def read(self) -> list[str]:
        """The lines written since the last read that match BAD, as dmesg shows them."""
        bad: list[str] = []
        while True:
            try:
                rec = os.read(self.fd, 8192)
            except BlockingIOError:
                return bad
            except BrokenPipeError:
                # Overwritten; the next read is the oldest record kept, and
                # the gap in sequence numbers says how many were lost.
                if self._seq is None:
                    self.lost += 1
                continue
            if not rec:
                return bad
            # "prio,seq,usec,flags[,...];text\n" then " KEY=value" lines.
            head, _, text = rec.decode(errors="replace").partition(";")
            fields = head.split(",")
            seq = int(fields[1])
            if self._seq is not None and seq > self._seq + 1:
                self.lost += seq - self._seq - 1
            self._seq = seq
            self.records += 1
            line = text.split("\n", 1)[0]
            if BAD.search(line):
                usec = int(fields[2])
                bad.append(f"[{usec // 1_000_000:5d}.{usec % 1_000_000:06d}] {line}")

    def close(self) -> None:
        os.close(self.fd)
