//! Linux confinement: no core dumps, `no_new_privs`, a seccomp allow-list
//! for x86-64 (x32 and i386 system calls are refused), no capabilities for
//! a user's process and a container root's few for root's.

use std::io;

use crate::syscall::check;

/// The system calls a sandboxed process may make (x86-64 numbers); every
/// other one fails with EPERM. Built from what a Debian userland, python and
/// pip, node, gcc, git, apt and curl use, checked against the set Docker's
/// default profile allows. Left out on purpose: mounts and namespaces
/// (`mount`, `unshare`, `setns`, `pivot_root`, the new mount API), kernel
/// surfaces with an exploit history that no such tool needs (`bpf`,
/// `perf_event_open`, `userfaultfd`, `io_uring_*`, the keyring, `modify_ldt`),
/// host-wide state (modules, `kexec`, `reboot`, swap, clocks, `syslog`,
/// `acct`, `quotactl`), and file handles (`open_by_handle_at`).
///
/// `ptrace`, `process_vm_readv/writev`, `kcmp` and `pidfd_getfd` are allowed:
/// gdb and strace inside a sandbox are a user expectation; every process the
/// caller can trace is in the sandbox's own pid namespace with the same
/// filter, no capability lets it reach another sandbox's, and since Linux 4.8
/// seccomp re-checks a system call after a tracer rewrites it, so tracing
/// cannot be used to slip past this filter.
pub(crate) const ALLOWED: &[libc::c_long] = &[
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_access,
    libc::SYS_alarm,
    libc::SYS_arch_prctl,
    libc::SYS_bind,
    libc::SYS_brk,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_chdir,
    libc::SYS_chmod,
    libc::SYS_chown,
    libc::SYS_clock_getres,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_connect,
    libc::SYS_copy_file_range,
    libc::SYS_creat,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_epoll_create,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_epoll_wait,
    libc::SYS_eventfd,
    libc::SYS_eventfd2,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_fadvise64,
    libc::SYS_fallocate,
    libc::SYS_fchdir,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fchmodat2,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_fgetxattr,
    libc::SYS_flistxattr,
    libc::SYS_flock,
    libc::SYS_fork,
    libc::SYS_fremovexattr,
    libc::SYS_fsetxattr,
    libc::SYS_fstat,
    libc::SYS_fstatfs,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_futex,
    libc::SYS_futex_waitv,
    libc::SYS_futimesat,
    libc::SYS_getcpu,
    libc::SYS_getcwd,
    libc::SYS_getdents,
    libc::SYS_getdents64,
    libc::SYS_getegid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getgroups,
    libc::SYS_getitimer,
    libc::SYS_getpeername,
    libc::SYS_getpgid,
    libc::SYS_getpgrp,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_getpriority,
    libc::SYS_getrandom,
    libc::SYS_getresgid,
    libc::SYS_getresuid,
    libc::SYS_getrlimit,
    libc::SYS_get_robust_list,
    libc::SYS_getrusage,
    libc::SYS_getsid,
    libc::SYS_getsockname,
    libc::SYS_getsockopt,
    libc::SYS_gettid,
    libc::SYS_gettimeofday,
    libc::SYS_getuid,
    libc::SYS_getxattr,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_init,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_rm_watch,
    libc::SYS_io_cancel,
    libc::SYS_ioctl,
    libc::SYS_io_destroy,
    libc::SYS_io_getevents,
    libc::SYS_ioprio_get,
    libc::SYS_ioprio_set,
    libc::SYS_io_setup,
    libc::SYS_io_submit,
    libc::SYS_kcmp,
    libc::SYS_kill,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_restrict_self,
    libc::SYS_lchown,
    libc::SYS_lgetxattr,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_listen,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_lremovexattr,
    libc::SYS_lseek,
    libc::SYS_lsetxattr,
    libc::SYS_lstat,
    libc::SYS_madvise,
    libc::SYS_membarrier,
    libc::SYS_memfd_create,
    libc::SYS_mincore,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_mlock,
    libc::SYS_mlock2,
    libc::SYS_mlockall,
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_mq_getsetattr,
    libc::SYS_mq_notify,
    libc::SYS_mq_open,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_unlink,
    libc::SYS_mremap,
    libc::SYS_msgctl,
    libc::SYS_msgget,
    libc::SYS_msgrcv,
    libc::SYS_msgsnd,
    libc::SYS_msync,
    libc::SYS_munlock,
    libc::SYS_munlockall,
    libc::SYS_munmap,
    libc::SYS_nanosleep,
    libc::SYS_newfstatat,
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_pause,
    libc::SYS_personality,
    libc::SYS_pidfd_getfd,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    libc::SYS_pipe,
    libc::SYS_pipe2,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_pkey_mprotect,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_prctl,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_preadv2,
    libc::SYS_prlimit64,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pselect6,
    libc::SYS_ptrace,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_pwritev2,
    libc::SYS_read,
    libc::SYS_readahead,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_readv,
    libc::SYS_recvfrom,
    libc::SYS_recvmmsg,
    libc::SYS_recvmsg,
    libc::SYS_remap_file_pages,
    libc::SYS_removexattr,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_restart_syscall,
    libc::SYS_rmdir,
    libc::SYS_rseq,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigsuspend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_getattr,
    libc::SYS_sched_getparam,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setattr,
    libc::SYS_sched_setparam,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_yield,
    libc::SYS_seccomp,
    libc::SYS_select,
    libc::SYS_semctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_sendfile,
    libc::SYS_sendmmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_setfsgid,
    libc::SYS_setfsuid,
    libc::SYS_setgid,
    libc::SYS_setgroups,
    libc::SYS_setitimer,
    libc::SYS_setpgid,
    libc::SYS_setpriority,
    libc::SYS_setregid,
    libc::SYS_setresgid,
    libc::SYS_setresuid,
    libc::SYS_setreuid,
    libc::SYS_setrlimit,
    libc::SYS_set_robust_list,
    libc::SYS_setsid,
    libc::SYS_setsockopt,
    libc::SYS_set_tid_address,
    libc::SYS_setuid,
    libc::SYS_setxattr,
    libc::SYS_shmat,
    libc::SYS_shmctl,
    libc::SYS_shmdt,
    libc::SYS_shmget,
    libc::SYS_shutdown,
    libc::SYS_sigaltstack,
    libc::SYS_signalfd,
    libc::SYS_signalfd4,
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_splice,
    libc::SYS_stat,
    libc::SYS_statfs,
    libc::SYS_statx,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_sync,
    libc::SYS_sync_file_range,
    libc::SYS_syncfs,
    libc::SYS_sysinfo,
    libc::SYS_tee,
    libc::SYS_tgkill,
    libc::SYS_time,
    libc::SYS_timer_create,
    libc::SYS_timer_delete,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_gettime,
    libc::SYS_timer_settime,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_gettime,
    libc::SYS_timerfd_settime,
    libc::SYS_times,
    libc::SYS_tkill,
    libc::SYS_truncate,
    libc::SYS_umask,
    libc::SYS_uname,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_utime,
    libc::SYS_utimensat,
    libc::SYS_utimes,
    libc::SYS_vfork,
    libc::SYS_vmsplice,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_write,
    libc::SYS_writev,
];

