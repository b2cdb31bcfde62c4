//! The sandbox's seccomp program, as classic BPF.
//!
//! Generated here rather than by seccompiler because of what the kernel
//! does when a filter is installed: it runs the program once for every
//! system call number to fill its action cache, and a filter with one
//! comparison per allowed call (seccompiler's linear chain, ~250 of them)
//! made every process start in a sandbox ~0.6 ms slower than the short
//! deny-list it replaced. Here the allowed numbers are merged into ranges
//! and found by binary search, a dozen instructions per call.
//!
//! Layout: architecture check (anything but x86-64 — i386 through
//! `int 0x80` — kills the process), x32 numbers refused, `clone3` answered
//! ENOSYS (its flags live in memory the filter cannot read, so libc falls
//! back to `clone`), `clone` allowed only without namespace flags, `ioctl`
//! allowed but for a list of requests, then the search. Everything not
//! allowed fails with EPERM.

use libc::sock_filter;

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JA: u16 = 0x05;
const BPF_JEQ_K: u16 = 0x15;
const BPF_JGT_K: u16 = 0x25;
const BPF_JGE_K: u16 = 0x35;
const BPF_JSET_K: u16 = 0x45;
const BPF_RET_K: u16 = 0x06;

const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_ALLOW: u32 = 0x7fff_0000;

const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
/// Every x32 system call number carries this bit.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// `struct seccomp_data`: the number at 0, the architecture at 4, the low
/// half of the first argument at 16 (little-endian).
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;
const OFFSET_ARG0_LOW: u32 = 16;
const OFFSET_ARG1_LOW: u32 = 24;

/// `clone` with any of these would hand the caller a fresh namespace (a
/// user namespace with full capabilities inside it, first of all).
const NAMESPACE_FLAGS: u32 = (libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWCGROUP) as u32;

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

fn errno(e: i32) -> u32 {
    RET_ERRNO | e as u32
}

/// The program allowing `allowed` (x86-64 numbers; `clone` and `clone3`
/// are handled as the module docs say, whatever the list holds) and `ioctl`
/// but for the requests in `refused_ioctls`.
pub fn program(allowed: &[libc::c_long], refused_ioctls: &[u32]) -> Vec<sock_filter> {
    let mut out = vec![
        stmt(BPF_LD_W_ABS, OFFSET_ARCH),
        jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, OFFSET_NR),
        jump(BPF_JSET_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET_K, errno(libc::EPERM)),
        jump(BPF_JEQ_K, libc::SYS_clone3 as u32, 0, 1),
        stmt(BPF_RET_K, errno(libc::ENOSYS)),
        jump(BPF_JEQ_K, libc::SYS_clone as u32, 0, 4),
        stmt(BPF_LD_W_ABS, OFFSET_ARG0_LOW),
        jump(BPF_JSET_K, NAMESPACE_FLAGS, 0, 1),
        stmt(BPF_RET_K, errno(libc::EPERM)),
        stmt(BPF_RET_K, RET_ALLOW),
    ];
    if !refused_ioctls.is_empty() {
        // The kernel reads an ioctl request as a 32-bit unsigned int, so the
        // low half of the argument is the whole of it.
        let n = refused_ioctls.len();
        let short = |offset: usize| u8::try_from(offset).expect("a short list of refused ioctls");
        out.push(jump(BPF_JEQ_K, libc::SYS_ioctl as u32, 0, short(n + 3)));
        out.push(stmt(BPF_LD_W_ABS, OFFSET_ARG1_LOW));
        for (k, request) in refused_ioctls.iter().enumerate() {
            out.push(jump(BPF_JEQ_K, *request, short(n - k), 0));
        }
        out.push(stmt(BPF_RET_K, RET_ALLOW));
        out.push(stmt(BPF_RET_K, errno(libc::EPERM)));
    }
    let others: Vec<u32> =
        allowed.iter().filter(|nr| ![libc::SYS_clone, libc::SYS_clone3].contains(nr)).map(|nr| *nr as u32).collect();
    search(&ranges(&others), &mut out);
    out
}

/// Sorted, merged runs of consecutive numbers, as inclusive bounds.
fn ranges(numbers: &[u32]) -> Vec<(u32, u32)> {
    let mut sorted = numbers.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for nr in sorted {
        match runs.last_mut() {
            Some((_, hi)) if *hi + 1 == nr => *hi = nr,
            _ => runs.push((nr, nr)),
        }
    }
    runs
}

