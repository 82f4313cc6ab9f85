"""A seccomp deny-list for the sandbox, assembled as classic BPF (what `bwrap --seccomp FD` loads).

Namespaces already take away the network, other processes and the host's files; this narrows the
kernel surface a sandboxed program can reach for an exploit: tracing other processes, mounting,
new namespaces, eBPF, perf events, userfaultfd, the kernel keyring, io_uring, module loading,
file handles. Test programs need none of these. Denied calls fail with EPERM, so a program that
probes for them sees an ordinary error. Numbers come from the kernel headers
(`asm/unistd_64.h`; `asm-generic/unistd.h` for aarch64).
"""

from __future__ import annotations

import platform
import struct

DENIED = {
    # name: (x86_64, aarch64)
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsmount": (432, 432),
}
# AUDIT_ARCH_* of linux/audit.h, and which column of DENIED applies.
ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}

# Classic BPF (linux/filter.h, linux/seccomp.h).
LOAD_WORD_ABS, JUMP_EQ, JUMP_GE, RETURN = 0x20, 0x15, 0x35, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM = 1
X32_SYSCALL_BIT = 0x40000000
OFFSET_NR, OFFSET_ARCH = 0, 4  # fields of struct seccomp_data


def _op(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def denied_numbers(machine: str | None = None) -> dict[str, int]:
    """The deny-list with this machine's system call numbers (empty where there is no table)."""
    arch = ARCHES.get(machine or platform.machine())
    return {} if arch is None else {name: numbers[arch[1]] for name, numbers in DENIED.items()}


def deny_filter(machine: str | None = None) -> bytes | None:
    """The BPF program for this machine's architecture; None where the table has no numbers."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        return None
    audit_arch, column = ARCHES[machine]
    numbers = sorted(set(denied_numbers(machine).values()))
    # Layout: arch check, load nr, [x32 check], one jump per denied nr to DENY, ALLOW, DENY.
    program = [_op(LOAD_WORD_ABS, OFFSET_ARCH), _op(JUMP_EQ, audit_arch, 1, 0), _op(RETURN, RET_KILL_PROCESS)]
    program.append(_op(LOAD_WORD_ABS, OFFSET_NR))
    checks = ([X32_SYSCALL_BIT] if column == 0 else []) + numbers
    for index, number in enumerate(checks):
        to_deny = len(checks) - index  # skip the remaining checks and ALLOW
        program.append(_op(JUMP_GE if number == X32_SYSCALL_BIT else JUMP_EQ, number, to_deny, 0))
    program += [_op(RETURN, RET_ALLOW), _op(RETURN, RET_ERRNO | EPERM)]
    return b"".join(program)
