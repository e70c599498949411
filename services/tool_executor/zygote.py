"""Pool parent ("zygote"): a warm Python process that forks one sandboxed child per call.

Run as ``python -m services.tool_executor.zygote KIND HEX-MARSHALLED-CONFIG`` by the
service's pool (`pool.py`), with a scrubbed environment and one end of a socketpair (its fd
number is in the config). It

1. sets up isolation ONCE for everything it will fork (as root): a session without a
   controlling terminal; its own network namespace (only a loopback that stays down: no
   network at all), IPC and UTS namespaces, and a private mount namespace in which every
   mount is re-bound read-only, the paths that must not be seen (the service's source tree,
   its state dir, /root, /etc/shadow, ...) are covered by empty read-only mounts (with the
   interpreter and virtualenv bound back), /tmp is a fresh size-limited tmpfs that holds the
   calls' working directories, and /proc is re-mounted with ``hidepid=invisible`` (a call
   sees only its own processes, so /proc/1/environ and the service's /proc/PID/environ do
   not exist for it); no_new_privs; subreaper;
2. imports the libraries solutions use (light pool: a short stdlib math set; heavy pool:
   also numpy, sympy, mpmath, and a warm-up) and freezes the GC so children do not
   copy-on-write the parent's objects. It keeps its own imports lean (see config.LIGHT_PRELOAD:
   fork cost grows with the number of memory mappings);
3. serves frames (4-byte length + marshal) on the socket: for each call it forks (through
   libc, see `_fork`) a child that takes a process group of its own, makes a fresh 0700
   working directory, points fds 0-2 at a stdin memfd (or /dev/null) and two output memfds,
   closes every other fd, applies rlimits (policy.rlimits_for), drops all groups and switches
   to a uid of its own (one per concurrent slot, so calls cannot signal each other and
   RLIMIT_NPROC counts each call separately), and runs the code (with earlier session cells
   replayed silently first). It holds calls beyond its slots in a small queue of its own;
4. supervises: each child's pidfd tells when it exits; a wall-clock deadline per call kills
   the process and its group. Everything a call leaves behind (daemonised children, setsid
   escapes) is re-parented to this process (subreaper) when the call's main process ends, and
   is SIGKILLed as its parent, pass after pass, until none is left; until then the call's uid
   is not given to another call. (Killing by uid — taking the uid and sending SIGKILL to -1 —
   is used only at start and shutdown: while the parent holds a call's uid, that call's
   processes could signal it.)

If namespaces cannot be created or privileges cannot be dropped, it still serves but reports
that in its hello frame; the service refuses to use it unless configured `insecure`.
"""

from __future__ import annotations

import builtins
import collections
import ctypes
import gc
import importlib
import io
import linecache
import os
import random
import re
import select
import signal
import sys
import time
import traceback
# (no `typing` import: annotations stay strings, and the module would load _typing into
# every pool parent; see LIGHT_PRELOAD in config.py)

import marshal

from services.tool_executor import policy

CTRL_FD = 3
# Frames between the service and a pool parent: 4-byte big-endian length + marshal body
# (both ends are ours; marshal is built in, so the parent loads no extra shared library).
FRAME_HEADER = 4


def encode_frame(msg: dict[str, Any]) -> bytes:
    body = marshal.dumps(msg)
    return len(body).to_bytes(FRAME_HEADER, "big") + body


def decode_body(body: bytes) -> dict[str, Any]:
    return marshal.loads(body)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

# Exit status of a child whose sandbox set-up failed before the user's code ran.
SETUP_FAILED_EXIT = 125
# How often leftover processes of finished calls are reaped while any remain.
ORPHAN_POLL_S = 0.05
# Characters of stderr's end used to recognise a MemoryError traceback.
STDERR_TAIL_CHARS = 400

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


_libc_fork = _libc.fork
_libc_fork.restype = ctypes.c_int
_libc_fork.argtypes = []


def _fork() -> int:
    """fork(2) through libc, without CPython's before/after-fork hooks.

    Those hooks (re-initialising thread and import locks, threading's and logging's at-fork
    handlers, ...) exist for processes with other threads; a pool parent has exactly one
    thread and forks from its main loop, never while holding a lock. Skipping them halves the
    child's cost here (measured: ~245 -> ~45 page faults, 1.3-1.5 -> 0.6 ms CPU per child), which
    is most of the per-call cost. The one hook whose effect matters, reseeding `random`, the
    child does itself."""
    pid = _libc_fork()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fork: {os.strerror(err)}")
    return pid


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


