"""haru.host.procfs: the one reader of /proc/<pid>/stat (pid identity, parents, groups, zombies)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from haru.host import procfs


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields():
    fields = " ".join(["S", "41", "42"] + ["0"] * 16 + ["987654"])  # state ppid pgrp ... starttime (field 22)
    st = procfs.parse(7, f"7 (evil) name (x) {fields} 1 2 3")
    assert st == procfs.Stat(pid=7, state="S", ppid=41, pgrp=42, start=987654, flags=0)
    assert procfs.parse(7, "7 (cut") is None


def test_this_process_as_proc_has_it():
    st = procfs.stat(os.getpid())
    assert st is not None and st.ppid == os.getppid() and st.pgrp == os.getpgrp() and not st.zombie
    assert st.start == procfs.stat(os.getpid()).start  # stable: it names this process for good
    assert any(s.pid == os.getpid() for s in procfs.every())


def test_an_exited_child_is_gone_while_a_zombie_and_after_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not procfs.gone(child.pid):  # exited, not yet reaped: a zombie
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    st = procfs.stat(child.pid)
    assert st is None or st.zombie
    child.wait()
    assert procfs.stat(child.pid) is None and procfs.gone(child.pid)


def test_a_task_inside_its_exit_is_dying_before_it_is_a_zombie():
    """Field 9 (flags) with PF_EXITING: a SIGKILLed process the kernel is still tearing down (its sockets
    closed already) is dying, though its state is not Z yet; one without the flag is not."""

    def line(state: str, flags: int) -> str:
        fields = [state, "41", "42", "0", "0", "0", str(flags)] + ["0"] * 12 + ["987654"]
        return f"7 (vllm) {' '.join(fields)} 1 2 3"

    tearing_down = procfs.parse(7, line("R", 0x400044))  # PF_EXITING (0x4) among a running task's flags
    assert tearing_down is not None and tearing_down.flags == 0x400044
    assert tearing_down.exiting and not tearing_down.zombie
    running = procfs.parse(7, line("S", 0x400040))
    assert running is not None and not running.exiting
    assert procfs.parse(7, line("Z", 0)).exiting
    assert not procfs.dying(os.getpid())  # this process, alive
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert procfs.dying(child.pid)  # reaped: gone
