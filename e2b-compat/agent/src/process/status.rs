//! How a finished process is reported: envd fills the `end` event from Go's
//! `os.ProcessState`, so `status` reads like `ProcessState.String()`
//! ("exit status 3", "signal: killed") and `error` like `cmd.Wait()`'s
//! error, which is the same text for any unsuccessful exit.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// The `end` event of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndInfo {
    /// Exit code, or -1 when killed by a signal (Go's `ExitCode()`).
    pub exit_code: i32,
    /// Whether the process exited on its own (not by a signal).
    pub exited: bool,
    pub status: String,
    pub error: Option<String>,
}

impl EndInfo {
    pub fn from_status(status: ExitStatus) -> Self {
        let (exit_code, exited, mut text) = match (status.code(), status.signal()) {
            (Some(code), _) => (code, true, format!("exit status {code}")),
            (None, Some(sig)) => (-1, false, format!("signal: {}", signal_name(sig))),
            (None, None) => (-1, false, "unknown status".to_string()),
        };
        if status.core_dumped() {
            text.push_str(" (core dumped)");
        }
        let error = (!status.success()).then(|| text.clone());
        Self { exit_code, exited, status: text, error }
    }

    /// For a process that could not be waited for at all.
    pub fn failed(message: String) -> Self {
        Self { exit_code: -1, exited: false, status: message.clone(), error: Some(message) }
    }
}

/// Go's descriptions of Linux signals (`syscall.Signal.String()`).
fn signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        16 => "stack fault",
        17 => "child exited",
        18 => "continued",
        19 => "stopped (signal)",
        20 => "stopped",
        21 => "stopped (tty input)",
        22 => "stopped (tty output)",
        23 => "urgent I/O condition",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        28 => "window changed",
        29 => "I/O possible",
        30 => "power failure",
        31 => "bad system call",
        n => return format!("signal {n}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Raw wait statuses: exit code in bits 8..16, signal in the low 7 bits,
    // 0x80 for a core dump.
    fn raw(v: i32) -> ExitStatus {
        ExitStatus::from_raw(v)
    }

    #[test]
    fn exit_codes_read_like_go() {
        let ok = EndInfo::from_status(raw(0));
        assert_eq!(ok, EndInfo { exit_code: 0, exited: true, status: "exit status 0".into(), error: None });
        let three = EndInfo::from_status(raw(3 << 8));
        assert_eq!(three.exit_code, 3);
        assert_eq!(three.status, "exit status 3");
        assert_eq!(three.error.as_deref(), Some("exit status 3"));
    }

    #[test]
    fn signals_read_like_go() {
        let killed = EndInfo::from_status(raw(9));
        assert_eq!((killed.exit_code, killed.exited), (-1, false));
        assert_eq!(killed.status, "signal: killed");
        assert_eq!(EndInfo::from_status(raw(15)).status, "signal: terminated");
        assert_eq!(EndInfo::from_status(raw(11 | 0x80)).status, "signal: segmentation fault (core dumped)");
        assert_eq!(EndInfo::from_status(raw(40)).status, "signal: signal 40");
    }
}
