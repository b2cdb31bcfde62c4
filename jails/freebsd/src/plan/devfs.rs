//! The `/dev` a sandbox sees: a devfs mount filtered by copse's ruleset.
//!
//! devfs(8) rulesets live in the kernel; copse loads its own at start-up
//! (`devfs rule -s N add …`) instead of editing `/etc/devfs.rules`, and
//! applies it to each jail's `/dev` the way `devfs_mount_jail` in
//! `/etc/rc.subr` does for jail(8): mount, select the ruleset, applyset.
//! The mount exists before any process is in the jail, so the moment
//! between mount and applyset exposes nothing.

use std::path::Path;

use super::{Cmd, Step, tool};

/// Rules in order: hide everything, then unhide what ordinary programs
/// open. Compared with the system's `devfsrules_jail_vnet` (ruleset 5) this
/// leaves out `bpf*` (packet capture), `pf` (firewall control), `zfs`,
/// `fuse`, `crypto` and `log`: sandboxed code needs none of them.
pub const RULES: &[&str] = &[
    "hide",
    "path null unhide",
    "path zero unhide",
    "path random unhide",
    "path urandom unhide",
    // stdio and /dev/fd for shells and `cat /dev/stdin`
    "path fd unhide",
    "path fd/* unhide",
    "path stdin unhide",
    "path stdout unhide",
    "path stderr unhide",
    // PTYs: the agent opens terminals for interactive commands
    "path ptmx unhide",
    "path pts unhide",
    "path pts/* unhide",
];

/// The ruleset in devfs.rules(5) syntax, for operators who prefer to load
/// it from `/etc/devfs.rules` (docs/freebsd.md shows it).
pub fn ruleset_text(number: u16) -> String {
    let mut out = format!("[devfsrules_copse_sandbox={number}]\n");
    for rule in RULES {
        out.push_str("add ");
        out.push_str(&quote_globs(rule));
        out.push('\n');
    }
    out
}

fn quote_globs(rule: &str) -> String {
    rule.split(' ')
        .map(|w| if w.contains('*') { format!("'{w}'") } else { w.to_string() })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Replaces the kernel's copy of the ruleset: drop it, then add each rule.
pub fn load(number: u16) -> Vec<Cmd> {
    let n = number.to_string();
    let mut cmds = vec![Cmd::new(tool::DEVFS, ["rule", "-s", &n, "delset"])];
    for rule in RULES {
        let mut args = vec!["rule".to_string(), "-s".into(), n.clone(), "add".into()];
        args.extend(rule.split(' ').map(String::from));
        cmds.push(Cmd::new(tool::DEVFS, args));
    }
    cmds
}

pub fn show(number: u16) -> Cmd {
    Cmd::new(tool::DEVFS, ["rule".to_string(), "-s".into(), number.to_string(), "show".into()])
}

/// Whether `devfs rule -s N show` output already matches [`RULES`].
/// `show` prints each rule with its number first (`100 path null
/// unhide`); if the format differs from that, this says "reload", which is
/// always safe.
pub fn is_loaded(show_output: &str) -> bool {
    let loaded: Vec<String> = show_output
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| match l.split_once(' ') {
            Some((num, rest)) if num.chars().all(|c| c.is_ascii_digit()) => {
                rest.split_whitespace().collect::<Vec<_>>().join(" ")
            }
            _ => String::new(),
        })
        .collect();
    loaded.len() == RULES.len() && loaded.iter().zip(RULES).all(|(a, b)| a == b)
}

/// Steps that give a jail root its filtered `/dev`.
pub fn mount(root: &Path, number: u16) -> Vec<Step> {
    let dev = root.join("dev");
    let dev_s = dev.display().to_string();
    vec![
        Step::RealDir { path: dev.clone(), below: root.to_path_buf(), mode: 0o555 },
        Step::Run(Cmd::new(tool::MOUNT, ["-t", "devfs", "devfs", &dev_s])),
        Step::Run(Cmd::new(tool::DEVFS, ["-m".to_string(), dev_s.clone(), "ruleset".into(), number.to_string()])),
        Step::Run(Cmd::new(tool::DEVFS, ["-m", &dev_s, "rule", "applyset"])),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::super::testing::assert_golden;
    use super::*;

    #[test]
    fn ruleset_text_golden() {
        assert_golden(
            &ruleset_text(4270),
            "
[devfsrules_copse_sandbox=4270]
add hide
add path null unhide
add path zero unhide
add path random unhide
add path urandom unhide
add path fd unhide
add path 'fd/*' unhide
add path stdin unhide
add path stdout unhide
add path stderr unhide
add path ptmx unhide
add path pts unhide
add path 'pts/*' unhide
",
        );
    }

    #[test]
    fn load_commands_golden() {
        let text: String = load(4270).iter().map(|c| format!("{c}\n")).collect();
        assert_golden(
            &text,
            "
/sbin/devfs rule -s 4270 delset
/sbin/devfs rule -s 4270 add hide
/sbin/devfs rule -s 4270 add path null unhide
/sbin/devfs rule -s 4270 add path zero unhide
/sbin/devfs rule -s 4270 add path random unhide
/sbin/devfs rule -s 4270 add path urandom unhide
/sbin/devfs rule -s 4270 add path fd unhide
/sbin/devfs rule -s 4270 add path 'fd/*' unhide
/sbin/devfs rule -s 4270 add path stdin unhide
/sbin/devfs rule -s 4270 add path stdout unhide
/sbin/devfs rule -s 4270 add path stderr unhide
/sbin/devfs rule -s 4270 add path ptmx unhide
/sbin/devfs rule -s 4270 add path pts unhide
/sbin/devfs rule -s 4270 add path 'pts/*' unhide
",
        );
    }

    #[test]
    fn nothing_that_controls_the_host_is_unhidden() {
        for dangerous in ["bpf", "pf", "zfs", "mem", "kmem", "io", "fuse", "crypto", "devctl", "vmm"] {
            assert!(
                !RULES.iter().any(|r| r.split(' ').nth(1).is_some_and(|p| p.starts_with(dangerous))),
                "{dangerous}"
            );
        }
        assert_eq!(RULES[0], "hide", "everything is hidden before anything is unhidden");
    }

    #[test]
    fn show_output_decides_whether_to_reload() {
        let mut show: String = RULES.iter().enumerate().map(|(i, r)| format!("{} {r}\n", (i + 1) * 100)).collect();
        assert!(is_loaded(&show));
        show.push_str("1400 path bpf unhide\n");
        assert!(!is_loaded(&show));
        assert!(!is_loaded(""));
        assert!(!is_loaded("something unexpected\n"));
    }

    #[test]
    fn mount_steps_golden() {
        assert_golden(
            &render(&mount(Path::new("/var/db/copse/sandboxes/abc"), 4270)),
            "
realdir /var/db/copse/sandboxes/abc/dev mode=555 nosymlinks-below=/var/db/copse/sandboxes/abc
run /sbin/mount -t devfs devfs /var/db/copse/sandboxes/abc/dev
run /sbin/devfs -m /var/db/copse/sandboxes/abc/dev ruleset 4270
run /sbin/devfs -m /var/db/copse/sandboxes/abc/dev rule applyset
",
        );
    }
}