/// `ioctl` requests refused even though `ioctl` is allowed:
/// `BTRFS_IOC_SNAP_CREATE`, `BTRFS_IOC_SUBVOL_CREATE` and their `_V2`s. A
/// volume is a btrfs subvolume bound straight into the sandbox (not behind
/// overlayfs, which passes no btrfs ioctl), and a new subvolume in it would
/// have its own, unlimited, quota group.
pub(crate) const REFUSED_IOCTLS: &[u32] = &[0x5000_9401, 0x5000_940E, 0x5000_9417, 0x5000_9418];

/// A prepared confinement; see the module docs of `copse_jailer::confine`.
pub struct Confinement {
    filter: Vec<libc::sock_filter>,
}

impl Confinement {
    pub fn new() -> io::Result<Self> {
        Ok(Self { filter: super::seccomp::program(ALLOWED, REFUSED_IOCTLS) })
    }

    /// No core dumps, capabilities down to [`ROOT_CAPABILITIES`] for root
    /// and none for anyone else, forbid gaining new ones, install the
    /// filter. Only system calls: safe between `fork` and `exec`.
    pub fn apply(&self) -> io::Result<()> {
        // A core file would hold the process's secrets wherever the kernel
        // puts it; hard 0 so no process in the sandbox can raise it again.
        let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: setrlimit reads a valid rlimit.
        check(unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) })?;
        limit_capabilities()?;
        // SAFETY: plain prctl with integer arguments.
        check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
        let program = libc::sock_fprog { len: self.filter.len() as u16, filter: self.filter.as_ptr().cast_mut() };
        // SAFETY: `program` points at the filter, which outlives the call;
        // the kernel copies it.
        check(unsafe {
            libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &program as *const libc::sock_fprog)
        })
    }
}

const CAP_DAC_READ_SEARCH: libc::c_int = 2;
const CAP_SETPCAP: libc::c_int = 8;
const CAP_NET_BIND_SERVICE: libc::c_int = 10;
const LAST_CAP: libc::c_int = 63;