/// Appends the search over `runs` for the number in the accumulator. An
/// inner node sends numbers at or above its split to the upper half, which
/// follows it, and jumps over that half (`JA`, whose offset has no 255
/// limit) to the lower one otherwise.
fn search(runs: &[(u32, u32)], out: &mut Vec<sock_filter>) {
    match runs {
        [] => out.push(stmt(BPF_RET_K, errno(libc::EPERM))),
        [(lo, hi)] => out.extend([
            jump(BPF_JGE_K, *lo, 0, 2),
            jump(BPF_JGT_K, *hi, 1, 0),
            stmt(BPF_RET_K, RET_ALLOW),
            stmt(BPF_RET_K, errno(libc::EPERM)),
        ]),
        _ => {
            let (lower, upper) = runs.split_at(runs.len() / 2);
            out.push(jump(BPF_JGE_K, upper[0].0, 1, 0));
            let skip = out.len();
            out.push(stmt(BPF_JA, 0));
            search(upper, out);
            out[skip].k = (out.len() - skip - 1) as u32;
            search(lower, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel would answer: a classic-BPF interpreter for the
    /// instructions [`program`] emits.
    fn run(program: &[sock_filter], arch: u32, nr: u32, args: [u64; 2]) -> u32 {
        let (mut pc, mut acc, mut steps) = (0usize, 0u32, 0);
        loop {
            steps += 1;
            assert!(steps < 100, "no program this size should run {steps} instructions");
            let insn = program[pc];
            pc += 1;
            let branch = |taken: bool| if taken { insn.jt as usize } else { insn.jf as usize };
            match insn.code {
                BPF_LD_W_ABS => {
                    acc = match insn.k {
                        OFFSET_NR => nr,
                        OFFSET_ARCH => arch,
                        OFFSET_ARG0_LOW => args[0] as u32,
                        OFFSET_ARG1_LOW => args[1] as u32,
                        k => panic!("load from offset {k}"),
                    }
                }
                BPF_JA => pc += insn.k as usize,
                BPF_JEQ_K => pc += branch(acc == insn.k),
                BPF_JGT_K => pc += branch(acc > insn.k),
                BPF_JGE_K => pc += branch(acc >= insn.k),
                BPF_JSET_K => pc += branch(acc & insn.k != 0),
                BPF_RET_K => return insn.k,
                code => panic!("instruction {code:#x}"),
            }
        }
    }

    const ALLOWED: &[libc::c_long] = &[0, 1, 2, 3, 5, 9, 10, 11, 16, 56, 60, 231, 300, 301, 435];
    const REFUSED: &[u32] = &[0x5000_9401, 0x5000_940E];

    #[test]
    fn every_number_gets_the_answer_of_the_list() {
        let program = program(ALLOWED, REFUSED);
        for nr in 0..1024u32 {
            let want = if nr as libc::c_long == libc::SYS_clone3 {
                errno(libc::ENOSYS)
            } else if ALLOWED.contains(&(nr as libc::c_long)) {
                RET_ALLOW
            } else {
                errno(libc::EPERM)
            };
            assert_eq!(run(&program, AUDIT_ARCH_X86_64, nr, [0, 0]), want, "system call {nr}");
        }
    }

    #[test]
    fn the_confinement_list_is_searched_in_a_few_steps_and_every_jump_lands_inside() {
        let program = program(crate::linux::confine::ALLOWED, crate::linux::confine::REFUSED_IOCTLS);
        for nr in 0..1024u32 {
            let nr_long = nr as libc::c_long;
            let want = (crate::linux::confine::ALLOWED.contains(&nr_long) || nr_long == libc::SYS_clone)
                && nr_long != libc::SYS_clone3;
            let got = run(&program, AUDIT_ARCH_X86_64, nr, [0, 0]);
            assert_eq!(got == RET_ALLOW, want, "system call {nr}");
        }
        for (pc, insn) in program.iter().enumerate() {
            let targets = match insn.code {
                BPF_JA => vec![insn.k as usize],
                BPF_JEQ_K | BPF_JGT_K | BPF_JGE_K | BPF_JSET_K => vec![insn.jt as usize, insn.jf as usize],
                _ => vec![],
            };
            assert!(targets.iter().all(|t| pc + 1 + t < program.len()), "instruction {pc} jumps out");
        }
        // The linear chain this replaced had one comparison per allowed call.
        assert!(program.len() < crate::linux::confine::ALLOWED.len(), "{} instructions", program.len());
    }

    #[test]
    fn clone_with_a_namespace_flag_other_architectures_and_x32_are_refused() {
        let program = program(ALLOWED, REFUSED);
        let clone = libc::SYS_clone as u32;
        let thread = (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_THREAD) as u64;
        assert_eq!(run(&program, AUDIT_ARCH_X86_64, clone, [thread, 0]), RET_ALLOW);
        assert_eq!(run(&program, AUDIT_ARCH_X86_64, clone, [libc::SIGCHLD as u64, 0]), RET_ALLOW);
        for flag in [libc::CLONE_NEWUSER, libc::CLONE_NEWNS, libc::CLONE_NEWNET, libc::CLONE_NEWPID] {
            let flags = libc::SIGCHLD as u64 | flag as u64;
            assert_eq!(run(&program, AUDIT_ARCH_X86_64, clone, [flags, 0]), errno(libc::EPERM), "flag {flag:#x}");
        }
        const AUDIT_ARCH_I386: u32 = 0x4000_0003;
        assert_eq!(run(&program, AUDIT_ARCH_I386, 20, [0, 0]), RET_KILL_PROCESS);
        assert_eq!(run(&program, AUDIT_ARCH_X86_64, X32_SYSCALL_BIT | 1, [0, 0]), errno(libc::EPERM));
    }

    #[test]
    fn ioctl_is_allowed_but_for_the_refused_requests_whatever_the_upper_half() {
        let program = program(ALLOWED, REFUSED);
        let ioctl = libc::SYS_ioctl as u32;
        for request in REFUSED {
            for upper in [0u64, 0xffff_ffff_0000_0000] {
                let arg = upper | u64::from(*request);
                assert_eq!(run(&program, AUDIT_ARCH_X86_64, ioctl, [3, arg]), errno(libc::EPERM), "{arg:#x}");
            }
        }
        // TCGETS, a btrfs request not in the list, none.
        for request in [0x5401u64, 0x5000_9402, 0] {
            assert_eq!(run(&program, AUDIT_ARCH_X86_64, ioctl, [3, request]), RET_ALLOW, "{request:#x}");
        }
        // The search after the ioctl block still sees the system call number.
        assert_eq!(run(&program, AUDIT_ARCH_X86_64, 60, [0, 0x5000_9401]), RET_ALLOW);
    }

    #[test]
    fn runs_merge_consecutive_numbers() {
        assert_eq!(ranges(&[5, 1, 2, 3, 9, 10, 3]), vec![(1, 3), (5, 5), (9, 10)]);
        assert_eq!(ranges(&[]), vec![]);
    }
}