# ----------------------------------------------------------------------------------------------
# isolation set-up (once per pool parent)


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def plan_hidden(hidden: list[str], keep: list[str], visible: tuple[str, ...] = ("/tmp",)
                ) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Which hidden paths to cover, and which kept paths (the interpreter, the virtualenv) to
    bind back inside a covered directory so they stay importable at the same path.
    A hidden path that is, or contains, a ``visible`` path (the calls' private /tmp: e.g. the
    parent of a checkout in /tmp) is not covered: covering it would hide where calls run.
    Returns ([(covered_dir, [kept paths inside it])...], [covered files and dirs without keeps])."""
    keep_real = sorted({os.path.realpath(k) for k in keep if os.path.isdir(k)})
    # Drop kept paths nested in other kept paths: binding the outer one brings them along.
    keep_real = [k for k in keep_real if not any(k != o and k.startswith(o.rstrip("/") + "/") for o in keep_real)]
    with_keeps: list[tuple[str, list[str]]] = []
    plain: list[str] = []
    reals = {os.path.realpath(p) for p in hidden}
    reals = {r for r in reals if not any(v == r or v.startswith(r.rstrip("/") + "/") for v in visible)}
    for real in sorted(reals):
        if not os.path.lexists(real):
            continue
        if any(o != real and real.startswith(o.rstrip("/") + "/") for o in reals):
            continue  # inside another hidden path: covered with it
        if any(k == real or real.startswith(k.rstrip("/") + "/") for k in keep_real):
            continue  # inside (or equal to) a kept path: keeping wins
        inside = [k for k in keep_real if k.startswith(real.rstrip("/") + "/")]
        if inside and os.path.isdir(real):
            with_keeps.append((real, inside))
        else:
            plain.append(real)
    return with_keeps, plain


def _cover_keeping(directory: str, kept: list[str], staging: str, errors: list[str],
                   options: str = "size=64k,mode=0755") -> bool:
    """Cover `directory` with an empty tmpfs, then bind each kept path back at its place."""
    staged = []
    try:
        for i, path in enumerate(kept):
            point = f"{staging}/{len(os.listdir(staging))}-{i}"
            os.mkdir(point)
            _mount(path, point, None, MS_BIND | MS_REC, None)
            staged.append((path, point))
        _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for path, point in staged:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(point, path, None, MS_BIND | MS_REC, None)
        return True
    except OSError as exc:
        errors.append(f"covering {directory} failed: {exc}")
        return False
    finally:
        for _, point in staged:
            _libc.umount2(point.encode(), 2)  # MNT_DETACH
            try:
                os.rmdir(point)
            except OSError:
                pass


def _mountinfo() -> list[tuple[str, set[str]]]:
    points = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            parts = line.split()
            target = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), parts[4])  # \040 etc.
            points.append((target, set(parts[5].split(","))))
    return points


def _remount_all_readonly(errors: list[str]) -> None:
    seen = set()
    for target, opts in _mountinfo():
        if target in seen:
            continue
        seen.add(target)
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        flags |= MS_NOSUID if "nosuid" in opts else 0
        flags |= MS_NODEV if "nodev" in opts else 0
        flags |= MS_NOEXEC if "noexec" in opts else 0
        try:
            _mount(None, target, None, flags, None)
        except OSError as exc:
            errors.append(f"read-only remount of {target} failed: {exc}")


def _hide(path: str, errors: list[str]) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
        elif os.path.exists(path):
            _mount("/dev/null", path, None, MS_BIND, None)
    except OSError as exc:
        errors.append(f"hiding {path} failed: {exc}")


def setup_namespaces() -> dict[str, Any]:
    """Network/IPC/UTS/mount namespaces for this process and everything it forks."""
    report: dict[str, Any] = {"netns": False, "mountns": False, "errors": []}
    if _libc.unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) == 0:
        report["netns"] = True
    else:
        report["errors"].append(f"unshare(NEWNET) failed: {os.strerror(ctypes.get_errno())}")
    if _libc.unshare(CLONE_NEWNS) == 0:
        try:
            _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
            report["mountns"] = True
        except OSError as exc:
            report["errors"].append(str(exc))
    else:
        report["errors"].append(f"unshare(NEWNS) failed: {os.strerror(ctypes.get_errno())}")
    return report


def setup_filesystem(report: dict[str, Any], hidden_paths: list[str], tmpfs_mb: int) -> str:
    """After the imports: hide paths, everything read-only, fresh /tmp and /proc.
    Returns the directory under which calls get their working directories."""
    errors: list[str] = report["errors"]
    if not report["mountns"]:
        import tempfile

        return tempfile.mkdtemp(prefix="rstar-tool-executor-")
    keep = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    # The calls' working directories live in a private /tmp; it also stages bind mounts below.
    # An interpreter or virtualenv that itself lives under /tmp (a checkout in /tmp) is bound
    # back into the new /tmp, or the calls could not import anything.
    tmp_keeps = sorted({os.path.realpath(k) for k in keep if os.path.isdir(k) and os.path.realpath(k).startswith("/tmp/")})
    tmp_options = f"size={tmpfs_mb}m,mode=0711"
    if tmp_keeps:
        import tempfile

        staging = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else "/var/tmp")
        report["private_tmp"] = _cover_keeping("/tmp", tmp_keeps, staging, errors, tmp_options)
        os.rmdir(staging)
    else:
        try:
            _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options)
            report["private_tmp"] = True
        except OSError as exc:
            errors.append(str(exc))
            report["private_tmp"] = False
    with_keeps, plain = plan_hidden(hidden_paths, keep)
    if report["private_tmp"]:
        os.mkdir("/tmp/.stage", 0o700)
        for directory, kept in with_keeps:
            _cover_keeping(directory, kept, "/tmp/.stage", errors)
        os.rmdir("/tmp/.stage")
    else:
        plain += [d for d, _ in with_keeps]
    for path in plain:
        _hide(path, errors)
    _remount_all_readonly(errors)
    if report["private_tmp"]:
        # The read-only pass covered /tmp too; make it writable again (for the pool parent,
        # which creates each call's 0700 directory; /tmp itself is 0711 root-owned).
        try:
            _mount(None, "/tmp", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV, None)
        except OSError as exc:
            errors.append(f"re-enabling writes on /tmp failed: {exc}")
            report["private_tmp"] = False
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
        report["hidepid"] = True
    except OSError as exc:
        errors.append(f"private /proc failed: {exc}")
        report["hidepid"] = False
    if report["private_tmp"]:
        return "/tmp"
    import tempfile

    return tempfile.mkdtemp(prefix="rstar-tool-executor-")


def _remove_tree(path: str) -> None:
    """rm -rf without shutil (which loads the bz2/lzma/zlib libraries into the parent)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        entries = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


