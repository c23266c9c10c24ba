"""Run memcheck's CLI in a subprocess whose stderr is a pseudo-terminal, as in a user's shell."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

ERASE = "\r\033[K"  # what the progress line writes to rewrite itself, and to clear itself


def run_cli(args, *, tty: bool, timeout: int = 300) -> tuple[str, str, int]:
    """stdout, stderr and the exit code of ``python -m memcheck ARGS``; stderr on a pty if ``tty``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    if not tty:
        done = subprocess.run([sys.executable, "-m", "memcheck", *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
        return done.stdout, done.stderr, done.returncode
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "memcheck", *args], stdout=subprocess.PIPE,
                                stderr=follower, env=env)
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        stdout = proc.stdout.read().decode()
        code = proc.wait(timeout=timeout)
    finally:
        os.close(leader)
    return stdout, b"".join(chunks).decode(errors="replace"), code
