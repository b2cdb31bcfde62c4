//! rctl(8): per-jail resource limits and usage.
//!
//! Rules are keyed by jail *name* and outlive the jail, so teardown removes
//! them explicitly. Needs `kern.racct.enable=1` at boot (see docs/freebsd.md).

use super::{Cmd, jail_name, sandbox_of_jail, tool};
use copse_substrate::{Limits, Usage};

/// Open files across the whole jail. `Limits` has no field for it; this is
/// far above what a code sandbox needs and far below the host's maxfiles.
pub const OPENFILES: u64 = 16384;
/// Write bandwidth to disk, bytes per second (throttled, not refused).
pub const WRITEBPS: u64 = 128 * 1024 * 1024;

/// The rules for one sandbox, in rctl(8) syntax
/// (`subject:subject-id:resource:action=amount`).
pub fn rules(id: &str, limits: &Limits) -> Vec<String> {
    let subject = format!("jail:{}", jail_name(id));
    let memory = limits.memory_mb * 1024 * 1024;
    // pcpu is a percentage of one CPU; deny on pcpu throttles the jail.
    let pcpu = u64::from(limits.cpu_count) * 100;
    [
        format!("memoryuse:deny={memory}"),
        format!("pcpu:deny={pcpu}"),
        format!("maxproc:deny={}", limits.pids),
        format!("openfiles:deny={OPENFILES}"),
        format!("writebps:throttle={WRITEBPS}"),
        // No core files: a dump would carry the process's memory (tokens
        // included) into the jail's disk, as Linux's RLIMIT_CORE 0/0
        // prevents. Enforced by the kernel whatever the jail's root sets
        // with ulimit (not run on FreeBSD).
        "coredumpsize:deny=0".to_string(),
    ]
    .into_iter()
    .map(|r| format!("{subject}:{r}"))
    .collect()
}

pub fn add(rule: &str) -> Cmd {
    Cmd::new(tool::RCTL, ["-a", rule])
}

/// Removes every rule whose subject is the sandbox's jail.
pub fn remove_all(id: &str) -> Cmd {
    Cmd::new(tool::RCTL, ["-r".to_string(), format!("jail:{}", jail_name(id))])
}

/// Lists every rule on the host (one per line).
pub fn list() -> Cmd {
    Cmd::new(tool::RCTL, std::iter::empty::<String>())
}

/// Resource usage of one jail as `resource=amount` lines.
pub fn usage(id: &str) -> Cmd {
    Cmd::new(tool::RCTL, ["-u".to_string(), format!("jail:{}", jail_name(id))])
}

/// Sandbox ids that have at least one rule, from `rctl` listing output
/// such as `jail:copse-abc:memoryuse:deny=536870912`.
pub fn parse_rule_owners(text: &str) -> Vec<String> {
    let mut ids: Vec<String> = text
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("jail:")?;
            let (name, _) = rest.split_once(':')?;
            sandbox_of_jail(name).map(String::from)
        })
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Fills what rctl measures into [`Usage`]. `cputime` is whole seconds in
/// racct, so `cpu_ns` has one-second resolution here. rctl has no page
/// cache figure: `memory_cache_bytes` stays 0. `disk_bytes` comes from ZFS.
pub fn parse_usage(text: &str) -> Result<Usage, String> {
    let mut usage = Usage::default();
    let mut seen = false;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Some((key, value)) = line.split_once('=') else {
            return Err(format!("unexpected rctl -u line {line:?}"));
        };
        let number = || value.parse::<u64>().map_err(|_| format!("bad amount in rctl -u line {line:?}"));
        match key {
            "cputime" => {
                usage.cpu_ns = number()?.saturating_mul(1_000_000_000);
                seen = true;
            }
            "memoryuse" => {
                usage.memory_bytes = number()?;
                seen = true;
            }
            _ => {}
        }
    }
    if seen { Ok(usage) } else { Err("rctl -u printed neither cputime nor memoryuse".into()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_golden() {
        let limits = Limits { cpu_count: 2, memory_mb: 512, disk_mb: 1024, pids: 256 };
        let cmds: Vec<String> = rules("i3k2m9x", &limits).iter().map(|r| add(r).to_string()).collect();
        assert_eq!(
            cmds,
            [
                "/usr/bin/rctl -a jail:copse-i3k2m9x:memoryuse:deny=536870912",
                "/usr/bin/rctl -a jail:copse-i3k2m9x:pcpu:deny=200",
                "/usr/bin/rctl -a jail:copse-i3k2m9x:maxproc:deny=256",
                "/usr/bin/rctl -a jail:copse-i3k2m9x:openfiles:deny=16384",
                "/usr/bin/rctl -a jail:copse-i3k2m9x:writebps:throttle=134217728",
                "/usr/bin/rctl -a jail:copse-i3k2m9x:coredumpsize:deny=0",
            ]
        );
        assert_eq!(remove_all("i3k2m9x").to_string(), "/usr/bin/rctl -r jail:copse-i3k2m9x");
        assert_eq!(usage("i3k2m9x").to_string(), "/usr/bin/rctl -u jail:copse-i3k2m9x");
    }

    #[test]
    fn usage_output_is_parsed() {
        // Shape of `rctl -u jail:<name>`: every racct resource, one per line.
        let text = "cputime=37\ndatasize=1282048\nstacksize=0\ncoredumpsize=0\nmemoryuse=94371840\n\
                    memorylocked=0\nmaxproc=7\nopenfiles=212\nvmemoryuse=1430155264\npseudoterminals=1\n\
                    swapuse=0\nnthr=19\nmsgqqueued=0\nmsgqsize=0\nnmsgq=0\nnsem=0\nnsemop=0\nnshm=0\n\
                    shmsize=0\nwallclock=3604\npcpu=4\nreadbps=0\nwritebps=8192\nreadiops=0\nwriteiops=2\n";
        let usage = parse_usage(text).unwrap();
        assert_eq!(usage.cpu_ns, 37_000_000_000);
        assert_eq!(usage.memory_bytes, 94_371_840);
        assert_eq!(usage.memory_cache_bytes, 0);
        assert!(parse_usage("").is_err());
        assert!(parse_usage("cputime=lots\n").is_err());
    }

    #[test]
    fn rule_listing_names_the_sandboxes_that_own_rules() {
        let text = "jail:copse-abc:memoryuse:deny=536870912\n\
                    jail:copse-abc:pcpu:deny=200\n\
                    user:1001:maxproc:deny=100\n\
                    jail:www:memoryuse:deny=1073741824\n\
                    jail:copse-zz9:maxproc:deny=512\n";
        assert_eq!(parse_rule_owners(text), ["abc", "zz9"]);
    }
}
