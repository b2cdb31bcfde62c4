//! The bhyve benchmark rigs: what each measures and where they may run.
//!
//! The clocks are defined here once and copied into every result file's
//! `notes`, so a number never travels without its definition.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rig {
    Full,
    PrewarmPool,
    DurablePool,
    DurablePrewarmPool,
    FanoutRss,
}

pub const ALL: [Rig; 5] = [Rig::Full, Rig::PrewarmPool, Rig::DurablePool, Rig::DurablePrewarmPool, Rig::FanoutRss];

/// Concurrency levels of the create→agent-ready rigs.
pub const CONCURRENCY: [u32; 3] = [1, 10, 50];
/// Guest counts of the fan-out RSS rig.
pub const FANOUT_GUESTS: [u32; 5] = [8, 50, 200, 400, 1000];

impl Rig {
    pub fn name(self) -> &'static str {
        match self {
            Rig::Full => "bhyve-full",
            Rig::PrewarmPool => "bhyve-prewarm-pool",
            Rig::DurablePool => "bhyve-durable-pool",
            Rig::DurablePrewarmPool => "bhyve-durable-prewarm-pool",
            Rig::FanoutRss => "bhyve-fanout-rss",
        }
    }

    pub fn parse(name: &str) -> Option<Rig> {
        ALL.into_iter().find(|r| r.name() == name)
    }

    /// What starts and stops the clock.
    pub fn clock(self) -> &'static str {
        match self {
            Rig::Full => {
                "create_ms: from the POST /sandboxes request being written to the gateway socket until the \
                 first agent request in the new guest is answered; the guest is booted from its template image \
                 (no checkpoint)"
            }
            Rig::PrewarmPool => {
                "create_ms: from the POST /sandboxes request being written until the first agent request is \
                 answered, with the pool already holding restored, SIGSTOPped guests; the hand-out is a SIGCONT"
            }
            Rig::DurablePool => {
                "create_ms: from the POST /sandboxes request being written until the first agent request is \
                 answered; the pool holds prepared slots on disk and the clock includes `bhyve -r` with \
                 snapshot.vnode_restore=true and the identity reset"
            }
            Rig::DurablePrewarmPool => {
                "create_ms: as bhyve-prewarm-pool, for a durable pool whose slots are also kept restored; \
                 scenarios run once after `warm` and once after a simulated host reboot (pool re-warmed)"
            }
            Rig::FanoutRss => {
                "host_memory_delta_bytes: (vm.stats.vm.v_free_count + v_inactive_count) * page size read \
                 before the first restore minus the same after the N-th guest's agent answered and 10 s of \
                 idle; measured with the vnode patch and with stock copy restore"
            }
        }
    }
}

impl fmt::Display for Rig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a rig cannot run on this host, or `None` where it can be attempted.
pub fn refusal(os: &str) -> Option<String> {
    (os != "freebsd").then(|| {
        format!(
            "the bhyve rigs need a FreeBSD 15 host with vmm.ko (BHYVE_SNAPSHOT) and the patches in patches/; \
             this host runs {os}. Nothing was measured and no result file was written."
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for rig in ALL {
            assert_eq!(Rig::parse(rig.name()), Some(rig));
            assert!(rig.clock().contains("_ms:") || rig.clock().contains("_bytes:"), "{rig}");
        }
        assert_eq!(Rig::parse("bhyve"), None);
    }

    #[test]
    fn refuses_off_freebsd() {
        let why = refusal("linux").unwrap();
        assert!(why.contains("FreeBSD") && why.contains("no result file"));
        assert_eq!(refusal("freebsd"), None);
    }
}
