//! The jail itself: `jail_set(2)` parameters and how the agent is started.
//!
//! Parameter semantics follow `kern_jail_set()` in `sys/kern/kern_jail.c`:
//! integers (`securelevel`, `enforce_statfs`, `children.max`,
//! `devfs_ruleset`, and `vnet` as a `JAIL_SYS_*` value) are passed as a C
//! `int`; strings NUL-terminated; booleans by presence of the name, with a
//! `no` prefix on the last component to clear them (`allow.noraw_sockets`).

use std::fmt;
use std::path::PathBuf;

use super::{AGENT_IN_JAIL, Cmd, Layout, jail_name, tool};

/// `JAIL_SYS_NEW` from `<sys/jail.h>`: a jail-private instance (of `vnet`).
pub const JAIL_SYS_NEW: i32 = 1;

pub use copse_jailer::handoff::AGENT_SOCKET_FD;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParamValue {
    Str(String),
    Int(i32),
    /// Boolean true: the name alone.
    On,
    /// Boolean false: the name with `no` before its last component.
    Off,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailParams(pub Vec<(String, ParamValue)>);

impl JailParams {
    /// The (name, value) pairs exactly as `jail_set(2)` receives them: the
    /// boolean-false names already rewritten to their `no` form.
    pub fn wire(&self) -> Vec<(String, Option<WireValue>)> {
        self.0
            .iter()
            .map(|(name, value)| match value {
                ParamValue::Str(s) => (name.clone(), Some(WireValue::Str(s.clone()))),
                ParamValue::Int(i) => (name.clone(), Some(WireValue::Int(*i))),
                ParamValue::On => (name.clone(), None),
                ParamValue::Off => (negate(name), None),
            })
            .collect()
    }

    pub fn get(&self, name: &str) -> Option<&ParamValue> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireValue {
    Str(String),
    Int(i32),
}

/// `allow.raw_sockets` → `allow.noraw_sockets`, `persist` → `nopersist`.
fn negate(name: &str) -> String {
    match name.rsplit_once('.') {
        Some((prefix, last)) => format!("{prefix}.no{last}"),
        None => format!("no{name}"),
    }
}

impl fmt::Display for JailParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (name, value) in self.wire() {
            if !first {
                f.write_str(" ")?;
            }
            first = false;
            match value {
                Some(WireValue::Str(s)) => write!(f, "{name}={}", super::shell_quote(&s))?,
                Some(WireValue::Int(i)) => write!(f, "{name}={i}")?,
                None => f.write_str(&name)?,
            }
        }
        Ok(())
    }
}

/// `allow.*` permissions cleared explicitly. A new jail starts from
/// `JAIL_DEFAULT_ALLOW` (set_hostname, reserved_ports,
/// unprivileged_proc_debug, suser) masked by the host's own defaults, which
/// an operator can widen with `security.jail.*` sysctls; naming each one
/// makes the sandbox independent of those. Only permissions compiled into
/// every FreeBSD 13+ kernel are listed: the kernel rejects unknown names,
/// and module-provided ones (`allow.mount.*`, `allow.vmm`, `allow.nfsd`)
/// default to off and are moot while `allow.mount` is off.
pub const ALLOW_OFF: &[&str] = &[
    "allow.set_hostname",
    "allow.sysvipc",
    "allow.raw_sockets",
    "allow.chflags",
    "allow.mount",
    "allow.quotas",
    "allow.socket_af",
    "allow.mlock",
    "allow.reserved_ports",
    "allow.read_msgbuf",
    "allow.unprivileged_proc_debug",
];

/// The highest securelevel: inside the jail, immutable flags stay set,
/// and the jail cannot lower it.
pub const SECURELEVEL: i32 = 3;

/// A VNET jail rooted at the sandbox's clone, with nothing allowed beyond
/// what the agent needs.
pub fn sandbox_jail(layout: &Layout, id: &str) -> JailParams {
    let root = layout.sandbox_root(id);
    let p = |name: &str, value: ParamValue| (name.to_string(), value);
    let mut params = vec![
        p("name", ParamValue::Str(jail_name(id))),
        p("path", ParamValue::Str(root.display().to_string())),
        p("host.hostname", ParamValue::Str(id.to_string())),
        // Own network stack: the jail starts with only lo0; the epair and
        // pf rules come from the network layer.
        p("vnet", ParamValue::Int(JAIL_SYS_NEW)),
        // Only the jail's own root filesystem is visible to statfs/mount.
        p("enforce_statfs", ParamValue::Int(2)),
        p("securelevel", ParamValue::Int(SECURELEVEL)),
        // No nested jails.
        p("children.max", ParamValue::Int(0)),
        // Governs devfs mounts made from inside; allow.mount is off anyway,
        // but it documents the ruleset the host mounted /dev with.
        p("devfs_ruleset", ParamValue::Int(i32::from(layout.devfs_ruleset))),
        // Created empty, the agent is attached later: without persist the
        // kernel refuses a jail with no process ("new jail must persist or
        // attach").
        p("persist", ParamValue::On),
    ];
    params.extend(ALLOW_OFF.iter().map(|name| p(name, ParamValue::Off)));
    // The one permission kept: root inside the jail stays privileged within
    // it, because the agent must setuid(2) to the sandbox user and signal
    // its processes. Jail still confines that root (no mounts, no raw
    // sockets, no kernel state, no other jails' processes).
    params.push(p("allow.suser", ParamValue::On));
    JailParams(params)
}