/// What the agent (and init, which forks it) keep of the capabilities
/// root of the sandbox's user namespace has: switching to a user's ids and
/// acting on files for the files API as any user (chown, permission and
/// owner overrides, keeping setgid bits on uploads), signalling any user's
/// processes, `CAP_SETPCAP`, which the processes it starts need to narrow
/// their bounding set (see [`Confinement::apply`]), and what root's
/// processes keep besides ([`ROOT_CAPABILITIES`]: `CAP_NET_BIND_SERVICE`),
/// since no process can be given more than its parent's bounding set.
/// Everything else (`CAP_NET_ADMIN` over the sandbox's own network
/// namespace, `CAP_SYS_ADMIN` and mounts, `CAP_NET_RAW`, ...) goes.
pub const AGENT_CAPABILITIES: &[libc::c_int] = &[
    0, // CAP_CHOWN
    1, // CAP_DAC_OVERRIDE
    CAP_DAC_READ_SEARCH,
    3, // CAP_FOWNER
    4, // CAP_FSETID
    5, // CAP_KILL
    6, // CAP_SETGID
    7, // CAP_SETUID
    CAP_SETPCAP,
    CAP_NET_BIND_SERVICE,
];

/// What a process started as the sandbox's root keeps: what root in a
/// container may do to its own files, users and ports (chown, permission
/// and owner overrides, setuid bits, signals, switching users, ports below
/// 1024), all of it scoped to the sandbox's user namespace, so a template's
/// `RUN chown`, a package's maintainer scripts or `runuser` work as they do
/// in E2B. Never all of [`AGENT_CAPABILITIES`]: the agent keeps
/// `CAP_SETPCAP` and `CAP_DAC_READ_SEARCH` besides, so its permitted set is
/// never a subset of a root process's, and the kernel refuses that process
/// `ptrace` of the agent and its `/proc/<pid>/{mem,environ,fd}` (the agent
/// holds the sandbox's access token).
pub const ROOT_CAPABILITIES: &[libc::c_int] = &[
    0, // CAP_CHOWN
    1, // CAP_DAC_OVERRIDE
    3, // CAP_FOWNER
    4, // CAP_FSETID
    5, // CAP_KILL
    6, // CAP_SETGID
    7, // CAP_SETUID
    CAP_NET_BIND_SERVICE,
];

fn bits(caps: &[libc::c_int]) -> u32 {
    caps.iter().fold(0, |bits, cap| bits | 1 << cap)
}

/// Limits this process (the sandbox's init, before it forks the agent) to
/// [`AGENT_CAPABILITIES`]: bounding, permitted, effective and inheritable
/// sets, and no ambient ones.
pub fn keep_agent_capabilities() -> io::Result<()> {
    for cap in 0..=LAST_CAP {
        if !AGENT_CAPABILITIES.contains(&cap) {
            // EINVAL past the kernel's last capability is expected.
            // SAFETY: prctl with integer arguments only.
            unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        }
    }
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
    let kept = bits(AGENT_CAPABILITIES);
    let header = CapHeader { version: 0x2008_0522, pid: 0 };
    let data = [
        CapData { effective: kept, permitted: kept, inheritable: 0 },
        CapData { effective: 0, permitted: 0, inheritable: 0 },
    ];
    // SAFETY: header and data are valid for capset's v3 layout.
    check(unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as libc::c_int })
}

/// None: root keeps its bounding set across exec, and a switch to another
/// user drops its capabilities unless it asked to keep them
/// (`PR_SET_KEEPCAPS`, which `setpriv` and `capsh` use), as in a container.
/// Set rather than inherited, so nothing the agent's own bits say leaks in.
const SECURE_BITS: libc::c_ulong = 0;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn limit_capabilities() -> io::Result<()> {
    // Only root (with the agent's CAP_SETPCAP) has a bounding set to narrow;
    // a user's process lost its capabilities when it switched to the user,
    // and no_new_privs covers exec of setuid files.
    // SAFETY: prctl with integer arguments only.
    let root =
        unsafe { libc::prctl(libc::PR_CAPBSET_READ, CAP_SETPCAP, 0, 0, 0) } == 1 && unsafe { libc::geteuid() } == 0;
    if root {
        // SAFETY: prctl with integer arguments only.
        unsafe {
            check(libc::prctl(libc::PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0))?;
            for cap in 0..=LAST_CAP {
                if !ROOT_CAPABILITIES.contains(&cap) {
                    // EINVAL past the kernel's last capability is expected.
                    libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
                }
            }
        }
    }
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
    let kept = if root { bits(ROOT_CAPABILITIES) } else { 0 };
    let header = CapHeader { version: 0x2008_0522, pid: 0 };
    let data = [
        CapData { effective: kept, permitted: kept, inheritable: 0 },
        CapData { effective: 0, permitted: 0, inheritable: 0 },
    ];
    // SAFETY: header and data are valid for capset's v3 layout.
    check(unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as libc::c_int })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_keeps_only_what_the_agent_has_and_never_all_of_it() {
        let (agent, root) = (bits(AGENT_CAPABILITIES), bits(ROOT_CAPABILITIES));
        assert_eq!(root & !agent, 0, "root cannot be given what init's bounding set dropped");
        // The kernel lets a same-uid process ptrace (or read the /proc files
        // of) a target only if the target's permitted set is within its own.
        assert_ne!(agent & !root, 0, "root must not be able to trace the agent");
        assert_eq!(root & 1 << CAP_SETPCAP, 0, "root could widen its own bounding set again");
    }
}
