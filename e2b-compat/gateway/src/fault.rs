//! Fault injection for the crash test (`tests/test_crash.py`): the process
//! aborts at one named step of a state change, as a `kill -9` there would
//! leave it. Armed only by `copse up --debug-faults` (or `copse snapshot
//! import --debug-faults`) together with `COPSE_FAULT=POINT`: never by
//! anything a request carries.

use std::sync::OnceLock;

/// Every step a fault can be injected at, `operation:step`; `copse debug
/// fault-points` prints them so the test loops over all of them.
pub const POINTS: &[&str] = &[
    "pause:journaled",
    "pause:after-freeze",
    "pause:after-record",
    "pause-files:after-snapshot",
    "pause-files:after-destroy",
    "pause-files:after-record",
    "restart:after-snapshot",
    "restart:after-destroy",
    "resume:after-thaw",
    "resume:after-record",
    "resume-files:after-boot",
    "resume-files:after-record",
    "resume-files:after-delete",
    "snapshot:after-take",
    "snapshot:after-record",
    "fork:after-snapshot",
    "fork:after-children",
    "rollback:after-rollback",
    "rollback:after-record",
    "kill:after-destroy",
    "kill:after-record",
    // `copse snapshot import --debug-faults`: the files are in, the record
    // is not.
    "import:after-files",
];

static ARMED: OnceLock<String> = OnceLock::new();

/// Arms the fault `COPSE_FAULT` names, if any; an unknown name is an error
/// so a typo in the test cannot pass as "no crash".
pub fn arm_from_env() -> anyhow::Result<()> {
    let Ok(point) = std::env::var("COPSE_FAULT") else { return Ok(()) };
    if !POINTS.contains(&point.as_str()) {
        anyhow::bail!("COPSE_FAULT={point} is no fault point; `copse debug fault-points` lists them");
    }
    tracing::warn!(point, "fault injection armed: the gateway aborts at this step");
    let _ = ARMED.set(point);
    Ok(())
}

/// Aborts the process if the armed fault is `point`.
pub fn point(point: &'static str) {
    debug_assert!(POINTS.contains(&point), "unlisted fault point {point}");
    if ARMED.get().is_some_and(|armed| armed == point) {
        eprintln!("copse: injected fault at {point}; aborting");
        std::process::abort();
    }
}