/// How the agent is started inside a jail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentLaunch {
    pub jail_name: String,
    /// Path inside the jail (after `jail_attach` changed the root).
    pub program: String,
    pub args: Vec<String>,
    /// The complete environment; nothing of the gateway's leaks in.
    pub env: Vec<(String, String)>,
    pub cwd: String,
    /// Host path of the listening socket handed over as [`Self::socket_fd`].
    pub socket: PathBuf,
    pub socket_fd: i32,
}

impl fmt::Display for AgentLaunch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "jail={} cwd={} fd{}={}", self.jail_name, self.cwd, self.socket_fd, self.socket.display())?;
        for (k, v) in &self.env {
            write!(f, " {k}={}", super::shell_quote(v))?;
        }
        write!(f, " {}", self.program)?;
        for a in &self.args {
            write!(f, " {}", super::shell_quote(a))?;
        }
        Ok(())
    }
}

pub fn agent_launch(id: &str, socket: &std::path::Path) -> AgentLaunch {
    AgentLaunch {
        jail_name: jail_name(id),
        program: AGENT_IN_JAIL.to_string(),
        // The same entry point as on Linux; on FreeBSD it only takes the
        // socket from fd 3 and serves (see `freebsd::boot`).
        args: vec!["boot".into()],
        env: vec![
            ("PATH".into(), "/sbin:/bin:/usr/sbin:/usr/bin:/usr/local/sbin:/usr/local/bin".into()),
            ("HOME".into(), "/root".into()),
        ],
        cwd: "/".into(),
        socket: socket.to_path_buf(),
        socket_fd: AGENT_SOCKET_FD,
    }
}

/// A fresh VNET has lo0 down and unnumbered; code in sandboxes expects
/// `127.0.0.1` (Jupyter kernels, local servers). Runs the jail's own
/// ifconfig as the jail's root, which gives it nothing the agent does not
/// already have; `env -i` keeps the gateway's environment out.
pub fn loopback_up(id: &str) -> Cmd {
    Cmd::new(tool::ENV, ["-i", tool::JEXEC, &jail_name(id), "/sbin/ifconfig", "lo0", "inet", "127.0.0.1/8", "up"])
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn sandbox_jail_parameters_golden() {
        let params = sandbox_jail(&layout(), "i3k2m9x");
        let lines: Vec<String> = params.to_string().split(' ').map(String::from).collect();
        assert_golden(
            &lines.join("\n"),
            "
name=copse-i3k2m9x
path=/var/db/copse/sandboxes/i3k2m9x
host.hostname=i3k2m9x
vnet=1
enforce_statfs=2
securelevel=3
children.max=0
devfs_ruleset=4270
persist
allow.noset_hostname
allow.nosysvipc
allow.noraw_sockets
allow.nochflags
allow.nomount
allow.noquotas
allow.nosocket_af
allow.nomlock
allow.noreserved_ports
allow.noread_msgbuf
allow.nounprivileged_proc_debug
allow.suser",
        );
    }

    #[test]
    fn booleans_become_presence_flags_on_the_wire() {
        let params = sandbox_jail(&layout(), "a");
        let wire = params.wire();
        assert!(wire.contains(&("persist".into(), None)));
        assert!(wire.contains(&("allow.noraw_sockets".into(), None)));
        assert!(wire.contains(&("vnet".into(), Some(WireValue::Int(1)))));
        assert_eq!(negate("persist"), "nopersist");
        assert_eq!(negate("allow.mount.devfs"), "allow.mount.nodevfs");
    }

    #[test]
    fn agent_is_started_as_boot_with_fd_3_and_a_clean_environment() {
        let launch = agent_launch("abc", std::path::Path::new("/var/run/copse/abc.sock"));
        assert_eq!(
            launch.to_string(),
            "jail=copse-abc cwd=/ fd3=/var/run/copse/abc.sock \
             PATH=/sbin:/bin:/usr/sbin:/usr/bin:/usr/local/sbin:/usr/local/bin HOME=/root \
             /.copse/copse-agent boot"
        );
    }

    #[test]
    fn loopback_comes_up_through_jexec_with_an_empty_environment() {
        assert_eq!(
            loopback_up("abc").to_string(),
            "/usr/bin/env -i /usr/sbin/jexec copse-abc /sbin/ifconfig lo0 inet 127.0.0.1/8 up"
        );
    }
}
