//! Linux confinement: no capabilities, `no_new_privs`, and a seccomp filter
//! that refuses system calls which widen the kernel attack surface.

use std::collections::BTreeMap;
use std::io;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

use crate::syscall::check;

/// System calls a sandboxed process never needs and that have a history of
/// kernel exploits or would undo the sandbox (mounts, namespaces, modules).
const REFUSED: &[libc::c_long] = &[
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_acct,
    libc::SYS_userfaultfd,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_syslog,
    libc::SYS_quotactl,
    libc::SYS_lookup_dcookie,
    libc::SYS_vhangup,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
];

/// A prepared confinement; see the module docs of `copse_jailer::confine`.
pub struct Confinement {
    filter: BpfProgram,
}

impl Confinement {
    pub fn new() -> io::Result<Self> {
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = REFUSED.iter().map(|nr| (*nr, Vec::new())).collect();
        // clone(2) with any namespace flag would give the caller a fresh
        // user namespace with full capabilities inside it.
        let any_namespace_flag: Vec<SeccompRule> = [
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWNS,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWUTS,
            libc::CLONE_NEWIPC,
            libc::CLONE_NEWCGROUP,
        ]
        .iter()
        .map(|flag| {
            let flag = *flag as u64;
            let cond = SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(flag), flag)
                .map_err(io::Error::other)?;
            SeccompRule::new(vec![cond]).map_err(io::Error::other)
        })
        .collect::<io::Result<_>>()?;
        rules.insert(libc::SYS_clone, any_namespace_flag);
        // clone3 passes its flags in memory that seccomp cannot inspect;
        // ENOSYS makes libc fall back to clone(2), which is filtered above.
        let filter = SeccompFilter::new(
            rules,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EPERM as u32),
            TargetArch::x86_64,
        )
        .map_err(io::Error::other)?;
        let mut program: BpfProgram = filter.try_into().map_err(io::Error::other)?;
        prepend_clone3_enosys(&mut program);
        Ok(Self { filter: program })
    }

    /// Drop every capability, forbid gaining new ones, install the filter.
    /// Only system calls: safe between `fork` and `exec`.
    pub fn apply(&self) -> io::Result<()> {
        drop_capabilities()?;
        // SAFETY: plain prctl with integer arguments.
        check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
        seccompiler::apply_filter(&self.filter).map_err(io::Error::other)
    }
}

/// Makes `clone3` fail with ENOSYS ahead of the generated filter.
fn prepend_clone3_enosys(program: &mut BpfProgram) {
    use seccompiler::sock_filter;
    const BPF_LD_W_ABS: u16 = 0x20;
    const BPF_JEQ_K: u16 = 0x15;
    const BPF_RET_K: u16 = 0x06;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    // seccomp_data: nr at offset 0, arch at offset 4.
    let head = [
        sock_filter { code: BPF_LD_W_ABS, jt: 0, jf: 0, k: 4 },
        sock_filter { code: BPF_JEQ_K, jt: 0, jf: 3, k: AUDIT_ARCH_X86_64 },
        sock_filter { code: BPF_LD_W_ABS, jt: 0, jf: 0, k: 0 },
        sock_filter { code: BPF_JEQ_K, jt: 0, jf: 1, k: libc::SYS_clone3 as u32 },
        sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k: SECCOMP_RET_ERRNO | libc::ENOSYS as u32 },
    ];
    program.splice(0..0, head);
}

const CAP_SETPCAP: libc::c_int = 8;
const LAST_CAP: libc::c_int = 63;
/// SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP(_LOCKED)
/// | SECBIT_KEEP_CAPS_LOCKED: uid 0 gets no capabilities from exec.
const SECURE_BITS: libc::c_ulong = 0x01 | 0x02 | 0x04 | 0x08 | 0x20;

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

fn drop_capabilities() -> io::Result<()> {
    // A process that already lost CAP_SETPCAP (a non-root user after
    // setuid) has nothing left to drop from its bounding set that it could
    // use; no_new_privs covers exec of setuid files.
    // SAFETY: prctl with integer arguments only.
    let has_setpcap =
        unsafe { libc::prctl(libc::PR_CAPBSET_READ, CAP_SETPCAP, 0, 0, 0) } == 1 && unsafe { libc::geteuid() } == 0;
    if has_setpcap {
        // SAFETY: prctl with integer arguments only.
        unsafe {
            check(libc::prctl(libc::PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0))?;
            for cap in 0..=LAST_CAP {
                // EINVAL past the kernel's last capability is expected.
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
        }
    }
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
    let header = CapHeader { version: 0x2008_0522, pid: 0 };
    let data = [CapData { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: header and data are valid for capset's v3 layout.
    check(unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as libc::c_int })
}