# seccomp: refuse socket(AF_UNIX, ...) to every call. The network namespace already isolates
# IP and abstract unix sockets, but a unix socket *file* anywhere visible (a database's
# /run/postgresql/.s.PGSQL.5432 is mode 0777 and trusts local users) could be connected to
# through the read-only mounts: connect() needs no write access to the mount. socketpair()
# (asyncio, multiprocessing) stays allowed: it reaches nothing outside the call.
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
NR_SOCKET_X86_64 = 41
AF_UNIX = 1
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def install_seccomp_no_unix_sockets() -> None:
    """Inherited by every child. Other architectures' syscall entry points (i386 int 0x80,
    x32) are refused outright so the filter cannot be sidestepped through them."""
    import errno

    machine = os.uname().machine
    if machine != "x86_64":
        raise OSError(errno.ENOSYS, f"seccomp filter written for x86_64, not {machine}")
    program = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # arch
        (_BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (_BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, 0),  # syscall number
        (_BPF_JGE_K, 4, 0, X32_SYSCALL_BIT),
        (_BPF_JEQ_K, 0, 2, NR_SOCKET_X86_64),
        (_BPF_LD_W_ABS, 0, 0, 16),  # args[0] (low 32 bits): the address family
        (_BPF_JEQ_K, 1, 0, AF_UNIX),
        (_BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (_BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EACCES),
    ]
    filters = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    prog = _SockFprog(len(program), filters)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------------------------
# the child


class _NullWriter(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)

    def writable(self) -> bool:
        return True


def _run_cells(code: str, replay: list[str]) -> int:
    """Run the (replayed) cells and the call's cell; returns the process exit status."""
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    real_out, real_err = sys.stdout, sys.stderr
    if replay:
        null = _NullWriter()
        for cell in replay:
            sys.stdout = sys.stderr = null
            try:
                exec(compile(cell, "<cell>", "exec"), namespace)  # noqa: S102 - the service's purpose
            except BaseException:  # noqa: BLE001 - a replayed cell ran ok before; keep going
                pass
        sys.stdout, sys.stderr = real_out, real_err
    linecache.cache["<cell>"] = (len(code), None, code.splitlines(True), "<cell>")
    try:
        exec(compile(code, "<cell>", "exec"), namespace)  # noqa: S102
        return 0
    except SystemExit as exc:
        status, message = policy.exit_code_from_system_exit(exc.code)
        if message is not None:
            _safe_print_err(message)
        return status
    except BaseException as exc:  # noqa: BLE001 - report like the interpreter does
        # Skip this function's own frame: the traceback starts in the user's cell.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        try:
            traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - stderr may be closed by the code
            pass
        return 1


def _safe_print_err(message: str) -> None:
    try:
        print(message, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        pass


class CallSpec:
    __slots__ = ("call_id", "code", "stdin", "replay", "rlimits", "timeout_s", "reseed_random")

    def __init__(self, call_id: int, code: str, stdin: bytes, replay: list[str], rlimits: list[tuple[int, int, int]], timeout_s: float) -> None:
        self.call_id = call_id
        self.code = code
        self.stdin = stdin
        self.replay = replay
        self.rlimits = rlimits
        self.timeout_s = timeout_s
        self.reseed_random = True


class Zygote:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.kind = cfg["kind"]
        self.slots = int(cfg["slots"])
        self.uid_base = int(cfg["uid_base"])
        self.maxima = policy.Maxima(**cfg["maxima"])
        self.max_output_chars = int(cfg["max_output_chars"])
        self.is_root = os.geteuid() == 0
        self.free_uids = [self.uid_base + i for i in range(self.slots)]
        self.quarantined_uids: list[int] = []  # uids whose call left processes not yet ended
        self.running: dict[int, dict[str, Any]] = {}  # pid -> call state
        self.backlog: collections.deque[dict[str, Any]] = collections.deque()  # calls waiting for a slot
        self.seq = 0
        self.inbuf = bytearray()
        self.base_as = 0
        self.work_root = "/tmp"
        self.report: dict[str, Any] = {}

    # -- start-up ------------------------------------------------------------------------
    def start(self) -> None:
        try:
            # A session without a controlling terminal for the parent and every call (so no
            # call can reach a terminal, e.g. TIOCSTI), set up once here.
            os.setsid()
        except OSError:
            pass
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        except OSError:
            pass
        self.report = setup_namespaces() if self.is_root else {"netns": False, "mountns": False, "errors": ["not running as root: cannot create namespaces"]}
        t0 = time.perf_counter()
        for name in self.cfg["preload"]:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                self.report["errors"].append(f"preload {name}: {exc}")
        warmup = self.cfg.get("warmup") or ""
        if warmup:
            try:
                exec(compile(warmup, "<warmup>", "exec"), {"__name__": "__warmup__"})  # noqa: S102
            except Exception as exc:  # noqa: BLE001
                self.report["errors"].append(f"warm-up failed: {exc!r}")
        preload_ms = (time.perf_counter() - t0) * 1000
        self.work_root = setup_filesystem(self.report, self.cfg["hidden_paths"], int(self.cfg["tmpfs_mb"]))
        self.report["uid_drop"] = self.is_root
        try:
            install_seccomp_no_unix_sockets()
            self.report["seccomp_no_unix_sockets"] = True
        except OSError as exc:
            self.report["seccomp_no_unix_sockets"] = False
            self.report["errors"].append(f"seccomp filter: {exc}")
        self.report["secure"] = bool(
            self.report["netns"]
            and self.report["mountns"]
            and self.is_root
            and self.report.get("private_tmp")
            and self.report.get("hidepid")
            and self.report.get("seccomp_no_unix_sockets")
        )
        self.base_as = _vm_size_bytes()
        self.child_stdio = (
            io.open(0, "r", encoding="utf-8", errors="surrogateescape", closefd=False),  # noqa: SIM115
            io.open(1, "w", encoding="utf-8", closefd=False),  # noqa: SIM115
            io.open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1),  # noqa: SIM115
        )
        for uid in self.free_uids:
            self._kill_uid(uid)  # leftovers of a previous pool parent that used these uids
        gc.collect()
        gc.freeze()
        self.ctrl = int(self.cfg.get("ctrl_fd", CTRL_FD))
        os.set_blocking(self.ctrl, False)
        # Children are watched through pidfds (readable when the child exits), so there is
        # no SIGCHLD handler that each child would have to undo.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # Inherited by every child; it only matters for execve, which the parent never does.
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.epoll = select.epoll()
        self.epoll.register(self.ctrl, select.EPOLLIN)
        self._send(
            {
                "hello": True,
                "pid": os.getpid(),
                "kind": self.kind,
                "isolation": self.report,
                "base_address_space_mb": self.base_as // (1024 * 1024),
                "preload_ms": round(preload_ms, 1),
            }
        )

    # -- protocol ------------------------------------------------------------------------
    def _send(self, msg: dict[str, Any]) -> None:
        view = memoryview(encode_frame(msg))
        while view:
            try:
                view = view[os.write(self.ctrl, view) :]
            except BlockingIOError:
                select.select([], [self.ctrl], [])

    def _read_ctrl(self) -> bool:
        while True:
            try:
                chunk = os.read(self.ctrl, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                return False
            self.inbuf += chunk
        while len(self.inbuf) >= 4:
            n = int.from_bytes(self.inbuf[:FRAME_HEADER], "big")
            if len(self.inbuf) < FRAME_HEADER + n:
                break
            msg = decode_body(bytes(self.inbuf[FRAME_HEADER : FRAME_HEADER + n]))
            del self.inbuf[: FRAME_HEADER + n]
            self._accept(msg)
        return True

    # -- calls ---------------------------------------------------------------------------
    def _accept(self, msg: dict[str, Any]) -> None:
        """Start the call now if a slot is free, else hold it here until one is (the service
        sends a few more calls than slots, so a slot never idles waiting for the next call
        to travel from the service)."""
        msg["_received"] = time.monotonic()
        if self.free_uids and not self.backlog:
            self._start_safely(msg)
        else:
            self.backlog.append(msg)

    def _start_backlog(self) -> None:
        while self.backlog and self.free_uids:
            self._start_safely(self.backlog.popleft())

    def _start_safely(self, msg: dict[str, Any]) -> None:
        try:
            self._start_call(msg)
        except Exception as exc:  # noqa: BLE001 - one bad message must not end the pool parent
            self._send(self._failed(msg.get("id", 0), f"tool executor could not start the call: {exc!r}"))

    def _start_call(self, msg: dict[str, Any]) -> None:
        call_id = msg["id"]
        limits = policy.Limits(timeout_s=float(msg["timeout_s"]), memory_mb=int(msg["memory_mb"]))
        spec = CallSpec(
            call_id=call_id,
            code=msg["code"],
            stdin=msg.get("stdin", "").encode("utf-8", errors="surrogateescape"),
            replay=msg.get("replay") or [],
            rlimits=policy.rlimits_for(limits, self.maxima, self.base_as),
            timeout_s=limits.timeout_s + float(msg.get("extra_time_s", 0.0)),
        )
        spec.reseed_random = policy.may_use_random(spec.code) or any(policy.may_use_random(c) for c in spec.replay)
        uid = self.free_uids.pop()
        self.seq += 1
        workdir = f"{self.work_root}/c{self.seq}"
        started = time.monotonic()
        try:
            out_fd = os.memfd_create("stdout", os.MFD_CLOEXEC)
            err_fd = os.memfd_create("stderr", os.MFD_CLOEXEC)
            try:
                pid = _fork()
            except OSError:
                os.close(out_fd)
                os.close(err_fd)
                raise
        except OSError as exc:
            # Out of processes or memory on the host: this call fails, the parent carries on.
            self.free_uids.append(uid)
            self._send(self._failed(call_id, f"tool executor could not start the call: {exc}"))
            return
        if pid == 0:
            self._child(spec, uid, out_fd, err_fd, workdir)  # never returns
        pidfd = os.pidfd_open(pid)
        self.epoll.register(pidfd, select.EPOLLIN)
        self.running[pid] = {
            "waited_ms": (started - msg["_received"]) * 1000,
            "pidfd": pidfd,
            "spec": spec,
            "uid": uid,
            "out": out_fd,
            "err": err_fd,
            "workdir": workdir,
            "started": started,
            "deadline": started + spec.timeout_s,
            "timed_out": False,
        }

    def _child(self, spec: CallSpec, uid: int, out_fd: int, err_fd: int, workdir: str) -> None:
        try:
            # A process group of its own (killpg), in the parent's session, which has no
            # controlling terminal (see start). Not setsid(): with scheduler autogroups it
            # creates a scheduling group per call, measured at ~0.8 ms of the call's ~2 ms.
            os.setpgid(0, 0)
            if spec.stdin:
                in_fd = os.memfd_create("stdin")
                view = memoryview(spec.stdin)
                while view:
                    view = view[os.write(in_fd, view) :]
                os.lseek(in_fd, 0, os.SEEK_SET)
                os.dup2(in_fd, 0)
            else:
                os.dup2(self.devnull, 0)
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.closerange(3, 1 << 20)
            os.mkdir(workdir, 0o700)
            if self.is_root:
                os.chown(workdir, uid, uid)
            os.chdir(workdir)
            import resource

            for res, soft, hard in spec.rlimits:
                resource.setrlimit(res, (soft, hard))
            if self.is_root:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            os.environ["HOME"] = workdir
            os.environ["TMPDIR"] = workdir
            # Built once in the pool parent (never used there), so the child does not pay for them.
            sys.stdin, sys.stdout, sys.stderr = self.child_stdio
            sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
            if spec.reseed_random:
                random.seed()  # a fresh interpreter would have its own seed (see _fork)
            sys.argv = [""]
        except BaseException as exc:  # noqa: BLE001
            try:
                os.write(2, f"sandbox set-up failed: {exc!r}\n".encode())
            finally:
                os._exit(SETUP_FAILED_EXIT)
        status = 1
        try:
            status = _run_cells(spec.code, spec.replay)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001 - the code may have closed it
                    pass
            os._exit(status)

    def _kill_uid(self, uid: int) -> None:
        """SIGKILL every process whose real uid is `uid`. Used only at start and shutdown, for
        processes that are not (or no longer) our descendants: while this parent holds the
        uid, a process of that uid could signal it, so calls' leftovers are handled by
        `_kill_orphans` instead, which needs no uid switch."""
        if not self.is_root:
            return
        os.setresuid(uid, uid, 0)
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.setresuid(0, 0, 0)

    def _finish(self, pid: int, wait_status: int, cpu_s: float | None = None) -> None:
        state = self.running.pop(pid)
        self.epoll.unregister(state["pidfd"])
        os.close(state["pidfd"])
        spec: CallSpec = state["spec"]
        duration_ms = (time.monotonic() - state["started"]) * 1000
        # Whatever the call left running (daemons, a process group, setsid escapes) is now
        # our child (subreaper): its uid stays out of use until `_kill_orphans` has ended it.
        if self._orphans():
            self.quarantined_uids.append(state["uid"])
        else:
            self.free_uids.append(state["uid"])
        outputs = []
        sizes = []
        for fd in (state["out"], state["err"]):
            size = os.fstat(fd).st_size
            sizes.append(size)
            outputs.append(os.pread(fd, size, 0) if size else b"")
            os.close(fd)
        try:
            os.rmdir(state["workdir"])
        except FileNotFoundError:
            pass
        except OSError:
            _remove_tree(state["workdir"])
        if os.WIFEXITED(wait_status):
            exit_code, term_signal = os.WEXITSTATUS(wait_status), None
        else:
            exit_code, term_signal = None, os.WTERMSIG(wait_status)
        stderr_tail = outputs[1][-STDERR_TAIL_CHARS:].decode("utf-8", errors="replace")
        status = policy.classify(
            policy.Ending(
                exit_code=exit_code,
                term_signal=term_signal,
                timed_out=state["timed_out"],
                stdout_bytes=sizes[0],
                stderr_bytes=sizes[1],
                output_hard_limit_bytes=self.maxima.output_hard_limit_bytes,
                stderr_tail=stderr_tail,
                cpu_s=cpu_s,
                cpu_limit_s=policy.cpu_limit_s(spec.rlimits),
            )
        )
        stdout, out_trunc = policy.cap_output(outputs[0], self.max_output_chars)
        stderr, err_trunc = policy.cap_output(outputs[1], self.max_output_chars)
        if status is policy.Status.OUTPUT_LIMIT:
            out_trunc = out_trunc or sizes[0] >= self.maxima.output_hard_limit_bytes
            err_trunc = err_trunc or sizes[1] >= self.maxima.output_hard_limit_bytes
        self._send(
            {
                "id": spec.call_id,
                "status": status.value,
                "stdout": stdout,
                "stderr": stderr,
                "stdout_truncated": out_trunc,
                "stderr_truncated": err_trunc,
                "exit_code": exit_code,
                "signal": term_signal,
                "duration_ms": round(duration_ms, 3),
                "waited_ms": round(state["waited_ms"], 3),
            }
        )

    @staticmethod
    def _failed(call_id: int, why: str) -> dict[str, Any]:
        return {
            "id": call_id,
            "status": policy.Status.ERROR.value,
            "stdout": "",
            "stderr": why,
            "stdout_truncated": False,
            "stderr_truncated": False,
            "exit_code": None,
            "signal": None,
            "duration_ms": 0.0,
            "waited_ms": 0.0,
        }

    def _reap(self) -> None:
        while True:
            try:
                pid, wait_status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.running:
                self._finish(pid, wait_status, usage.ru_utime + usage.ru_stime)
            # else: an orphan of some call, reparented to us (subreaper): reaped, nothing to do

    def _orphans(self) -> list[int]:
        """Our children that are not a call's main process: everything a call left behind
        (after its main process ends, all its descendants are re-parented to us, the
        subreaper), or a running call's processes whose parent already exited."""
        try:
            with open(self.children_path) as fh:
                children = fh.read().split()
        except OSError:
            return []
        return [pid for pid in map(int, children) if pid not in self.running]

    def _kill_orphans(self) -> bool:
        """SIGKILL the orphans (as their parent: their pids cannot be reused before we reap
        them), and release the quarantined uids once none is left. Their own children come
        back to us in turn and die on the next pass. True while any remain."""
        orphans = self._orphans()
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not orphans and self.quarantined_uids:
            self.free_uids.extend(self.quarantined_uids)
            self.quarantined_uids.clear()
        return bool(orphans)

    def _enforce_deadlines(self) -> float | None:
        now = time.monotonic()
        next_deadline = None
        for pid, state in self.running.items():
            if state["timed_out"]:
                continue
            if now >= state["deadline"]:
                state["timed_out"] = True
                # The process and its group (pgid = pid, not reusable until we reap it); what
                # escaped the group becomes an orphan and `_kill_orphans` ends it.
                for kill in (os.kill, os.killpg):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            elif next_deadline is None or state["deadline"] < next_deadline:
                next_deadline = state["deadline"]
        return None if next_deadline is None else max(0.0, next_deadline - now)

    def serve(self) -> None:
        self.children_path = f"/proc/self/task/{os.getpid()}/children"
        orphans = False
        while True:
            timeout = self._enforce_deadlines()
            if orphans:
                timeout = ORPHAN_POLL_S if timeout is None else min(timeout, ORPHAN_POLL_S)
            for fd, _ in self.epoll.poll(-1 if timeout is None else timeout):
                if fd == self.ctrl:
                    if not self._read_ctrl():
                        self._shutdown()
                        return
            # A readable pidfd means that child exited; reaping also collects orphans of
            # earlier calls that came back to us as subreaper.
            self._reap()
            orphans = self._kill_orphans() or bool(self.quarantined_uids)
            self._start_backlog()

    def _shutdown(self) -> None:
        for pid in [*self.running, *self._orphans()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for i in range(self.slots):
            self._kill_uid(self.uid_base + i)


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[-1]))
    zygote = Zygote(cfg)
    zygote.start()
    zygote.serve()


if __name__ == "__main__":
    main()
